"""Round integrity across departures and restarts, and the authenticated data plane (one event loop,
real TCP and ZeroMQ on loopback). Each test is one defect an operator hit."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket

import pytest
import torch

from children import free_port
from weightsync.engine import dataauth
from weightsync.engine.errors import TransportError, VersionError
from weightsync.engine.transports import tcp_frames
from proc_helpers import mismatches, push, receiver_tensors, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender

FAST = ControllerOptions(heartbeat_s=0.05, timeout_s=0.5, checksum="crc32")
WATCHDOG = 30


async def applied(version, *receivers):
    """Wait until each receiver has applied ``version``: a push returns at the commit, which a receiver
    of a two-phase round applies on its own message, not always before the sender hears of it."""
    for receiver in receivers:
        await asyncio.wait_for(receiver.wait_for(version), WATCHDOG)


async def test_a_departed_senders_pending_push_never_starts_a_round():
    a_t, b_t, a2_t, recv_t = sender_tensors(0), sender_tensors(0), sender_tensors(0), receiver_tensors()
    async with Controller(senders=2, receivers=1, options=FAST) as ctl, \
            WeightReceiver(ctl.address, recv_t, rank=0) as receiver:
        a = await WeightSender(ctl.address, a_t, rank=0).__aenter__()
        async with WeightSender(ctl.address, b_t, rank=1) as b:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            assert await asyncio.wait_for(a.push_nowait(50).sent, WATCHDOG) is False  # pending: sender/1 has not pushed 50
            await a.close()  # sender/0 goes away with its push pending (its leave follows the push)
            for v in (1, 2, 3):  # sender/1 alone goes on
                await push(b, b_t, v)
        async with WeightSender(ctl.address, a2_t, rank=0) as a2:  # a fresh sender/0, alone
            assert a2.committed == 3  # told at join what was committed before it
            with pytest.raises(VersionError):
                a2.push_nowait(2)
            await push(a2, a2_t, 4)
        assert [r.version for r in ctl.reports] == [1, 2, 3, 4]  # never a round 50 from the stale push
        assert receiver.version == 4 and mismatches(recv_t, 4) == []


async def test_mismatched_pushes_end_in_a_typed_error_and_can_resync():
    ts = [sender_tensors(0), sender_tensors(0)]
    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, round_timeout_s=0.5)
    async with Controller(senders=2, receivers=1, options=opts) as ctl, \
            WeightSender(ctl.address, ts[0], rank=0) as a, WeightSender(ctl.address, ts[1], rank=1) as b, \
            WeightReceiver(ctl.address, receiver_tensors(), rank=0) as receiver:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        stale = a.push_nowait(5)
        newer = b.push_nowait(6)
        with pytest.raises(VersionError, match="sender/1 pushed a newer version"):
            await asyncio.wait_for(stale, WATCHDOG)  # v5 can never start: sender/1 passed it
        update_in_place(ts[0], 6)
        await asyncio.wait_for(a.push_nowait(6), WATCHDOG)  # sender/0 catches up: round 6 runs
        await asyncio.wait_for(newer, WATCHDOG)
        lonely = a.push_nowait(7)  # sender/1 never pushes 7: the round timeout ends the wait
        with pytest.raises(VersionError, match="waited 0.5s for sender/1"):
            await asyncio.wait_for(lonely, WATCHDOG)
        assert receiver.version == 6


@pytest.mark.parametrize("receivers", [1, 2])
async def test_a_stage_that_outlasts_the_round_timeout_aborts_the_round_as_timeout(receivers):
    """A receiver whose verdict never comes (one phase: ``fence_commit``; two: ``fence``): the round
    aborts with ``TIMEOUT`` naming the stage once ``round_timeout_s`` has passed, no receiver serves it,
    and the next round, with the verdict back, commits bit-exact everywhere."""
    from weightsync.engine.errors import RoundAborted
    from weightsync.wire import messages as m

    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, round_timeout_s=0.5)
    send_t, recv_ts = sender_tensors(0), [receiver_tensors() for _ in range(receivers)]
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=1, receivers=receivers, options=opts))
        sender = await stack.enter_async_context(WeightSender(ctl.address, send_t, rank=0))
        rs = [await stack.enter_async_context(WeightReceiver(ctl.address, t, rank=r)) for r, t in enumerate(recv_ts)]
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        await applied(1, *rs)
        verdict = rs[-1]._verdict

        async def never(body):
            await asyncio.Event().wait()  # (cancelled by the round's abort)
        rs[-1]._verdict = never
        with pytest.raises(RoundAborted) as err:
            await push(sender, send_t, 2)
        assert err.value.reason == m.AbortReason.TIMEOUT and "stage fenced took longer than 0.5s" in str(err.value)
        assert ctl.reports[-1].version == 2 and not ctl.reports[-1].ok and [r.version for r in rs] == [1] * receivers
        rs[-1]._verdict = verdict
        await push(sender, send_t, 3)
        await applied(3, *rs)
        assert all(mismatches(t, 3) == [] for t in recv_ts)


async def test_an_abort_after_the_last_fence_ack_stands_and_no_commit_goes_out(monkeypatch):
    """Two receivers: the last ``fence_ack`` completes the fence stage and, in the same loop turn, before
    the round's task runs again, the round is aborted (a member leaving, a sender's error, handled by the
    receive loop first). The abort stands: no ``commit`` goes out, no receiver serves the version, the
    push ends in ``RoundAborted`` as the report does, and the next round commits bit-exact. (The task
    used to go on to commit a round it had recorded aborted: every receiver served it, the controller's
    committed version stayed behind.)"""
    from weightsync.engine.errors import RoundAborted
    from weightsync.roles import round_state
    from weightsync.wire import messages as m

    maybe = round_state.RoundState._maybe

    def then_abort(rnd, stage, complete):
        maybe(rnd, stage, complete)
        if rnd.version == 2 and stage == "fenced" and rnd.futures[stage].done() and rnd.aborted is None:
            assert rnd.abort(m.AbortReason.PEER_LOST, "sender/0 left as the last fence_ack came", "sender/0")
    monkeypatch.setattr(round_state.RoundState, "_maybe", then_abort)
    send_t, recv_ts = sender_tensors(0), [receiver_tensors() for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=1, receivers=2, options=FAST))
        sender = await stack.enter_async_context(WeightSender(ctl.address, send_t, rank=0))
        rs = [await stack.enter_async_context(WeightReceiver(ctl.address, t, rank=r)) for r, t in enumerate(recv_ts)]
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        await applied(1, *rs)
        with pytest.raises(RoundAborted) as err:
            await push(sender, send_t, 2)
        assert err.value.culprit == "sender/0" and not ctl.reports[-1].ok and ctl.committed == 1
        await push(sender, send_t, 3)
        await applied(3, *rs)
        assert [r.rounds_aborted for r in rs] == [1, 1] and all(mismatches(t, 3) == [] for t in recv_ts)


async def test_once_the_lone_receiver_has_its_fence_commit_only_it_decides():
    """One receiver (one phase): once ``fence_commit`` is on its way the receiver applies on its own
    verdict, so a sender's failure from then on (here: an abort blaming it, as its leaving would make)
    is refused: the round commits, the receiver serves it and the push holds the commit. (Honoured, the
    abort could reach a receiver that had applied already: it served a version the controller had
    recorded aborted.) The receiver's own failed verdict, error or loss, and the round's timeout, still
    abort it (``test_a_stage_that_outlasts_the_round_timeout_aborts_the_round_as_timeout``)."""
    from weightsync.wire import messages as m

    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=1, receivers=1, options=FAST))
        sender = await stack.enter_async_context(WeightSender(ctl.address, send_t, rank=0))
        receiver = await stack.enter_async_context(WeightReceiver(ctl.address, recv_t, rank=0))
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        send_to, refused = ctl.rounds._send_to, []

        async def then_fail(key, body, version):
            await send_to(key, body, version)
            if isinstance(body, m.FenceCommit):
                refused.append(not ctl.rounds.round.abort(m.AbortReason.PEER_LOST, "sender/0 left", "sender/0"))
        ctl.rounds._send_to = then_fail
        await push(sender, send_t, 2)
        await applied(2, receiver)
        assert refused == [True] and ctl.reports[-1].ok and ctl.committed == 2 and mismatches(recv_t, 2) == []


def _stranger(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=WATCHDOG)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def _challenge(sock: socket.socket) -> bytes:
    frame = b""
    while len(frame) < tcp_frames.HEADER.size:
        frame += sock.recv(tcp_frames.HEADER.size - len(frame))
    op, _, lo, hi, _ = tcp_frames.HEADER.unpack(frame)
    assert op == tcp_frames.OP_CHALLENGE
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


def _attack(address: str, make_hello, epoch: int, region: int, nbytes: int) -> bytes:
    """A hello and a write of NaNs, as a stranger on the data port would; returns what the target
    sent back before closing (b"": it closed without answering)."""
    with _stranger(address) as sock:
        hello = make_hello(_challenge(sock))
        nan = torch.full((nbytes // 4,), float("nan")).view(torch.uint8).numpy().tobytes()
        try:
            sock.sendall(hello + tcp_frames.HEADER.pack(tcp_frames.OP_WRITE, region, 0, len(nan), epoch) + nan)
            sock.sendall(tcp_frames.HEADER.pack(tcp_frames.OP_FENCE, 0, 1, 0, 0))
        except OSError:
            return b""  # the target closed while we were still sending
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                out += chunk
        return out


@pytest.mark.parametrize("mode", ["shadow", "inplace"])
async def test_strangers_on_the_data_port_cannot_touch_weights(mode):
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, send_t, rank=0) as sender, \
            WeightReceiver(ctl.address, recv_t, rank=0, mode=mode) as receiver:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        address, guard = receiver.transport.address, receiver.transport.guard
        hello = tcp_frames.HEADER.pack(tcp_frames.OP_HELLO, 0, tcp_frames.MAGIC, 0, 0)
        ours = dataauth.new_secret()
        attempts = {
            "old public hello": lambda nonce: tcp_frames.HEADER.pack(tcp_frames.OP_HELLO, 0, 0x57535443_0001, 0, 0),
            "no proof": lambda nonce: hello + bytes(32),
            "wrong secret": lambda nonce: hello + dataauth.prove(ours, nonce, 0),  # the real nonce, our own key
            "a write before any hello": lambda nonce: b"",
        }
        loop = asyncio.get_running_loop()
        for what, make_hello in attempts.items():
            before = guard.refused
            for region in (0, 1) if mode == "shadow" else (0,):
                answer = await loop.run_in_executor(None, _attack, address, make_hello, 2, region, 4096)
                assert answer == b"", what  # closed, no fence acknowledged
            assert guard.refused > before, what
            assert receiver.version == 1 and mismatches(recv_t, 1) == [], what
        # a planned, authenticated sender cannot write where the round did not open: the live slot
        conn = sender.conns[0]
        live = 1 - receiver.landing_slot if mode == "shadow" else 0
        await conn.write(torch.full((64,), float("nan")), live, 0, 9)
        with pytest.raises(TransportError, match="not open for writing"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        assert receiver.version == 1 and mismatches(recv_t, 1) == []
        assert "refused=" in repr(receiver.transport)
        await push(sender, send_t, 2)  # the real round still goes through
        await applied(2, receiver)
        assert receiver.version == 2 and mismatches(recv_t, 2) == []


def test_a_pair_key_is_bound_to_the_ranks_and_both_sessions():
    secret = dataauth.new_secret()
    key = dataauth.pair_key(secret, 0, 1, (b"s-a", b"r-a"))
    assert key == dataauth.pair_key(secret, 0, 1, (b"s-a", b"r-a"))  # the same two processes: the same key
    others = [dataauth.pair_key(secret, 0, 1, (b"s-b", b"r-a")), dataauth.pair_key(secret, 0, 1, (b"s-a", b"r-b")),
              dataauth.pair_key(secret, 1, 0, (b"s-a", b"r-a")), dataauth.pair_key(dataauth.new_secret(), 0, 1, (b"s-a", b"r-a"))]
    assert len({key, *others}) == 5
    receivers = [(1, b"r-a"), (12, b""), (7, b"r-b")]
    assert dataauth.pair_keys(secret, 0, b"s-a", receivers) == [  # (the message the keys are made of, spelled out)
        hmac.digest(secret, b"weightsync-data:0>%d:%s>%s" % (r, b"s-a".hex().encode(), s.hex().encode()), "sha256")
        for r, s in receivers]


def test_a_proof_is_bound_to_the_key_the_nonce_and_the_rank():
    guard = dataauth.DataGuard()
    key = dataauth.new_secret()
    guard.authorize({3: key})
    nonce = dataauth.new_nonce()
    assert guard.admit(3, nonce, dataauth.prove(key, nonce, 3), "peer") == key
    assert guard.admit(3, dataauth.new_nonce(), dataauth.prove(key, nonce, 3), "peer") is None  # replayed
    assert guard.admit(4, nonce, dataauth.prove(key, nonce, 4), "peer") is None  # a rank the plan does not name
    assert guard.write_problem(3, key, 0) is None
    guard.authorize({3: dataauth.new_secret()})  # a new plan: the old key no longer writes
    assert guard.write_problem(3, key, 0) is not None and guard.refused == 2


def test_a_refused_write_says_which_way_its_connection_fell_out_of_the_plan():
    guard, key = dataauth.DataGuard(), dataauth.new_secret()
    guard.authorize({3: key})
    assert guard.write_problem(3, None, 0).endswith("its connection proved no key")
    guard.authorize({3: dataauth.new_secret()})
    assert guard.write_problem(3, key, 0).endswith("the key of an earlier pair of sessions")
    guard.authorize({})
    assert guard.write_problem(3, key, 0).endswith("the current plan does not name it")


async def _crash(worker) -> None:
    """As a SIGKILL would leave it: no leave, no goodbye, sockets gone."""
    for task in worker._tasks:
        task.cancel()
    await asyncio.gather(*worker._tasks, return_exceptions=True)
    await worker.transport.close()
    worker._channel.close()
    worker._closed = True


async def test_a_restarted_receiver_rejoins_and_rounds_resume():
    send_t, recv_t, recv2_t = sender_tensors(0), receiver_tensors(), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, send_t, rank=0) as sender:
        receiver = await WeightReceiver(ctl.address, recv_t, rank=0).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        plan = ctl.plan.plan_id
        await _crash(receiver)
        # the new process joins while its old session is still known: refused as a duplicate, retried
        async with WeightReceiver(ctl.address, recv2_t, rank=0) as again:
            await asyncio.wait_for(ctl.wait_plan(after=plan), WATCHDOG)
            await push(sender, send_t, 2)  # the sender reconnected with the new plan's key
            await applied(2, again)
            assert again.version == 2 and mismatches(recv2_t, 2) == []
        # the replan patched the last plan: the same sender, and a receiver the planner cannot tell from the
        # old one but for its address and region descriptors (and the round above went through with it)
        assert (ctl.planning.cache.misses, ctl.planning.cache.patched) == (1, 1), ctl.planning.cache


async def test_a_restarted_sender_with_the_same_tensors_keeps_the_tables_and_gets_new_keys():
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightReceiver(ctl.address, recv_t, rank=0) as receiver:
        sender = await WeightSender(ctl.address, send_t, rank=0).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        assert ctl.planning.cache._resolver.sources is ctl.membership.catalog.sources  # planned from the index kept as they joined
        await push(sender, send_t, 1)
        plan, old_key = ctl.plan.plan_id, sender._conn_keys[0]
        await _crash(sender)
        send2_t = sender_tensors(0)
        async with WeightSender(ctl.address, send2_t, rank=0) as again:
            await asyncio.wait_for(ctl.wait_plan(after=plan), WATCHDOG)
            await push(again, send2_t, 2)
            await applied(2, receiver)
            assert receiver.version == 2 and mismatches(recv_t, 2) == []
            assert again._conn_keys[0][1] != old_key[1]  # the new process's pair has a new key
        # the replan patched the last plan: nothing the planner reads of the sender changed
        assert (ctl.planning.cache.misses, ctl.planning.cache.patched) == (1, 1), ctl.planning.cache
        # the rejoin changed what the first plan had read: the catalog copied it, and kept the lent one as it was
        assert ctl.membership.catalog.copied > 0 and ctl.planning.cache._resolver.sources is not ctl.membership.catalog.sources


async def test_a_replan_keeps_the_connections_of_pairs_whose_processes_stayed():
    """Keys are bound to both ends' sessions: after one receiver restarts, the sender keeps its
    connection (and key) to the other and connects to the new process with a new key."""
    send_t = sender_tensors(0)
    recv_t = {r: receiver_tensors() for r in (0, 1)}
    async with Controller(senders=1, receivers=2, options=FAST) as ctl, \
            WeightSender(ctl.address, send_t, rank=0) as sender, \
            WeightReceiver(ctl.address, recv_t[0], rank=0) as stays:
        leaves = await WeightReceiver(ctl.address, recv_t[1], rank=1).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(sender, send_t, 1)
        plan, kept, kept_key, old_key = ctl.plan.plan_id, sender.conns[0], sender._conn_keys[0], sender._conn_keys[1]
        await _crash(leaves)
        async with WeightReceiver(ctl.address, receiver_tensors(), rank=1) as again:
            await asyncio.wait_for(ctl.wait_plan(after=plan), WATCHDOG)
            await push(sender, send_t, 2)
            assert sender.conns[0] is kept and sender._conn_keys[0] == kept_key
            assert sender._conn_keys[1][1] != old_key[1]  # the new process's pair has a new key
            await applied(2, stays, again)
            assert stays.version == again.version == 2 and mismatches(recv_t[0], 2) == []
            assert stays.transport.guard.refused == 0


async def test_a_push_that_failed_with_its_controller_is_never_sent_to_the_next_one():
    """A push waiting for a plan fails when its controller is lost, and its caller moves the tensors on.
    Sent to the restarted controller once the sender is ready again, it would start a round of the old
    version with the new bytes: a receiver would serve v1 holding v2."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    send_t, recv_t, seen = sender_tensors(0), receiver_tensors(), []
    ctl = await Controller(addr, senders=1, receivers=1, options=FAST).__aenter__()
    async with WeightSender(addr, send_t, rank=0) as sender:
        update_in_place(send_t, 1)
        handle = sender.push_nowait(1)  # (no receiver yet: no plan, the push waits)
        for task in ctl._tasks:  # the controller crashes
            task.cancel()
        await asyncio.gather(*ctl._tasks, return_exceptions=True)
        ctl._chan.close()
        with pytest.raises(Exception):
            await asyncio.wait_for(handle, WATCHDOG)
        async with Controller(addr, senders=1, receivers=1, options=FAST) as ctl2, \
                WeightReceiver(addr, recv_t, rank=0, on_update=seen.append):
            await asyncio.wait_for(ctl2.wait_ready(), WATCHDOG)
            await push(sender, send_t, 2)
            assert seen == [2] and mismatches(recv_t, 2) == []
            assert [r.version for r in ctl2.reports] == [2]


@pytest.mark.parametrize("how", ["closed", "crashed"])
async def test_workers_rejoin_a_restarted_controller_and_continue(how):
    addr = f"tcp://127.0.0.1:{free_port()}"
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    ctl = await Controller(addr, senders=1, receivers=1, options=FAST).__aenter__()
    async with WeightSender(addr, send_t, rank=0) as sender, \
            WeightReceiver(addr, recv_t, rank=0) as receiver:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        for v in (1, 2, 3):  # an odd number of swaps: the receiver's landing slot is now 0
            await push(sender, send_t, v)
        if how == "closed":
            await ctl.close()
        else:
            for task in ctl._tasks:
                task.cancel()
            await asyncio.gather(*ctl._tasks, return_exceptions=True)
            ctl._chan.close()
        async with Controller(addr, senders=1, receivers=1, options=FAST) as ctl2:
            await asyncio.wait_for(ctl2.wait_ready(), WATCHDOG)
            assert ctl2.committed == 3  # learned from the workers' hellos before any round
            assert sender.sessions == receiver.sessions == 2 and sender.lost is None
            await push(sender, send_t, 4)
            await applied(4, receiver)
            assert receiver.version == 4 and mismatches(recv_t, 4) == []
            assert receiver.storage_swaps == 4  # (re-registered after an odd number of memory exchanges)
            with pytest.raises(Exception):
                ctl2.update(3)


async def test_rejoin_gives_up_at_its_deadline():
    addr = f"tcp://127.0.0.1:{free_port()}"
    ctl = await Controller(addr, senders=1, receivers=1, options=FAST).__aenter__()
    sender = await WeightSender(addr, sender_tensors(0), rank=0,
                                options=SenderOptions(rejoin_deadline_s=0.3)).__aenter__()
    receiver = await WeightReceiver(addr, receiver_tensors(), rank=0,
                                    options=ReceiverOptions(rejoin=False)).__aenter__()
    try:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await ctl.close()  # gone for good: no controller comes back
        for worker in (receiver, sender):  # rejoin off: lost at once; on: at its deadline
            with pytest.raises(Exception):
                await asyncio.wait_for(worker._wait_state(), WATCHDOG)
        assert receiver.lost is not None and "could not join again" in str(sender.lost)
    finally:
        await sender.close()
        await receiver.close()


async def test_a_malformed_manifest_is_a_reject_naming_the_field():
    import msgpack
    import zmq
    import zmq.asyncio

    from weightsync.wire import Envelope, decode, encode
    from weightsync.wire import messages as m
    from wire_samples import BODIES

    async with Controller(senders=1, receivers=1, options=FAST) as ctl:
        header, body = encode(Envelope(BODIES["hello"], msg_id=1, sender="sender/0", parent_id=None, version=None))
        raw = msgpack.unpackb(body)
        raw["manifest"]["tensors"][0]["nbytes"] += 1  # does not match shape x dtype
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(ctl.address)
            await sock.send_multipart([header, msgpack.packb(raw)])
            reply = decode(await asyncio.wait_for(sock.recv_multipart(), WATCHDOG))
        finally:
            sock.close()
            ctx.term()
        assert isinstance(reply.body, m.Reject) and reply.body.code == m.RejectCode.MANIFEST_MISMATCH
        assert "hello.manifest.tensors" in reply.body.text and "nbytes" in reply.body.text
        assert not ctl.peers


async def test_the_same_process_on_a_new_channel_replaces_its_abandoned_session():
    from weightsync.roles.channel import ControlChannel
    from weightsync.wire import messages as m
    import zmq

    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, sender_tensors(0), rank=0):
        (old,) = [p for p in ctl.peers.values() if p.hello.role is m.Role.SENDER]
        chan = ControlChannel(zmq.DEALER, "sender/0")
        try:
            chan.connect(ctl.address)
            await chan.send(old.hello)  # the same worker: its welcome went to a channel it gave up
            _, env = await asyncio.wait_for(chan.recv(), WATCHDOG)
            assert isinstance(env.body, m.Welcome)
            assert old.identity not in ctl.peers and ctl.membership.by_rank[(m.Role.SENDER, 0)] != old.identity
            other = __import__("dataclasses").replace(old.hello, incarnation=b"another")  # another worker
            chan2 = ControlChannel(zmq.DEALER, "sender/0")
            try:
                chan2.connect(ctl.address)
                await chan2.send(other)
                _, env = await asyncio.wait_for(chan2.recv(), WATCHDOG)
                assert isinstance(env.body, m.Reject) and env.body.code == m.RejectCode.DUPLICATE_RANK
            finally:
                chan2.close()
        finally:
            chan.close()


async def test_descriptors_and_keys_go_only_to_the_senders_a_plan_names():
    """Two replicas, two receivers, one small tensor each: every receiver is fed by one sender, and a
    sender learns the regions (descriptors) and the pair key of its own receivers only."""
    spec = {"w": ((64,), torch.float32, "plain")}
    from proc_helpers import sender_tensors as st_, receiver_tensors as rt_

    async with Controller(senders=2, receivers=2, options=FAST) as ctl, \
            WeightSender(ctl.address, st_(0, spec), rank=0) as s0, WeightSender(ctl.address, st_(0, spec), rank=1) as s1, \
            WeightReceiver(ctl.address, rt_(spec), rank=0) as r0, WeightReceiver(ctl.address, rt_(spec), rank=1) as r1:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        for sender in (s0, s1):
            writes_to = {t.dst_rank for t in sender.table.transfers}
            assert {p.rank for p in sender.table.peers} == writes_to == set(sender._conn_keys)
        for receiver in (r0, r1):
            assert set(receiver.transport.guard.keys) == {e.src_rank for e in receiver.table.entries}
        assert {t.dst_rank for t in s0.table.transfers}.isdisjoint({t.dst_rank for t in s1.table.transfers})


def test_pushbook_names_pushes_that_can_never_start():
    from weightsync.roles.pushes import PushBook

    book, name = PushBook(), {b"a": "sender/0", b"b": "sender/1"}.__getitem__
    book.add(b"a", 5, now=0.0)
    book.add(b"b", 6, now=0.0)
    assert book.complete({b"a", b"b"}) is None
    assert [v for v, _ in book.dead({b"a", b"b"}, name, committed=None)] == [5]  # sender/1 passed v5
    assert "sender/1 pushed a newer version" in next(book.dead({b"a", b"b"}, name, None))[1]
    book.forget(5)
    assert list(book.dead({b"a", b"b"}, name, None, now=1.0, limit=2.0)) == []  # v6 may still come
    assert "waited 2.0s for sender/0" in next(book.dead({b"a", b"b"}, name, None, now=3.0, limit=2.0))[1]
    assert "not newer than the committed v6" in next(book.dead({b"a", b"b"}, name, committed=6))[1]
    book.add(b"a", 6, now=4.0)
    assert book.complete({b"a", b"b"}) == 6
    book.forget_session(b"b")  # sender/1 left: its push goes with it
    assert book.pushes[6] == {b"a"}


def test_control_packets_are_marked_with_the_configured_dscp():
    """Every control socket marks its packets (CS6 unless configured; ``tests/e2e/test_hosts.py`` checks
    a link schedules them first); a DSCP outside 0..63 is refused naming the field."""
    import zmq

    from weightsync.engine.errors import ConfigError
    from weightsync.roles.channel import CONTROL_DSCP, ControlChannel
    from weightsync.roles.worker import WorkerOptions

    for dscp in (CONTROL_DSCP, 0, 46):
        chan = ControlChannel(zmq.DEALER, "x", dscp=dscp)
        try:
            assert chan.sock.getsockopt(zmq.TOS) == dscp << 2
        finally:
            chan.close()
    for options, bad in ((ControllerOptions, 64), (WorkerOptions, -1), (SenderOptions, True)):
        with pytest.raises(ConfigError, match="control_dscp"):
            options(control_dscp=bad)
