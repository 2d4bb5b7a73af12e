"""Delivery proofs: a sender announces its writes before they land; the receiver waits for the proof.

The memory transport with ``hold`` set plays a one-sided transport whose completions precede delivery
(as cuda_ipc's copies are still in flight when the sender seals): writes land only when the test opens
the hold. Everything else is the real controller, sender and receiver over ZeroMQ on loopback.
"""

from __future__ import annotations

import asyncio
import threading
import contextlib

import pytest

from weightsync.engine.errors import RoundAborted
from weightsync.engine.transports.memory import PROOF, MemoryTransport
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender
from weightsync.roles import verify
from weightsync.wire import messages as m

FAST = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, checksum="crc32")
WATCHDOG = 30


class WatchedController(Controller):
    """Tells the test when a sender's writes_done has arrived."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.writes_done = asyncio.Event()
        on_round_message = self.rounds.on_round_message

        def watched(peer, body) -> None:
            on_round_message(peer, body)
            if isinstance(body, m.WritesDone):
                self.writes_done.set()

        self.rounds.on_round_message = watched


class WatchedReceiver(WeightReceiver):
    """Tells the test when the fence handler starts waiting for delivery proofs."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.waiting = asyncio.Event()
        self.proofs_seen: list[dict] = []

    async def _verdict(self, body):
        self.proofs_seen.append({s.peer_rank: s.proof for s in body.checksums})
        self.waiting.set()
        return await super()._verdict(body)


@contextlib.asynccontextmanager
async def memory_cluster(proof_timeout_s=60.0):
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(WatchedController(senders=1, receivers=1, options=FAST))
        sender = await stack.enter_async_context(
            WeightSender(ctl.address, send_t, rank=0, options=SenderOptions(transport="memory")))
        receiver = await stack.enter_async_context(WatchedReceiver(
            ctl.address, recv_t, rank=0, options=ReceiverOptions(transport="memory", proof_timeout_s=proof_timeout_s)))
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        yield ctl, sender, send_t, receiver, recv_t


async def _first_round(ctl, sender, send_t, recv_t) -> None:
    update_in_place(send_t, 1)
    await asyncio.wait_for(await sender.push(1), WATCHDOG)
    assert mismatches(recv_t, 1) == []


async def test_writes_done_leaves_before_delivery_and_the_receiver_waits_for_the_proof():
    async with memory_cluster() as (ctl, sender, send_t, receiver, recv_t):
        await _first_round(ctl, sender, send_t, recv_t)
        assert isinstance(sender.transport, MemoryTransport)
        hold = sender.transport.hold = asyncio.Event()
        ctl.writes_done.clear()
        receiver.waiting.clear()
        update_in_place(send_t, 2)
        handle = sender.push_nowait(2)
        await asyncio.wait_for(ctl.writes_done.wait(), WATCHDOG)  # announced while nothing has landed
        await asyncio.wait_for(receiver.waiting.wait(), WATCHDOG)
        assert receiver.transport.counters(2) == {}  # not one write of round 2 has landed
        assert receiver.version == 1 and not handle.released.done() and ctl.rounds.round is not None
        assert not ctl.rounds.round.futures["fenced"].done()
        proof = receiver.proofs_seen[-1][0]
        _, conn_id, issued = PROOF.unpack(proof)
        conn = sender.conns[0]
        assert (conn_id, issued) == (conn.id, conn.sent_count)  # every write was issued before the seal ...
        assert conn.delivered < issued  # ... and some are not delivered
        hold.set()
        await asyncio.wait_for(handle, WATCHDOG)
        report = await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
        assert report.ok and receiver.version == 2 and mismatches(recv_t, 2) == []
        marks = sender.timeline.of(2)
        assert marks["send:writes_done"] < marks["pipeline:end"]  # the announcement overlapped delivery
        steps = ["pipeline:start", "pipeline:lanes", "pipeline:written", "pipeline:sealed"]  # the pipeline's steps
        assert [marks[s] for s in steps] == sorted(marks[s] for s in steps)


async def test_a_proof_never_fulfilled_aborts_the_round_and_keeps_the_last_version():
    async with memory_cluster(proof_timeout_s=0.2) as (ctl, sender, send_t, receiver, recv_t):
        await _first_round(ctl, sender, send_t, recv_t)
        hold = sender.transport.hold = asyncio.Event()  # never opened during the round
        update_in_place(send_t, 2)
        handle = sender.push_nowait(2)
        with pytest.raises(RoundAborted) as e:
            await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
        assert "sender/0" in e.value.text and "not delivered" in e.value.text
        assert receiver.version == 1 and mismatches(recv_t, 1) == []
        hold.set()  # the held writes land now, into a closed round: dropped
        with pytest.raises(RoundAborted):
            await asyncio.wait_for(handle, WATCHDOG)
        assert mismatches(recv_t, 1) == []


async def test_a_proof_the_receiver_transport_cannot_check_is_a_named_failure():
    async with memory_cluster() as (ctl, sender, send_t, receiver, recv_t):
        await _first_round(ctl, sender, send_t, recv_t)
        summary = m.WriteSummary(0, 1, 4, (), b"not a proof")
        problems = await verify.await_proofs(receiver.transport, (summary,), 60.0)
        assert "unusable delivery proof" in problems[0]


async def test_spinning_roles_poll_only_while_a_round_runs():
    opts = dict(heartbeat_s=0.05, timeout_s=2.0, spin=True)
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(**opts)) as ctl, \
            WeightSender(ctl.address, send_t, rank=0, options=SenderOptions(spin=True)) as sender, \
            WeightReceiver(ctl.address, recv_t, rank=0, options=ReceiverOptions(spin=True)) as receiver:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        spinners = (ctl.spinner, sender.spinner, receiver.spinner)
        at_commit, take = [], sender._on_commit

        async def on_commit(env):  # (the sender polls until its round ends: its commit)
            at_commit.append(sender.spinner.holders)
            await take(env)
        sender._on_commit = on_commit
        for v in (1, 2):
            update_in_place(send_t, v)
            await asyncio.wait_for(await sender.push(v), WATCHDOG)
            await asyncio.wait_for(receiver.wait_for(v), WATCHDOG)
            await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)
        assert mismatches(recv_t, 2) == []
        assert [s.held for s in spinners] == [2, 2, 2]  # each held once per round ...
        assert [s.holders for s in spinners] == [0, 0, 0] and at_commit == [1, 1]  # ... and let go when it ended
        assert ctl.spinner.spins > 0 and receiver.spinner.spins > 0  # (they polled while waiting)
        assert sender.transport.options.busy_poll and receiver.transport.options.busy_poll  # device polls too


async def test_by_default_only_members_on_a_gpu_spin():
    """``spin=None`` (the default): a process spins while rounds run where its tensors are on a GPU, the
    controller where a member's are; CPU members and their controller never do (the loop's core is the
    data plane's there)."""
    from weightsync.roles.worker import spins

    assert spins(None, "cuda:1") and not spins(None, "cpu") and spins(True, "cpu") and not spins(False, "cuda:0")
    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(heartbeat_s=0.05, timeout_s=2.0)) as ctl, \
            WeightSender(ctl.address, send_t, rank=0) as sender, WeightReceiver(ctl.address, recv_t, rank=0) as receiver:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        update_in_place(send_t, 1)
        await asyncio.wait_for(await sender.push(1), WATCHDOG)
        await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
        assert mismatches(recv_t, 1) == []
        spinners = (ctl.spinner, sender.spinner, receiver.spinner)
        assert [s.enabled for s in spinners] == [False] * 3 and [s.spins for s in spinners] == [0] * 3
        assert not sender.transport.options.busy_poll


async def test_busy_polling_waits_for_a_device_event_without_napping(monkeypatch):
    """A device event is polled from the loop: normally it yields for a while and then a helper thread
    blocks on it (the loop never naps or blocks); with ``busy_poll`` (``spin_s=inf``) it only polls.
    The connection's completion poller (many events, oldest first) yields and naps."""
    import math

    from weightsync.engine.cuda import cuda_rt

    class LateEvent:  # happens at the sixth query
        def __init__(self) -> None:
            self.queries = 0
            self.synchronized_on = None

        def query(self) -> bool:
            self.queries += 1
            return self.queries > 5

        def synchronize(self) -> None:  # a long wait blocks a helper thread here, never the loop
            self.synchronized_on = threading.get_ident()

    delays = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(delay):
        delays.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(cuda_rt.asyncio, "sleep", recorded_sleep)
    late = LateEvent()
    await cuda_rt.wait_event(late, spin_s=0.0)  # past the spin at once: a helper thread waits, no naps
    assert late.synchronized_on not in (None, threading.get_ident()) and delays == []
    await cuda_rt.wait_event(LateEvent(), spin_s=math.inf)
    assert delays == [0] * 5
    delays.clear()
    poller = cuda_rt.EventPoller(spin_s=math.inf)
    await asyncio.wait_for(poller.wait(LateEvent()), WATCHDOG)
    assert delays == [0] * 5 and poller.completed == 1


async def test_auto_hands_each_proof_to_the_transport_that_made_it():
    import torch

    from weightsync.engine.transport import connect_authorized
    from weightsync.engine.transports.auto import AutoTransport
    from weightsync.wire import PeerInfo

    src, dst = MemoryTransport(), MemoryTransport()
    info = await dst.start(0)
    await src.start(0)
    region = dst.register(0, torch.zeros(16, dtype=torch.uint8))
    conn = await connect_authorized(src, dst, PeerInfo(0, info, (region,)))
    src.hold = asyncio.Event()
    await conn.write(torch.full((4,), 7, dtype=torch.uint8), 0, 0, epoch=1)
    auto = AutoTransport()
    auto.children = {"memory": dst}  # (on this machine auto starts tcp only; the routing is what is tested)
    waiting = asyncio.ensure_future(auto.await_proofs({0: conn.seal(), 1: b"xxxx-not-a-proof"}, 30))
    src.hold.set()  # deliver: the memory proof is fulfilled, the other one is nobody's
    failed = await asyncio.wait_for(waiting, WATCHDOG)
    assert list(failed) == [1] and "of no transport here" in failed[1]
    assert dst.regions[0][:4].tolist() == [7, 7, 7, 7]
    await conn.close()
    await src.close()
    await dst.close()


@pytest.mark.parametrize("kind", ["tcp", "auto"])
async def test_a_tcp_round_announces_its_writes_with_a_proof_and_commits_bit_exact(kind):
    """Over TCP a small round's ``writes_done`` carries a delivery proof (the connection's challenge and
    the writes issued on it), so it leaves without waiting for the fence's round trip; the receiver
    waits on its own agent's counts, and the rounds land bit for bit."""
    from weightsync.engine.transports import tcp

    send_t, recv_t = sender_tensors(0), receiver_tensors()
    async with WatchedController(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, send_t, rank=0, options=SenderOptions(transport=kind)) as sender, \
            WatchedReceiver(ctl.address, recv_t, rank=0, options=ReceiverOptions(transport=kind)) as receiver:
        for version in (1, 2, 3):
            update_in_place(send_t, version)
            await asyncio.wait_for(await sender.push(version), WATCHDOG)
            assert mismatches(recv_t, version) == []
        conn = sender.conns[0]  # (auto hands out its child's connection)
        magic, nonce, count, nbytes = tcp.PROOF.unpack(receiver.proofs_seen[-1][0])
        assert (magic, nonce) == (tcp.PROOF_MAGIC, conn.nonce)
        assert (count, nbytes) == (conn.sent_count, conn.sent_bytes)  # every write of the three rounds


async def test_a_receiver_s_kept_fp64_launch_reads_each_round_s_landing_and_is_dropped_with_its_table():
    """``verify.checksums`` keeps the ``fp64`` launch over a table's landing pieces between rounds
    (``kept``, per landing memory) and still reads the bytes of each round: a byte changed since the
    last check is caught, a row no sender checksummed is named, and another table's launch replaces
    every kept one (nothing holds landing memory a plan let go of)."""
    import torch
    from weightsync.engine.datapath.checksums import fp64
    from weightsync.wire import ReceiverTable
    from weightsync.wire.routing import ExpectedEntry

    def table(names):
        return ReceiverTable(0, tuple(ExpectedEntry(n, 0, i, None, 0, 16 * i, 16, "") for i, n in enumerate(names)))

    landing = torch.arange(64, dtype=torch.uint8)
    one = table("abcd")

    def summary(land):
        return (m.WriteSummary(0, 4, 64, tuple(m.Checksum(i, fp64(land[16 * i:16 * i + 16])) for i in range(4))),)

    kept: dict = {}
    assert await verify.checksums(one, landing, "fp64", summary(landing), kept) == []
    (first,) = kept.values()
    landing[20] ^= 1  # (row "b" changed after the sender's checksum was taken)
    assert await verify.checksums(one, landing, "fp64", summary(landing.clone().fill_(0)), kept) == ["a", "b", "c", "d"]
    assert await verify.checksums(one, landing, "fp64", summary(landing)[:0] + (
        m.WriteSummary(0, 3, 48, summary(landing)[0].checksums[:3]),), kept) == ["d"]  # (d: no checksum given)
    want = summary(landing)
    landing[20] ^= 1
    assert await verify.checksums(one, landing, "fp64", want, kept) == ["b"]
    assert list(kept.values())[0] is first  # (the same launch, every round with every row checksummed)
    other = table("wxyz")
    assert await verify.checksums(other, landing, "fp64", summary(landing), kept) == []
    assert [t for t, _ in kept.values()] == [other]
