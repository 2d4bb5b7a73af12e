"""Small asyncio building blocks: a byte budget, a bounded closable channel, and structured gather.

How this works: ``ByteBudget`` is a semaphore counted in bytes (a request larger than the whole
budget is admitted alone, so nothing deadlocks). ``Channel`` is a bounded FIFO between two pipeline
stages with trio-like semantics: ``close()`` ends it gracefully (the reader drains what is left, then
gets ``ChannelClosed``), ``fail(exc)`` breaks it (both ends raise). ``run_all`` runs coroutines
concurrently and, on the first failure, cancels the rest and waits for them before re-raising, so no
task outlives its scope (Python 3.10 has no TaskGroup). ``within`` is ``wait_for`` that passes a
cancellation through. ``install_uvloop`` picks uvloop when present.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
from typing import Any, Awaitable, Callable, Coroutine, Generic, Iterable, Optional, TypeVar

T = TypeVar("T")


class ChannelClosed(Exception):
    """The channel was closed and is empty."""


class ByteBudget:
    """At most ``limit`` bytes in flight; FIFO fair."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def __repr__(self) -> str:
        return f"<ByteBudget {self.in_use}/{self.limit} bytes, {len(self._waiters)} waiting>"

    async def acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self.in_use += nbytes
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (nbytes, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(nbytes)  # granted just as we were cancelled: give it back
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self.in_use += n
                fut.set_result(None)

    def fits_now(self, nbytes: int) -> bool:
        """Whether ``acquire(nbytes)`` would return at once."""
        return not self._waiters and self._fits(nbytes)

    def _fits(self, nbytes: int) -> bool:
        return self.in_use + nbytes <= self.limit or self.in_use == 0


class Channel(Generic[T]):
    """A bounded FIFO with explicit close (graceful) and fail (broken) states."""

    def __init__(self, capacity: int) -> None:
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=capacity)
        self._closed = False
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "broken" if self._error else "closed" if self._closed else "open"
        return f"<Channel {state} {self._queue.qsize()}/{self._queue.maxsize}>"

    async def send(self, item: T) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ChannelClosed("send on a closed channel")
        await self._queue.put(item)

    async def receive(self) -> T:
        while True:
            if self._error is not None:
                raise self._error
            if self._closed and self._queue.empty():
                raise ChannelClosed("channel closed")
            item = await self._queue.get()
            if item is _WAKE:
                continue
            return item

    def receive_nowait(self) -> Optional[T]:
        """The next item if one is queued now, else None (closed or not); raises if the channel is broken."""
        if self._error is not None:
            raise self._error
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not _WAKE:
                return item
        return None

    def close(self) -> None:
        self._closed = True
        self._wake()

    def drain_nowait(self) -> list[T]:
        """Take whatever is still queued (for cleanup after a failure)."""
        items = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not _WAKE:
                items.append(item)
        return items

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        try:
            self._queue.put_nowait(_WAKE)  # unblock a waiting receiver
        except asyncio.QueueFull:
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except ChannelClosed:
            raise StopAsyncIteration from None


_WAKE = object()


async def run_all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first error cancel the others, wait for them, then re-raise it. A lone
    coroutine is awaited in the caller's task (no task of its own, no loop turn before it starts: a
    one-receiver round's lane)."""
    coros = list(coros)
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def within(aw: Awaitable[T], timeout: Optional[float]) -> T:
    """``asyncio.wait_for`` that never swallows a cancellation: Python 3.11's returns the result when its
    caller is cancelled just as ``aw`` completes, so a cancelled loop (a round, a receive) runs on and
    whoever waits for it to end waits for ever. Here: ``asyncio.timeout`` (3.11+), which raises
    ``TimeoutError`` when the time is up and passes any other cancellation through."""
    if timeout is None:
        return await aw
    if not hasattr(asyncio, "timeout"):  # (3.10: wait_for is what there is)
        return await asyncio.wait_for(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw


async def shielded(aw: Awaitable[T]) -> T:
    """Await cleanup even if the caller is being cancelled; cancellation is re-raised afterwards."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


class Waiters:
    """Coroutines waiting for conditions that the owner's state changes make true: ``wait(predicate)``
    returns once ``predicate()`` holds, checked now and at each ``wake()``."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Callable[[], bool], asyncio.Future]] = []

    def __repr__(self) -> str:
        return f"<Waiters waiting={len(self._waiting)}>"

    async def wait(self, predicate: Callable[[], bool]) -> None:
        if predicate():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((predicate, fut))
        try:
            await fut
        finally:
            self._waiting = [(p, f) for p, f in self._waiting if f is not fut]

    def wake(self) -> None:
        for predicate, fut in self._waiting:
            if not fut.done() and predicate():
                fut.set_result(None)


class AsyncResource:
    """``async with`` support and an idempotent ``close`` whose teardown runs shielded from cancellation."""

    _closed = False

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await shielded(self._teardown())

    async def _teardown(self) -> None:
        raise NotImplementedError


class Spinner:
    """Keeps a process ready while someone holds it (a round is open): its event loop polls instead of
    sleeping (``enabled``), so a message or a completion that arrives meanwhile is picked up at the next
    loop iteration, not after the thread wakes from an idle ``epoll`` (hundreds of microseconds on the
    GPU machine, docs/TRANSPORTS.md; costs one busy core while held), and Python's cyclic garbage
    collector waits (``Collector``: a full collection of a process holding torch took 50-250 ms, and
    one that fell inside a checked round stalled it that long). ``hold``/``release`` nest."""

    def __init__(self, enabled: bool = True, collector: bool = True) -> None:
        self.enabled = enabled
        self.collector = collector
        self.holders = 0
        self.held = 0  # times held
        self.spins = 0  # loop iterations spent polling
        self._task: Optional[asyncio.Task] = None

    def __repr__(self) -> str:
        return (f"<Spinner enabled={self.enabled} holders={self.holders} held={self.held} spins={self.spins} "
                f"collector_paused={Collector.paused()}>")

    def hold(self) -> None:
        if not self.enabled and not self.collector:
            return
        self.holders += 1
        self.held += 1
        if self.collector:
            Collector.pause(1)
        if self.enabled and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._spin())

    def release(self) -> None:
        if self.holders > 0:
            self.holders -= 1
            if self.collector:
                Collector.resume(1)

    def cancel(self) -> None:
        held, self.holders = self.holders, 0
        if self.collector:
            Collector.resume(held)
        if self._task is not None:
            self._task.cancel()

    async def _spin(self) -> None:
        while self.holders > 0:
            self.spins += 1
            await asyncio.sleep(0)


class Collector:
    """Python's cyclic garbage collector (``gc``), paused while any holder in the process holds it (one
    per open round of each controller and worker, threads included) and enabled again when the last one
    lets go, unless it was disabled before the first. Reference counting frees everything else as
    usual; cycles made meanwhile are collected after."""

    _lock = threading.Lock()
    _holds = 0
    _enable_after = False

    @classmethod
    def pause(cls, n: int) -> None:
        with cls._lock:
            if cls._holds == 0:
                cls._enable_after = gc.isenabled()
                gc.disable()
            cls._holds += n

    @classmethod
    def resume(cls, n: int) -> None:
        if n <= 0:
            return
        with cls._lock:
            cls._holds = max(0, cls._holds - n)
            if cls._holds == 0 and cls._enable_after:
                gc.enable()

    @classmethod
    def paused(cls) -> int:
        return cls._holds


def install_uvloop() -> bool:
    """Use uvloop's event loop policy where the platform has it; returns whether it did."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
