"""TCP specifics: mirrors, whole frames, payloads drained when their region closes, delivery proofs
(engine/transports/tcp.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.engine.datapath.compiled import CopyRow
from weightsync.engine.errors import TransportError
from weightsync.engine.transports import tcp, tcp_connect, tcp_frames
from transport_helpers import connect_while_closing, tcp_pair

WATCHDOG = 20


async def test_tcp_settle_uploads_only_regions_tcp_wrote():
    """Under ``auto`` another transport may fill a device buffer directly: a TCP mirror that saw no
    write must not be copied over it (checked here with the mirror bookkeeping on CPU)."""
    async with tcp_pair() as (src, dst, conn):
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)
        await conn.fence()
        assert dst._dirty == {0}
        await dst.settle()  # no mirrors on CPU: nothing to upload, and the dirty set is consumed
        assert dst._dirty == set()


async def test_a_write_cancelled_mid_frame_leaves_the_stream_whole():
    """An aborted round cancels its writes; a frame already half on the wire must still be finished,
    or the target would read the next frame as the rest of this payload (and land garbage)."""
    big = 64 << 20
    async with tcp_pair(big + 64) as (src, dst, conn):
        on_the_wire = asyncio.Event()
        real = conn._writable

        async def writable():
            on_the_wire.set()  # part of the frame is sent; the socket is full
            await real()

        conn._writable = writable
        first = torch.full((big,), 3, dtype=torch.uint8)
        task = asyncio.ensure_future(conn.write(first, 0, 0, 1))
        await asyncio.wait_for(on_the_wire.wait(), WATCHDOG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await conn.write(torch.full((64,), 9, dtype=torch.uint8), 0, big, 1)
        await asyncio.wait_for(conn.fence(), WATCHDOG)  # both frames whole: counts agree
        region = dst.regions[0]
        assert bytes(region[big:big + 64]) == bytes([9]) * 64 and region[big - 1] == 3


async def test_a_payload_still_arriving_when_its_region_closes_is_drained_not_landed():
    """A shadow buffer becomes live at commit: the rest of a write already under way into it must not
    land there (its target was fixed when its header arrived)."""
    big = 32 << 20
    async with tcp_pair(big) as (src, dst, conn):
        (agent,) = dst._agents
        arriving = asyncio.Event()
        real = agent.buffer_updated

        def updated(n):
            real(n)
            if agent.state == "payload" and agent.pos > 0:
                arriving.set()

        agent.buffer_updated = updated
        write = asyncio.ensure_future(conn.write(torch.full((big,), 5, dtype=torch.uint8), 0, 0, 1))
        await asyncio.wait_for(arriving.wait(), WATCHDOG)
        landed_before = agent.pos
        dst.guard.open_regions(())  # the region stops being writable mid-payload
        await asyncio.wait_for(write, WATCHDOG)
        with pytest.raises(TransportError, match="stopped mid-payload"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        region = dst.regions[0]
        assert landed_before < big and region[big - 1] == 0  # the rest never landed
        assert bytes(region[landed_before:]).count(0) == big - landed_before


async def test_a_refused_write_fails_its_own_rounds_fence_and_no_later_rounds():
    """A write the target refuses (a plan race: its current plan does not name the writer) fails the
    fence of its own round, which is still open there. Where no fence came in that round (a lane that
    sealed early sends none) and the round closed at the target, the refusal is that round's alone: a
    later round's fence on the same connection must not report it (it blamed the target for a round
    it served well: the churn's wrong blames)."""
    async with tcp_pair(64) as (src, dst, conn):
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)
        await asyncio.wait_for(conn.fence(), WATCHDOG)  # (the connection has proved its key)
        keys = dict(dst.guard.keys)
        dst.guard.authorize({})  # a plan that does not name sender/0
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)
        with pytest.raises(TransportError, match="does not name it"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 2)  # round 2, refused, sealed early
        await asyncio.wait_for(dst.await_proofs({0: conn.seal()}, 10.0), WATCHDOG)  # (it reached the target)
        assert dst.guard.refused == 2
        dst.close_epoch(2)  # round 2 is over at the target
        dst.guard.authorize(keys)  # the next plan names sender/0 again
        await conn.write(torch.full((8,), 3, dtype=torch.uint8), 0, 0, 3)
        await asyncio.wait_for(conn.fence(), WATCHDOG)
        assert bytes(dst.regions[0][:8]) == bytes([3]) * 8


async def test_a_seal_proves_the_issued_writes_and_the_target_waits_until_they_land():
    """``seal`` right after ``submit`` (the frame not yet sent: its task has not run): the target's
    ``await_proofs`` waits until the bytes are in its region, and only for the sender that proved its key
    on that connection."""
    async with tcp_pair(64) as (src, dst, conn):
        done = conn.submit(torch.full((48,), 7, dtype=torch.uint8), 0, 8, 1)
        proof = conn.seal()
        assert proof is not None and not done.done()
        assert await asyncio.wait_for(dst.await_proofs({0: proof}, 10.0), WATCHDOG) == {}
        assert bytes(dst.regions[0][8:56]) == bytes([7]) * 48
        wrong = await asyncio.wait_for(dst.await_proofs({3: proof}, 10.0), WATCHDOG)  # another sender cites it
        assert "sender/0" in wrong[3]
        forged = tcp.PROOF.pack(tcp.PROOF_MAGIC, bytes(16), 1, 48)  # a challenge no connection has
        assert "no open connection" in (await dst.await_proofs({0: forged}, 10.0))[0]
        await done
        await conn.fence()


async def test_writes_cancelled_before_they_are_sent_leave_the_issued_count():
    """A failed round cancels its queued writes, some before their task ever ran: a later proof must
    count only what was sent, or the receiver would wait for writes that never come."""
    async with tcp_pair(64) as (src, dst, conn):
        ops = [conn.submit(torch.full((8,), i, dtype=torch.uint8), 0, 8 * i, 1) for i in range(4)]
        replayed = conn.replay(conn.compile([CopyRow("r", torch.ones(8, dtype=torch.uint8), 0, 32, 8)]), 1)
        for op in ops[1:] + replayed:
            op.cancel()
        await asyncio.gather(*ops, *replayed, return_exceptions=True)
        assert (conn.issued_count, conn.issued_bytes) == (conn.sent_count, conn.sent_bytes) == (1, 8)
        await conn.write(torch.full((8,), 5, dtype=torch.uint8), 0, 56, 2)
        assert await asyncio.wait_for(dst.await_proofs({0: conn.seal()}, 10.0), WATCHDOG) == {}
        await conn.fence()


async def test_submit_many_sends_rows_in_chunks_of_frames_that_a_seal_covers(monkeypatch):
    """A writer's batch of staged rows (``submit_many``): one task sends their frames a chunk per
    ``sendmsg``; counted as issued at once (a seal made before the task ran covers them), landed in order."""
    monkeypatch.setattr(tcp_frames, "CHUNK_IOVECS", 5)  # (two frames a chunk: rows 0-1, 2-3, 4-5, 6)
    async with tcp_pair(256) as (src, dst, conn):
        rows = [torch.full((8 + i,), i + 1, dtype=torch.uint8) for i in range(7)]
        offsets = [sum(8 + j for j in range(i)) for i in range(7)]
        sent = []
        real = conn._send_views
        conn._send_views = lambda views: (sent.append(len(views)), real(views))[1]
        ops = conn.submit_many([(r, 0, off, None) for r, off in zip(rows, offsets)], 3)
        assert len(ops) == 7 and conn.issued_count == 7 and not ops[0].done()
        proof = conn.seal()
        assert await asyncio.wait_for(dst.await_proofs({0: proof}, 10.0), WATCHDOG) == {}
        assert bytes(dst.regions[0][:offsets[-1] + 14]) == bytes(torch.cat(rows).numpy())
        await asyncio.gather(*ops)
        assert sent == [4, 4, 4, 2] and (conn.sent_count, conn.sent_bytes) == (7, sum(r.numel() for r in rows))
        await conn.fence()
        assert (dst.counters(3)[0].count, dst.counters(3)[0].nbytes) == (7, sum(r.numel() for r in rows))


async def test_a_batch_cancelled_before_it_is_sent_leaves_the_issued_count():
    async with tcp_pair(64) as (src, dst, conn):
        ops = conn.submit_many([(torch.full((8,), i, dtype=torch.uint8), 0, 8 * i, None) for i in range(3)], 1)
        ops[0].cancel()
        await asyncio.gather(*ops, return_exceptions=True)
        assert (conn.issued_count, conn.issued_bytes) == (conn.sent_count, conn.sent_bytes) == (0, 0)
        await conn.write(torch.full((8,), 5, dtype=torch.uint8), 0, 56, 2)
        assert await asyncio.wait_for(dst.await_proofs({0: conn.seal()}, 10.0), WATCHDOG) == {}
        await conn.fence()


async def test_a_proof_fails_at_once_when_its_connection_closes():
    """Writes a proof counts that can never arrive (the sender's connection is gone) fail the wait when
    the target sees the close, not at the proof timeout."""
    async with tcp_pair(64) as (src, dst, conn):
        proof = tcp.PROOF.pack(tcp.PROOF_MAGIC, conn.nonce, 1, 8)  # one write more than will ever come
        waiting = asyncio.ensure_future(dst.await_proofs({0: proof}, 600.0))
        await conn.close()
        failed = await asyncio.wait_for(waiting, WATCHDOG)
        assert "closed" in failed[0]


async def test_a_lane_seals_early_only_up_to_the_early_seal_bytes(monkeypatch):
    """Past ``EARLY_SEAL_BYTES`` since the last fence a connection does not seal (``writes_done`` then
    follows the fence, as without proofs): a verdict must not wait on bulk data still on the link."""
    monkeypatch.setattr(tcp, "EARLY_SEAL_BYTES", 16)
    async with tcp_pair(64) as (src, dst, conn):
        await conn.write(torch.ones(16, dtype=torch.uint8), 0, 0, 1)
        assert conn.seal() is not None
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 16, 1)
        assert conn.seal() is None
        await conn.fence()
        assert conn.seal() is not None  # (counted from the fence)


async def test_a_frame_of_unknown_op_closes_the_connection_and_is_counted_and_logged(caplog):
    """An authenticated sender whose stream goes wrong (a frame of an op the target does not know) is
    closed, and the target says so where an operator looks: a refusal counted and logged, naming the
    sender, not only an error its next fence would have carried."""
    async with tcp_pair(64) as (src, dst, conn):
        async with conn.lock:
            await conn._send([tcp.HEADER.pack(99, 0, 0, 0, 0)])
        with pytest.raises(TransportError):
            await asyncio.wait_for(conn.fence(), WATCHDOG)  # (the target closed: the fence fails)
        assert dst.guard.refused == 1 and any("unknown frame op 99" in r for r in dst.guard.recent)
        assert "unknown frame op 99" in caplog.text


async def test_a_connect_that_times_out_says_whether_it_was_answered():
    """A listening socket nobody serves completes the TCP handshake in the kernel: the connect succeeds
    and the challenge never comes ("no challenge within"). Once its accept queue is full the kernel
    drops the SYNs: the connect itself is never answered ("no connection within")."""
    import socket

    from weightsync.engine.transport import TransportOptions, create_transport
    from weightsync.wire import PeerInfo, TransportInfo

    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(0)  # (never accepts: the kernel answers for it until its queue is full)
    src = create_transport("tcp", TransportOptions(connect_timeout_s=0.2))
    await src.start(0)
    info = TransportInfo("tcp", "h", "127.0.0.1:%d" % mute.getsockname()[1], "cpu", tcp.PROOF_TAG)
    fillers = []
    try:
        with pytest.raises(TransportError, match=r"no challenge within 0\.2s") as err:
            await src.connect(PeerInfo(1, info, ()))
        assert err.value.peer == "receiver/1"
        for _ in range(8):  # (fill the accept queue, whatever its length on this kernel)
            fillers.append(socket.socket())
            fillers[-1].setblocking(False)
            fillers[-1].connect_ex(mute.getsockname())
        with pytest.raises(TransportError, match=r"no connection within 0\.2s"):
            await src.connect(PeerInfo(1, info, ()))
    finally:
        await src.close()
        for f in fillers:
            f.close()
        mute.close()


async def test_a_connect_whose_syn_is_dropped_starts_again_on_a_fresh_socket(monkeypatch):
    """The SYN of a connect is dropped (the target's accept queue is full, as a partition drops it); the
    queue then frees. The kernel would send that SYN again only 1 s after the first, past this
    connect's 0.8 s: a fresh socket after ``connect_attempt_s`` gets through, reads the challenge and
    proves its key."""
    import socket

    from weightsync.engine.transports.tcp_frames import HEADER, OP_CHALLENGE
    from weightsync.engine.transport import TransportOptions, create_transport
    from weightsync.wire import PeerInfo, TransportInfo

    loop = asyncio.get_running_loop()
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen(0)
    target.setblocking(False)
    src = create_transport("tcp", TransportOptions(connect_timeout_s=0.8, connect_attempt_s=0.2))
    await src.start(0)
    info = TransportInfo("tcp", "h", "127.0.0.1:%d" % target.getsockname()[1], "cpu", tcp.PROOF_TAG)
    fillers, accepted, sockets = [], [], []
    first = asyncio.Event()
    made = tcp_connect.make_socket

    def socket_made(host, options):
        sockets.append(made(host, options))
        first.set()
        return sockets[-1]

    monkeypatch.setattr(tcp_connect, "make_socket", socket_made)
    try:
        for _ in range(8):  # (fill the accept queue, whatever its length on this kernel)
            fillers.append(socket.socket())
            fillers[-1].setblocking(False)
            fillers[-1].connect_ex(target.getsockname())
        connecting = asyncio.ensure_future(src.connect(PeerInfo(1, info, ())))
        await asyncio.wait_for(first.wait(), WATCHDOG)  # (its SYN is sent, and dropped, by now)
        while True:  # free the queue: what the kernel accepted so far is the fillers'
            try:
                accepted.append(target.accept()[0])
            except BlockingIOError:
                break
        peer, _ = await asyncio.wait_for(loop.sock_accept(target), WATCHDOG)
        accepted.append(peer)
        await loop.sock_sendall(peer, HEADER.pack(OP_CHALLENGE, 0, 1, 2, 0))
        conn = await asyncio.wait_for(connecting, WATCHDOG)
        assert src.connect_retries >= 1 and len(sockets) == src.connect_retries + 1
        assert all(s.fileno() == -1 for s in sockets[:-1])  # every abandoned attempt's socket is closed
        assert "connect_retries=" in repr(src)
        await conn.close()
    finally:
        await src.close()
        for s in fillers + accepted:
            s.close()
        target.close()


@pytest.mark.parametrize("attempt", [0, -1.0])
def test_a_connect_attempt_of_no_time_is_refused_naming_the_option(attempt):
    from weightsync.engine.errors import ConfigError
    from weightsync.engine.transport import TransportOptions

    with pytest.raises(ConfigError, match="connect_attempt_s"):
        TransportOptions(connect_attempt_s=attempt)


@pytest.mark.parametrize("turns", range(5))
async def test_a_connection_accepted_as_the_transport_closes_hears_its_end_not_silence(turns):
    """Senders connect while their receiver closes, ``turns`` loop turns after the kernel took their
    connections: each must hear a reset or an end of stream at once. (asyncio's own server left one it
    had accepted, but not yet given a transport, open and silent when it closed then: the sender waited
    its whole ``connect_timeout_s`` for a challenge, ``engine.transports.listen``.)"""
    from weightsync.engine.transport import TransportOptions

    target = tcp.TcpTransport(TransportOptions())
    await target.start(0)
    await connect_while_closing(target.address, target.close, turns)
