"""Asyncio primitives: byte budget, channels, structured gather (engine/aio.py)."""

from __future__ import annotations

import asyncio

import pytest

from weightsync.engine.aio import ByteBudget, Channel, ChannelClosed, run_all, within
from loop_helpers import one_loop_iteration

WATCHDOG = 20


async def test_byte_budget_bounds_and_admits_oversized_alone():
    budget = ByteBudget(100)
    await budget.acquire(60)
    waiter = asyncio.ensure_future(budget.acquire(50))
    await one_loop_iteration()  # the waiter parks
    assert not waiter.done() and budget.in_use == 60
    budget.release(60)
    await asyncio.wait_for(waiter, WATCHDOG)
    assert budget.in_use == 50
    budget.release(50)
    await budget.acquire(1000)  # larger than the budget: admitted when nothing else is in flight
    assert budget.in_use == 1000


async def test_byte_budget_cancelled_waiter_gives_nothing_away():
    budget = ByteBudget(10)
    await budget.acquire(10)
    waiter = asyncio.ensure_future(budget.acquire(5))
    await one_loop_iteration()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    budget.release(10)
    assert budget.in_use == 0 and "0 waiting" in repr(budget)


async def test_channel_close_drains_then_ends_and_fail_breaks_both_ends():
    ch: Channel = Channel(2)
    await ch.send(1)
    await ch.send(2)
    ch.close()
    assert [x async for x in ch] == [1, 2]
    with pytest.raises(ChannelClosed):
        await ch.send(3)
    broken: Channel = Channel(1)
    broken.fail(ValueError("boom"))
    with pytest.raises(ValueError):
        await broken.receive()
    with pytest.raises(ValueError):
        await broken.send(1)


async def test_channel_receive_nowait_takes_only_what_is_queued():
    ch: Channel = Channel(3)
    assert ch.receive_nowait() is None
    await ch.send(1)
    await ch.send(2)
    assert [ch.receive_nowait(), ch.receive_nowait(), ch.receive_nowait()] == [1, 2, None]
    ch.close()  # (queues a wake-up marker: never handed out as an item)
    assert ch.receive_nowait() is None
    with pytest.raises(ChannelClosed):
        await ch.receive()
    broken: Channel = Channel(1)
    broken.fail(ValueError("boom"))
    with pytest.raises(ValueError):
        broken.receive_nowait()


async def test_run_all_cancels_siblings_on_first_error():
    cancelled = asyncio.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def fail():
        raise RuntimeError("first")

    with pytest.raises(RuntimeError, match="first"):
        await asyncio.wait_for(run_all([forever(), fail()]), WATCHDOG)
    assert cancelled.is_set()


async def test_run_all_awaits_a_lone_coroutine_in_the_callers_task_with_its_error_and_cancellation():
    """One coroutine (a one-receiver round's lane) runs in the caller's task, starting at once; its error
    reaches the caller, and cancelling the caller cancels it."""
    caller, cancelled, started = asyncio.current_task(), asyncio.Event(), asyncio.Event()

    async def which():
        return asyncio.current_task()

    async def fail():
        raise RuntimeError("lone")

    async def forever():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    assert await run_all([which()]) == [caller] and await run_all(iter([which()])) == [caller]
    with pytest.raises(RuntimeError, match="lone"):
        await run_all([fail()])
    task = asyncio.ensure_future(run_all([forever()]))
    await asyncio.wait_for(started.wait(), WATCHDOG)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set() and await run_all([]) == []


async def test_the_collector_waits_while_any_round_is_open_and_comes_back_after_the_last():
    """``Spinner`` pauses Python's cyclic garbage collector while held (a round is open; a full collection
    of a process holding torch took 50-250 ms, inside a round that long a stall): holders nest, across
    spinners of the process (a controller and workers in one), and ``cancel`` lets go of all of a
    spinner's holds; a collector the application had disabled stays disabled."""
    import gc

    from weightsync.engine.aio import Collector, Spinner

    assert gc.isenabled() and Collector.paused() == 0
    controller, worker = Spinner(enabled=False), Spinner(enabled=True)
    controller.hold()
    assert not gc.isenabled()
    worker.hold()
    worker.hold()
    controller.release()
    assert not gc.isenabled() and Collector.paused() == 2  # (the worker's two rounds still open)
    worker.cancel()
    assert gc.isenabled() and Collector.paused() == 0 and worker.holders == 0
    controller.release()  # (nothing held: no effect)
    assert gc.isenabled() and Collector.paused() == 0
    off = Spinner(enabled=False, collector=False)
    off.hold()
    assert gc.isenabled()
    off.release()
    gc.disable()  # the application's choice
    try:
        controller.hold()
        controller.release()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("timeout", [10.0, None])
async def test_within_passes_on_a_cancellation_that_arrives_as_what_it_waits_for_completes(timeout):
    """The awaited future resolves and the waiting task is cancelled in the same loop pass: the task
    ends cancelled (Python 3.11's ``wait_for`` returns the result instead, and a cancelled loop runs on)."""
    fut = asyncio.get_running_loop().create_future()
    after = []

    async def loop_body():
        await within(asyncio.shield(fut), timeout)
        after.append("ran on")

    task = asyncio.ensure_future(loop_body())
    await one_loop_iteration()  # (the task waits on the future)
    fut.set_result(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []


async def test_within_times_out_with_timeout_error_and_returns_results():
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await within(never, 0.01)
    assert never.cancelled()
    done = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await within(done, 5.0) == 7
