"""Session streams (roles.channel_stream): after welcome a session's messages go on a TCP stream of its own;
only the key's holders complete one, a token names one session once, a record altered in flight or a
stream that closes ends the session (and the worker joins again), and rounds commit bit-exact there."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest
import zmq

from weightsync.roles import (Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver,
                              WeightSender)
from weightsync.engine.errors import ConfigError, RoundAborted
from weightsync.roles.channel import ControlChannel
from weightsync.roles.channel_stream import Link, dial
from weightsync.wire import stream as ws
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place

WATCHDOG = 30
KEY = b"k" * 32


async def _round(ctl, sender, ts, recv, version):
    update_in_place(ts, version)
    await asyncio.wait_for(await sender.push(version), WATCHDOG)
    assert (await ctl.wait_round(version)).ok and mismatches(recv, version) == []


@pytest.mark.parametrize("key", [None, KEY])
async def test_a_sessions_messages_go_on_its_stream_and_rounds_commit_there(key):
    """(No pulses: they go on ZeroMQ by design, whenever a loop on a loaded machine misses two beats.)"""
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(auth_key=key)) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(auth_key=key, pulse=False)) as receiver, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(auth_key=key, pulse=False)) as sender:
        await ctl.wait_ready()
        before = {w.name: w._channel._io.taken for w in (sender, receiver)}
        zmq_before = ctl._chan.received - sum(link.received for link in ctl._chan.streams.links.values())
        for v in (1, 2, 3):
            await _round(ctl, sender, ts, recv, v)
        for w in (sender, receiver):
            link = w._channel.streams.links[b""]
            assert w._channel.streams.streaming and link.received > 0 and w._channel._io.taken > before[w.name]
            assert (link.sealer._aead is not None) == (key is not None)  # (sealed only under a key)
        assert {link.name for link in ctl._chan.streams.links.values()} == {sender._identity.decode(), receiver._identity.decode()}
        # every message the controller got since the plan came by a stream, none by its ZeroMQ socket
        assert ctl._chan.received - sum(link.received for link in ctl._chan.streams.links.values()) == zmq_before


async def test_a_session_stays_on_zeromq_where_either_side_does_not_offer_streams():
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(session_streams=False)) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0) as receiver, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(session_stream=False)) as sender:
        await _round(ctl, sender, ts, recv, 1)
        assert ctl._chan.streams.listener is None and not sender._channel.streams.streaming and not receiver._channel.streams.streaming
    async with Controller(senders=1, receivers=1) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0) as receiver, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(session_stream=False)) as sender:
        await _round(ctl, sender, ts, recv, 2)
        assert receiver._channel.streams.streaming and not sender._channel.streams.streaming
        assert list(ctl._chan.streams.links) == [receiver._identity]


async def _raw_handshake(port: int, key) -> socket.socket:
    """A client's half of the handshake under ``key`` (None: none), on a blocking socket: the socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WATCHDOG)
    first = ws.opening()
    sock.sendall(first)
    answer = b""
    while len(answer) < ws.ANSWER_BYTES:
        answer += sock.recv(ws.ANSWER_BYTES - len(answer))
    proof, _ = ws.client_proof(ws.stream_key(key), first[len(ws.MAGIC):], answer)
    sock.sendall(proof)
    return sock


async def test_without_the_key_no_stream_is_made_and_each_try_is_counted():
    async with Controller(senders=1, receivers=1, options=ControllerOptions(auth_key=KEY)) as ctl:
        port = ctl._chan.streams.listener.port
        with pytest.raises(ws.StreamRefused, match="server's proof"):  # (the client finds out first)
            await asyncio.to_thread(asyncio.run, _raw_handshake(port, b"x" * 32))
        with socket.create_connection(("127.0.0.1", port), timeout=WATCHDOG) as sock:  # (not a weightsync client)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await ctl._chan.wait_refused(2)
        assert ctl._chan.refused == 2 and not ctl._chan.streams.links


@pytest.mark.parametrize("key", [None, KEY])
async def test_a_token_names_one_session_once(key):
    """A stream with a token the controller never issued, or with one already used (a replay of the
    session's own), is refused and carries nothing."""
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(auth_key=key)) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(auth_key=key)) as receiver, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(auth_key=key)) as sender:
        await ctl.wait_ready()
        port, used = ctl._chan.streams.listener.port, sender.welcome.stream_token
        closed = []
        for token in (bytes(16), used):
            link = await dial("127.0.0.1", port, token, key, dscp=0, max_record=1 << 20, deliver=closed.append,
                              on_closed=lambda link, why: closed.append(why), name="intruder", timeout=WATCHDOG)
            await ctl._chan.wait_refused(len(closed) + 1)
            link.close()
        assert ctl._chan.refused == 2 and len(ctl._chan.streams.links) == 2  # (the two members' own, nothing else)
        await _round(ctl, sender, ts, recv, 1)


async def test_a_record_altered_in_flight_ends_the_session_and_the_worker_joins_again():
    """The controller's stream to the sender carries a record whose sealed bytes were changed: the
    sender cannot open it, closes the stream, its session ends, and it joins again on a new one."""
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(auth_key=KEY)) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(auth_key=KEY)) as receiver, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(auth_key=KEY)) as sender:
        await _round(ctl, sender, ts, recv, 1)
        link = ctl._chan.streams.links[sender._identity]
        sealed = bytearray(link.sealer.seal(ws.pack([b"header", b"body", b"tag"])))
        sealed[5] ^= 1
        link.sock.send(ws.record(bytes(sealed)))
        plan = ctl.plan.plan_id
        await asyncio.wait_for(ctl.wait_plan(plan), WATCHDOG)  # (the sender's new session is planned)
        assert sender.sessions == 2
        await _round(ctl, sender, ts, recv, 2)


async def test_a_stream_that_closes_ends_the_session_at_once_and_the_worker_joins_again():
    ts, recv = sender_tensors(0), receiver_tensors()
    opts = ControllerOptions(timeout_s=120.0)  # (no heartbeat could notice it within the test)
    async with Controller(senders=1, receivers=1, options=opts) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0) as receiver, \
            WeightSender(ctl.address, ts, rank=0) as sender:
        await _round(ctl, sender, ts, recv, 1)
        plan = ctl.plan.plan_id
        ctl._chan.streams.links[receiver._identity].close("closed by the test")
        await asyncio.wait_for(ctl.wait_plan(plan), WATCHDOG)
        assert receiver.sessions == 2 and sender.sessions == 1
        await _round(ctl, sender, ts, recv, 2)


async def _killed(worker) -> None:
    """As a process killed by SIGKILL leaves it: its sockets close and nothing is said."""
    worker._channel.close()
    for task in worker._tasks:
        task.cancel()
    await asyncio.gather(*worker._tasks, return_exceptions=True)
    worker._channel = None
    await worker.close()


async def test_a_stream_closed_from_the_workers_side_ends_its_session_at_once_blaming_it(caplog):
    """A worker's process dies: its stream's end (no network's silence makes one) ends the session at the
    controller at once, naming the member, and the rank's next process joins without waiting out the
    dead one's silence (never a DUPLICATE_RANK against a session that is gone)."""
    ts, recv = sender_tensors(0), receiver_tensors()
    opts = ControllerOptions(timeout_s=120.0)  # (no heartbeat could notice it within the test)
    async with Controller(senders=1, receivers=1, options=opts) as ctl, \
            WeightSender(ctl.address, ts, rank=0) as sender:
        receiver = await WeightReceiver(ctl.address, recv, rank=0).__aenter__()
        await _round(ctl, sender, ts, recv, 1)
        plan = ctl.plan.plan_id
        caplog.set_level("INFO", logger="weightsync")
        await _killed(receiver)
        await asyncio.wait_for(ctl.waiters.wait(lambda: len(ctl.peers) == 1), WATCHDOG)
        assert "controller: receiver/0 dropped: its session stream closed by the peer" in caplog.text
        async with WeightReceiver(ctl.address, recv, rank=0) as again:
            await asyncio.wait_for(ctl.wait_plan(plan), WATCHDOG)
            assert again.sessions == 1 and "DUPLICATE_RANK" not in caplog.text
            await _round(ctl, sender, ts, recv, 2)
        # a clean leave is read before its stream's end: the member left, and nothing else is said of it
        await asyncio.wait_for(ctl.waiters.wait(lambda: len(ctl.peers) == 1), WATCHDOG)
        assert "controller: receiver/0 dropped: left" in caplog.text
        assert caplog.text.count("dropped: its session stream") == 1


@pytest.mark.parametrize("deaf", [False, True], ids=["heard", "controller-deaf"])
async def test_a_receiver_whose_process_dies_mid_round_aborts_it_at_once_naming_it(deaf):
    """Two receivers (a two-phase round): receiver/1's process dies as its fence comes. The round aborts
    blaming receiver/1 as soon as its stream ends, long before any timeout, and the receiver that
    stayed still serves the version before. ``deaf``: the controller's own loop had just stalled (a
    deaf spell beginning as receiver/1 was last heard, which for silence would make the controller the
    culprit); a stream's end is still the member's doing (a network's silence ends no stream)."""
    ts, recv0, recv1 = sender_tensors(0), receiver_tensors(), receiver_tensors()
    opts = ControllerOptions(timeout_s=120.0, round_timeout_s=120.0)  # (neither could end it within the test)
    async with Controller(senders=1, receivers=2, options=opts) as ctl, \
            WeightReceiver(ctl.address, recv0, rank=0) as receiver0, \
            WeightSender(ctl.address, ts, rank=0) as sender:
        receiver1 = await WeightReceiver(ctl.address, recv1, rank=1).__aenter__()
        await _round(ctl, sender, ts, recv0, 1)
        peer = next(p for p in ctl.peers.values() if p.name == "receiver/1")

        async def dies(env) -> None:  # (its sockets close as the kernel closes a dead process's)
            if deaf:
                ctl.hearing.spell = (peer.last_seen, peer.last_seen + 2 * ctl.hearing.quiet_s)
                assert ctl.hearing.explains(peer.last_seen, time.monotonic(), len(ctl.peers))
            receiver1._channel.close()

        receiver1._on_fence = dies
        update_in_place(ts, 2)
        with pytest.raises(RoundAborted) as e:
            await asyncio.wait_for(await sender.push(2), WATCHDOG)
        assert e.value.culprit == "receiver/1" and "its session stream" in str(e.value)
        assert "own network" not in str(e.value)
        assert receiver0.version == 1 and mismatches(recv0, 1) == []
        receiver1._channel = None
        await receiver1.close()


async def test_the_streams_port_can_be_fixed_and_one_taken_or_out_of_range_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="stream_port: cannot listen on 127.0.0.1"):
            await Controller(senders=1, receivers=1, options=ControllerOptions(stream_port=port)).__aenter__()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(stream_port=port)) as ctl:
        assert ctl._chan.streams.listener.port == port  # (the port freed above: fixed, as a firewall needs)
        async with WeightReceiver(ctl.address, receiver_tensors(), rank=0) as receiver:
            assert receiver.welcome.stream_port == port and receiver._channel.streams.streaming
    for bad in (-1, 65536, "5555"):
        with pytest.raises(ConfigError, match="stream_port"):
            ControllerOptions(stream_port=bad)


async def test_a_record_over_the_limit_closes_the_stream_before_it_is_read():
    ours, theirs = socket.socketpair()
    closed = asyncio.Event()
    why = []
    link = Link(ours, None, None, 1024, deliver=lambda frames: pytest.fail("nothing is delivered"),
                on_closed=lambda link, reason: (why.append(reason), closed.set()), name="worker")
    with theirs:
        theirs.sendall((1 << 30).to_bytes(4, "little"))  # (a gigabyte announced: refused at its length)
        await asyncio.wait_for(closed.wait(), WATCHDOG)
    assert link.closed and "over the stream's limit of 1024" in why[0]


async def test_a_connection_that_never_finishes_its_handshake_is_closed_and_counted():
    chan = ControlChannel(zmq.ROUTER, "controller")
    try:
        chan.bind("tcp://127.0.0.1:0")
        port = chan.listen_stream("127.0.0.1")
        chan.streams.listener.handshake_s = 0.2
        with socket.create_connection(("127.0.0.1", port), timeout=WATCHDOG) as idle:
            idle.sendall(ws.opening()[:10])  # (and then nothing)
            await asyncio.wait_for(chan.wait_refused(1), WATCHDOG)
            assert await asyncio.to_thread(idle.recv, 100) == b""  # (closed on it)
    finally:
        chan.close()


async def test_a_worker_that_cannot_reach_the_streams_port_joins_on_zeromq_alone():
    """A firewall that lets the ZeroMQ endpoint through and not the streams' port: the stream fails to
    connect, the worker joins again without offering streams, and its rounds commit over ZeroMQ."""
    ts, recv = sender_tensors(0), receiver_tensors()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # (bound, never listening: a connection there is refused)
        async with Controller(senders=1, receivers=1) as ctl:
            ctl._chan.streams.listener.port = closed.getsockname()[1]  # (what the welcomes name)
            async with WeightReceiver(ctl.address, recv, rank=0) as receiver, \
                    WeightSender(ctl.address, ts, rank=0) as sender:
                await _round(ctl, sender, ts, recv, 1)
                for w in (sender, receiver):
                    assert not w.streams_ok and not w._channel.streams.streaming and "stream" not in w.welcome.capabilities
                assert not ctl._chan.streams.links


async def test_a_peer_that_reads_nothing_has_its_stream_closed_once_a_few_messages_wait_unsent():
    ours, theirs = socket.socketpair()
    why = []
    link = Link(ours, None, None, 1024, deliver=lambda frames: None, on_closed=lambda link, reason: why.append(reason),
                name="worker")
    with theirs:  # (never read: the kernel's buffers fill, then the link's own)
        sent = 0
        while link.send([bytes(1000)]):
            sent += 1
        assert sent > 4 and link.closed and "unread" in why[0] and len(why) == 1


async def test_connections_past_the_handshake_limit_are_closed_at_once_and_counted():
    chan = ControlChannel(zmq.ROUTER, "controller")
    try:
        chan.bind("tcp://127.0.0.1:0")
        port = chan.listen_stream("127.0.0.1")
        assert chan.streams.listener.max_pending == 1024  # (the documented limit)
        chan.streams.listener.max_pending = 2
        socks = [socket.create_connection(("127.0.0.1", port), timeout=WATCHDOG) for _ in range(3)]
        try:
            await asyncio.wait_for(chan.wait_refused(1), WATCHDOG)
            assert await asyncio.to_thread(socks[2].recv, 100) == b"" and len(chan.streams.listener.pending) == 2
        finally:
            for sock in socks:
                sock.close()
    finally:
        chan.close()
