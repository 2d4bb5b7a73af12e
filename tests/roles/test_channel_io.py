"""``roles.channel_io.Pump``: a plain ZeroMQ socket driven from the event loop (the control channel's I/O).

Its descriptor is edge-triggered and any send or receive may consume its signal: a wake-up lost that way
would hang a test here (each waits with a watchdog), so these drive the cases that lose one: sends
that find no room yet, an inbox that fills, ping-pong where every send races the reply."""

from __future__ import annotations

import asyncio
import contextlib
import select

import pytest
import zmq

from weightsync.roles.channel_io import Pump

WATCHDOG = 20


@contextlib.contextmanager
def pair(max_inbox: int = 1024, connect: bool = True):
    """(router pump, dealer pump, the router's endpoint, the dealer's socket); both closed after."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"d")
    addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    if connect:
        dealer.connect(addr)
    r, d = Pump(router, max_inbox), Pump(dealer, max_inbox)
    try:
        yield r, d, addr, dealer
    finally:
        r.close()
        d.close()
        router.close(0)
        dealer.close(0)
        ctx.term()


async def test_sends_without_room_wait_in_order_and_go_when_a_peer_connects():
    with pair(connect=False) as (router, dealer, addr, dealer_sock):
        sends = [dealer.send([b"%d" % i]) for i in range(5)]  # (a DEALER with no peer has no room)
        assert not any(s.done() for s in sends) and len(dealer.outbox) == 5
        dealer_sock.connect(addr)
        await asyncio.wait_for(asyncio.gather(*sends), WATCHDOG)
        got = [await asyncio.wait_for(router.recv(), WATCHDOG) for _ in range(5)]
        assert [frames for frames in got] == [[b"d", b"%d" % i] for i in range(5)]


async def test_a_cancelled_waiting_send_is_dropped_whole_and_later_ones_still_go():
    with pair(connect=False) as (router, dealer, addr, dealer_sock):
        first, second, third = (dealer.send([b"a", b"%d" % i]) for i in range(3))
        second.cancel()
        dealer_sock.connect(addr)
        await asyncio.wait_for(asyncio.gather(first, third), WATCHDOG)
        got = [await asyncio.wait_for(router.recv(), WATCHDOG) for _ in range(2)]
        assert got == [[b"d", b"a", b"0"], [b"d", b"a", b"2"]]


async def test_an_inbox_that_fills_takes_the_rest_as_it_empties():
    with pair(max_inbox=4) as (router, dealer, _, _):
        await asyncio.wait_for(asyncio.gather(*(dealer.send([b"%d" % i]) for i in range(50))), WATCHDOG)
        got = [(await asyncio.wait_for(router.recv(), WATCHDOG))[1] for _ in range(50)]
        assert got == [b"%d" % i for i in range(50)]
        assert len(router.inbox) == 0


async def test_a_send_looks_for_what_arrived_while_a_receive_waits():
    """Anything that touches the socket may reset its descriptor's signal (here a poll does, as a send can):
    the send that follows finds the message and wakes the waiting receive, with no signal left to do it."""
    with pair() as (router, dealer, _, dealer_sock):
        receiving = router.recv()
        waiter = receiving.send(None)  # (stepped by hand: waiting on its future)
        dealer_sock.send(b"hello")
        assert router.raw.poll(WATCHDOG * 1000, zmq.POLLIN)  # (it arrived; the poll took the signal)
        router.send([b"d", b"reply"])
        assert waiter.done()
        with pytest.raises(StopIteration) as stop:
            receiving.send(None)
        assert stop.value.value == [b"d", b"hello"]


async def test_ping_pong_loses_no_wake_up():
    with pair() as (router, dealer, _, _):
        async def echo():
            for _ in range(500):
                peer, body = await router.recv()
                router.send([peer, body])

        server = asyncio.ensure_future(echo())
        for i in range(500):
            dealer.send([b"%d" % i])
            assert await asyncio.wait_for(dealer.recv(), WATCHDOG) == [b"%d" % i]
        await asyncio.wait_for(server, WATCHDOG)


async def test_close_cancels_what_waits():
    with pair(connect=False) as (router, dealer, _, _):
        receiving = router.recv()
        waiter = receiving.send(None)  # (stepped by hand: it now waits on this future)
        assert waiter is router.waiter and not waiter.done()
        queued = dealer.send([b"x"])
        router.close()
        dealer.close()
        with pytest.raises(asyncio.CancelledError):
            receiving.send(None)
        assert queued.cancelled()
        assert dealer.send([b"y"]).cancelled()  # (a closed pump takes nothing)
        with pytest.raises(asyncio.CancelledError):  # (nor waits)
            await router.recv()


def test_a_socket_used_from_a_later_event_loop_moves_to_it():
    """A pump first driven by one loop (``asyncio.run``) and then by another still wakes its receives."""
    with pair() as (router, dealer, _, _):
        async def exchange(i):
            dealer.send([b"%d" % i])
            peer, body = await asyncio.wait_for(router.recv(), WATCHDOG)
            router.send([peer, body])
            return await asyncio.wait_for(dealer.recv(), WATCHDOG)

        assert asyncio.run(exchange(1)) == [b"1"]
        assert asyncio.run(exchange(2)) == [b"2"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_backlog_counts_what_was_delivered_and_unhandled_and_a_closed_one_ends_every_wait(stream):
    """``roles.backlog.Backlog`` over a real channel pair: nothing delivered, nothing to read; two messages
    delivered while nobody read them, a wait until both were taken and the second handled; closing the
    backlog (its session over) ends a wait that nothing else would. ``stream``: the pair's session
    stream carries them (``delivered`` reads what waits in the kernel's buffer)."""
    from weightsync.roles.backlog import Backlog
    from weightsync.roles.channel import ControlChannel
    from weightsync.wire import messages as m

    controller, worker = ControlChannel(zmq.ROUTER, "controller"), ControlChannel(zmq.DEALER, "sender/0")
    try:
        worker.connect(controller.bind("tcp://127.0.0.1:*"))
        await worker.send(m.Heartbeat(1))
        peer, _ = await asyncio.wait_for(controller.recv(), WATCHDOG)
        if stream:
            token, port = bytes(range(16)), controller.listen_stream("127.0.0.1")
            controller.expect(peer, token)
            await worker.attach("127.0.0.1", port, token, WATCHDOG)
            await asyncio.wait_for(controller.wait_attached(peer), WATCHDOG)
        backlog = Backlog(worker)
        assert backlog.unread() is None and Backlog(None).unread() is None
        for seq in (2, 3):
            await controller.send(m.Heartbeat(seq), to=peer)
        while worker.delivered() < 2:  # (delivered, not read: as while a caller held the loop)
            if stream:
                assert select.select([worker.streams.links[b""].sock], [], [], WATCHDOG)[0]
            else:
                assert worker._io.raw.poll(WATCHDOG * 1000, zmq.POLLIN)
        assert backlog.unread() == 2 and worker.received == 0
        reading = asyncio.ensure_future(backlog.read(2))
        for seq in (2, 3):
            _, env = await asyncio.wait_for(worker.recv(), WATCHDOG)
            backlog.taking()
            assert env.body.seq == seq and not reading.done()
            backlog.handled()
        await asyncio.wait_for(reading, WATCHDOG)
        assert backlog.unread() is None
        backlog.taking()
        stuck = asyncio.ensure_future(backlog.read(99))
        backlog.close()
        await asyncio.wait_for(stuck, WATCHDOG)
        assert backlog.unread() is None and not backlog.handling
    finally:
        worker.close()
        controller.close()
