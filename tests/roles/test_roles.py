"""Controller, sender and receiver in one event loop over real TCP and ZeroMQ on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import dataclasses
import time

import pytest
import torch
import zmq

from weightsync.engine.errors import ConfigError, JoinRejected, RoundAborted, StagingError, VersionError
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, SenderOptions, WeightReceiver, WeightSender
from weightsync.roles.channel import ControlChannel
from weightsync.wire import PROTOCOL_VERSION, Envelope, Limits, decode, encode
from weightsync.wire import messages as m

FAST = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, checksum="crc32")
WATCHDOG = 30


@contextlib.asynccontextmanager
async def cluster(n_send=1, n_recv=1, options=FAST, mode="shadow", receiver_cls=WeightReceiver, **recv_kw):
    senders_t = [sender_tensors(0) for _ in range(n_send)]
    receivers_t = [receiver_tensors() for _ in range(n_recv)]
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=n_send, receivers=n_recv, options=options))
        senders = [await stack.enter_async_context(WeightSender(ctl.address, t, rank=r)) for r, t in enumerate(senders_t)]
        receivers = [await stack.enter_async_context(receiver_cls(ctl.address, t, rank=r, mode=mode, **recv_kw))
                     for r, t in enumerate(receivers_t)]
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        yield ctl, senders, senders_t, receivers, receivers_t


async def push_all(senders, senders_t, version):
    for t in senders_t:
        update_in_place(t, version)
    handles = await asyncio.wait_for(asyncio.gather(*(s.push(version) for s in senders)), WATCHDOG)
    return handles


async def push_failing(senders, senders_t, version) -> RoundAborted:
    """Push ``version``, whose round must fail: its abort, raised by ``push()`` where it came before the
    senders let go of their tensors (a verdict can fail while their last writes still drain), else by
    their handles."""
    try:
        handles = await push_all(senders, senders_t, version)
        outcomes = await asyncio.wait_for(asyncio.gather(*handles, return_exceptions=True), WATCHDOG)
    except RoundAborted as exc:
        return exc
    for outcome in outcomes:
        if isinstance(outcome, RoundAborted):
            return outcome
    raise AssertionError(f"the round of version {version} did not fail: {outcomes}")


async def test_round_trip_bit_exact_and_versions():
    updates = []
    async with cluster(2, 2, on_update=updates.append) as (ctl, senders, senders_t, receivers, receivers_t):
        for v in (1, 2):
            handles = await push_all(senders, senders_t, v)
            assert all(h.report.nbytes > 0 for h in handles)
            await asyncio.wait_for(asyncio.gather(*handles), WATCHDOG)
            report = await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)
            assert report.ok and report.nbytes == sum(h.report.nbytes for h in handles)
            for r in receivers:
                assert r.version == v
            for t in receivers_t:
                assert mismatches(t, v) == []
        assert {l.sender for l in report.links} == {0, 1}  # both replicas carry part of the load
        assert updates == [1, 1, 2, 2]
        assert "committed=v2" in repr(ctl) and "version=2" in repr(receivers[0])


async def test_versions_only_move_forward():
    async with cluster() as (ctl, senders, senders_t, _, _):
        await asyncio.gather(*await push_all(senders, senders_t, 5))
        with pytest.raises(VersionError):
            await senders[0].push(5)
        with pytest.raises(ConfigError, match="versions only move forward"):
            ctl.update(3)


async def test_failed_round_leaves_last_good_version_in_shadow_mode():
    async with cluster() as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        real = senders[0].sources.stage
        calls = {"n": 0}

        async def failing_stage(t, *args):
            calls["n"] += 1
            if calls["n"] == 3:  # after some bytes already landed
                raise StagingError(t.name, "injected failure")
            return await real(t, *args)

        senders[0].sources.stage = failing_stage
        update_in_place(senders_t[0], 2)
        with pytest.raises(RoundAborted, match="injected") as pushed:  # the verdict, with our own failure as cause
            await asyncio.wait_for(senders[0].push(2), WATCHDOG)
        assert isinstance(pushed.value.__cause__, StagingError)
        with pytest.raises(RoundAborted) as e:
            await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
        assert e.value.culprit == "sender/0" == pushed.value.culprit
        assert receivers[0].version == 1 and mismatches(receivers_t[0], 1) == []
        senders[0].sources.stage = real
        await asyncio.gather(*await push_all(senders, senders_t, 3))
        await asyncio.wait_for(receivers[0].wait_for(3), WATCHDOG)
        assert mismatches(receivers_t[0], 3) == []


async def test_inplace_hooks_dirty_and_repair():
    events = []
    kw = dict(before_update=lambda v: events.append(("before", v)),
              after_update=lambda v, ok: events.append(("after", v, ok)))
    async with cluster(mode="inplace", **kw) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
        assert receivers[0].dirty is False and mismatches(receivers_t[0], 1) == []
        real = senders[0].sources.stage

        async def fail_late(t, *args):
            if t.index == len(senders[0].table.transfers) - 1:
                raise StagingError(t.name, "injected")
            return await real(t, *args)

        senders[0].sources.stage = fail_late
        update_in_place(senders_t[0], 2)
        with pytest.raises(RoundAborted, match="injected"):
            await asyncio.wait_for(senders[0].push(2), WATCHDOG)
        with pytest.raises(RoundAborted):
            await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
        assert receivers[0].dirty is True and receivers[0].version == 1
        senders[0].sources.stage = real
        await asyncio.gather(*await push_all(senders, senders_t, 3))
        await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)
        assert receivers[0].dirty is False and mismatches(receivers_t[0], 3) == []
        assert events == [("before", 1), ("after", 1, True), ("before", 2), ("after", 2, False),
                          ("before", 3), ("after", 3, True)]


class CorruptingReceiver(WeightReceiver):
    async def _verdict(self, body):
        if body.version == 2:
            self.landing.storage[self.offsets["big"]] ^= 0xFF  # a byte flipped in flight
        return await super()._verdict(body)


@pytest.mark.parametrize("where", ["loop", "thread"])
@pytest.mark.parametrize("n_recv", [1, 2], ids=["one-phase", "two-phase"])
async def test_checksum_mismatch_aborts_and_names_parameter(n_recv, where, monkeypatch):
    """(``where``: the receiver's checksums taken on its loop, rows this small, or on a worker thread,
    rows past ``THREAD_THRESHOLD``.)"""
    from weightsync.roles import verify

    if where == "thread":
        monkeypatch.setattr(verify, "THREAD_THRESHOLD", 0)
    calls = []
    monkeypatch.setattr(verify.asyncio, "to_thread", _counted(verify.asyncio.to_thread, calls))
    async with cluster(1, n_recv, receiver_cls=CorruptingReceiver) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        assert all(r.rounds_one_phase == (1 if n_recv == 1 else 0) for r in receivers)
        failed = await push_failing(senders, senders_t, 2)
        assert failed.reason == m.AbortReason.CHECKSUM_MISMATCH and "big" in failed.text
        for r in receivers:  # a receiver waiting on this version's outcome hears it (vLLM's update_weights)
            with pytest.raises(RoundAborted, match="version 2"):
                await asyncio.wait_for(r.wait_committed(2), WATCHDOG)
        for r, t in zip(receivers, receivers_t):  # a failed round leaves the last good version everywhere
            assert r.version == 1 and mismatches(t, 1) == []
        await asyncio.gather(*await push_all(senders, senders_t, 3))  # and the next round goes through
        assert (await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)).ok
        assert all(r.version == 3 and mismatches(t, 3) == [] for r, t in zip(receivers, receivers_t))
    assert (len(calls) >= 3 * n_recv) if where == "thread" else not calls, calls


def _counted(to_thread, calls: list):
    async def counted(fn, *args, **kwargs):  # (the receiver's checksums alone: others use threads too)
        if getattr(fn, "__qualname__", "").startswith("checksums."):
            calls.append(fn)
        return await to_thread(fn, *args, **kwargs)
    return counted


async def test_a_row_its_sender_gave_no_checksum_for_fails_the_verified_round(monkeypatch):
    """A round that verifies verifies every row: a row whose sender reported no checksum (a path that
    forgot one) is not passed unchecked, it fails the round naming the parameter."""
    from weightsync.engine.datapath.lanes import PushReport

    async with cluster(1, 1) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        big = next(t.index for t in senders[0].table.transfers if t.name == "big")
        real = PushReport.summaries

        def without_big(self):
            return tuple(dataclasses.replace(s, checksums=tuple(c for c in s.checksums if c.index != big))
                         for s in real(self))

        monkeypatch.setattr(PushReport, "summaries", without_big)
        failed = await push_failing(senders, senders_t, 2)
        assert failed.reason == m.AbortReason.CHECKSUM_MISMATCH and "big" in failed.text
        assert receivers[0].version == 1 and mismatches(receivers_t[0], 1) == []
        monkeypatch.setattr(PushReport, "summaries", real)
        await asyncio.gather(*await push_all(senders, senders_t, 3))
        assert (await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)).ok


class SlowReceiver(WeightReceiver):
    """Verifies version 2 only once ``gate`` is set."""

    gate: asyncio.Event

    async def _verdict(self, body):
        if body.version == 2:
            await self.gate.wait()
        return await super()._verdict(body)


class Deaf(SlowReceiver):
    """Reads nothing from the controller while it verifies version 2 (its receive loop held until
    ``gate``, the check on that loop): its fence_ack, sent before it reads the abort queued meanwhile,
    crosses the abort another's verdict set off."""

    async def _on_fence(self, env):
        await super()._on_fence(env)
        if env.body.version == 2:
            await asyncio.gather(self._fence_task, return_exceptions=True)


class Telling(CorruptingReceiver):
    """Fails version 2's verification; ``began`` is set when version 3's begin reaches it."""

    began: asyncio.Event

    async def _on_begin(self, env):
        if env.body.version == 3:
            self.began.set()
        await super()._on_begin(env)


@pytest.mark.parametrize("until", ["aborted", "next-begun"])
async def test_a_fence_ack_that_crosses_its_rounds_abort_is_dropped_and_the_next_round_commits(until, caplog):
    gate, began = asyncio.Event(), asyncio.Event()
    SlowReceiver.gate, Telling.began = gate, began

    def receiver_cls(addr, tensors, rank, **kw):
        return (Telling if rank == 0 else Deaf)(addr, tensors, rank=rank, **kw)

    caplog.set_level(logging.DEBUG, logger="weightsync")
    async with cluster(1, 2, receiver_cls=receiver_cls) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        # receiver 0's verdict fails; receiver 1 is still verifying
        assert "big" in str(await push_failing(senders, senders_t, 2))
        if until == "aborted":  # receiver 1's fence_ack(2) reaches a controller with no round running
            gate.set()
            handles = await push_all(senders, senders_t, 3)
        else:  # ... or one already running round 3 (receiver 1's session there: RECEIVING)
            handles = await push_all(senders, senders_t, 3)
            await asyncio.wait_for(began.wait(), WATCHDOG)
            gate.set()
        await asyncio.wait_for(asyncio.gather(*handles), WATCHDOG)
        assert (await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)).ok
        assert all(r.version == 3 and mismatches(t, 3) == [] for r, t in zip(receivers, receivers_t))
    assert not [r.message for r in caplog.records if "illegal" in r.getMessage() or "PROTOCOL" in r.getMessage()]
    assert any("fence_ack of v2 crossed its abort" in r.getMessage() for r in caplog.records)


async def test_a_receiver_waiting_at_its_fence_keeps_reading_the_controller_and_its_abort_ends_the_wait():
    """Receiver 1's check of version 2 waits for ever (bytes in flight that never come, say); receiver
    0's fails and the round aborts: receiver 1 reads the abort while it waits (the check runs off its
    receive loop), in the same session, and the next round commits on both."""
    gate, began = asyncio.Event(), asyncio.Event()
    SlowReceiver.gate, Telling.began = gate, began

    def receiver_cls(addr, tensors, rank, **kw):
        return (Telling if rank == 0 else SlowReceiver)(addr, tensors, rank=rank, **kw)

    async with cluster(1, 2, receiver_cls=receiver_cls) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        assert "big" in str(await push_failing(senders, senders_t, 2))
        with pytest.raises(RoundAborted) as aborted:
            await asyncio.wait_for(receivers[1].wait_committed(2), WATCHDOG)
        assert aborted.value.version == 2 and receivers[1].sessions == 1 and not gate.is_set()
        await asyncio.wait_for(asyncio.gather(*await push_all(senders, senders_t, 3)), WATCHDOG)
        # (a sender's handle resolves at the commit decision; the receivers' commit_acks come after it)
        assert (await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)).ok
        assert all(r.version == 3 and mismatches(t, 3) == [] for r, t in zip(receivers, receivers_t))
        assert receivers[1].sessions == 1


async def _join_error(spec_change, role="receiver"):
    async with Controller(senders=1, receivers=1, options=FAST) as ctl:
        async with WeightSender(ctl.address, sender_tensors(0), rank=0):
            tensors = receiver_tensors()
            spec_change(tensors)
            with pytest.raises(JoinRejected) as e:
                async with WeightReceiver(ctl.address, tensors, rank=0):
                    pass
            return e.value


async def test_manifest_disagreements_are_rejected_before_any_byte_moves():
    missing = await _join_error(lambda t: t.__setitem__("blocks.0.atn.w", t.pop("blocks.0.attn.w")))
    assert missing.code == m.RejectCode.MANIFEST_MISMATCH and "blocks.0.attn.w" in missing.text  # closest name
    shape = await _join_error(lambda t: t.__setitem__("counts", torch.zeros(12, dtype=torch.int64)))
    assert "counts" in shape.text and "[12]" in shape.text
    dtype = await _join_error(lambda t: t.__setitem__("blocks.0.norm", torch.zeros(16, dtype=torch.int32)))
    assert "blocks.0.norm" in dtype.text and "int32" in dtype.text and "no transform" in dtype.text


async def test_a_receiver_may_join_before_the_sender_that_holds_its_experts():
    """Expert-parallel senders each hold some experts' rows: a receiver that joins while the holder of
    the others is still to come is admitted, and the first round fills it from both."""
    from weightsync.wire import ShardSpec

    experts = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    norm = torch.full((4,), 3.0)
    dst = {"experts": torch.zeros(8, 4), "norm": torch.zeros(4)}

    def ep_sender(ctl, rank):
        rows = slice(4 * rank, 4 * rank + 4)
        return WeightSender(ctl.address, {"experts": experts[rows].clone(), "norm": norm.clone()}, rank=rank,
                            shards={"experts": ShardSpec((8, 4), 0, rows.start, rows.stop)})

    async with Controller(senders=2, receivers=1, options=FAST) as ctl, ep_sender(ctl, 0) as s0, \
            WeightReceiver(ctl.address, dst, rank=0) as receiver, ep_sender(ctl, 1) as s1:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await asyncio.wait_for(asyncio.gather(*await asyncio.gather(s0.push(1), s1.push(1))), WATCHDOG)
        assert receiver.version == 1
        assert torch.equal(dst["experts"], experts) and torch.equal(dst["norm"], norm)


async def test_duplicate_and_out_of_range_ranks():
    async with Controller(senders=1, receivers=1, options=FAST) as ctl:
        async with WeightSender(ctl.address, sender_tensors(0), rank=0):
            with pytest.raises(JoinRejected) as e:
                async with WeightSender(ctl.address, sender_tensors(0), rank=0, options=SenderOptions(rank_wait_s=0)):
                    pass
            assert e.value.code == m.RejectCode.DUPLICATE_RANK
            with pytest.raises(JoinRejected) as e:
                async with WeightReceiver(ctl.address, receiver_tensors(), rank=3):
                    pass
            assert e.value.code == m.RejectCode.BAD_RANK and "0..0" in e.value.text


@contextlib.asynccontextmanager
async def raw_dealer(addr):
    chan = ControlChannel(zmq.DEALER, "test")
    chan.connect(addr)
    try:
        yield chan
    finally:
        chan.close()


async def test_protocol_version_mismatch_gets_reject_with_both_versions():
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, raw_dealer(ctl.address) as chan:
        hello = m.Hello(m.Role.SENDER, 0, "h", "cpu", 1, 9, 0, (), m.Manifest((), ()),
                        m.TransportInfo("tcp", "h", "127.0.0.1:1", "cpu", b""))
        frames = encode(Envelope(hello, 1, "sender/0", proto=(9, 0)))
        await chan.sock.send_multipart(frames)
        frames = await asyncio.wait_for(chan.sock.recv_multipart(), WATCHDOG)
        reply = decode(frames)
        assert isinstance(reply.body, m.Reject) and reply.parent_id == 1
        assert reply.body.code == m.RejectCode.VERSION_MISMATCH
        assert (reply.body.local_major, reply.body.peer_major) == (PROTOCOL_VERSION[0], 9)


async def test_status_and_messages_before_hello():
    async with cluster() as (ctl, senders, senders_t, _, _):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
        async with raw_dealer(ctl.address) as chan:
            await chan.send(m.StatusRequest(True))
            _, reply = await asyncio.wait_for(chan.recv(), WATCHDOG)
            status = reply.body.status
            assert {(p["role"], p["rank"]) for p in status["peers"]} == {("sender", 0), ("receiver", 0)}
            assert status["committed_version"] == 1 and status["rounds"][0]["ok"] is True
            await chan.send(m.Push(4))
            _, reply = await asyncio.wait_for(chan.recv(), WATCHDOG)
            assert isinstance(reply.body, m.Error) and "before hello" in reply.body.text


async def test_lost_receiver_aborts_round_and_replans():
    opts = dataclasses.replace(FAST, timeout_s=0.5)
    async with cluster(1, 2, options=opts) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
        first = ctl.plan.plan_id
        for task in receivers[1]._tasks:  # receiver 1 goes silent (as if frozen)
            task.cancel()
        replanned = await asyncio.wait_for(ctl.wait_plan(after=first), WATCHDOG)
        assert replanned.receivers.keys() == {0} and len(ctl.peers) == 2
        await asyncio.gather(*await push_all(senders, senders_t, 2))
        assert (await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)).ok


async def test_limits_reject_oversized_plan_message():
    with pytest.raises(Exception):
        encode(Envelope(m.Heartbeat(1), 1, "x"), Limits(max_frame_bytes=4, max_message_bytes=8))


@pytest.mark.parametrize("mode,first", [("shadow", "sender/0"), ("inplace", "receiver/0")])
async def test_begin_reaches_senders_first_unless_a_receiver_writes_in_place(mode, first):
    hooked: list[float] = []  # when an in-place receiver's before_update finished
    kw = {"before_update": lambda v: hooked.append(time.perf_counter())} if mode == "inplace" else {}
    async with cluster(mode=mode, **kw) as (ctl, senders, senders_t, receivers, receivers_t):
        await asyncio.gather(*await push_all(senders, senders_t, 1))
        marks = ctl.timeline.of(1)
        sent = sorted((t, event.partition(">")[2]) for event, t in marks.items() if event.startswith("send:begin>"))
        assert [who for _, who in sent][0] == first and len(sent) == 2
        if mode == "inplace":  # the senders' begin waited for the receiver's acknowledgement, after its hook
            assert marks["recv:begin_ack<receiver/0"] < marks["send:begin>sender/0"]
            assert hooked[0] < senders[0].timeline.of(1)["recv:begin"]
        else:
            assert not any(event.startswith("recv:begin_ack") for event in marks)


@pytest.mark.parametrize("native", [True, False], ids=["torch-binding", "probed-layout"])
@pytest.mark.parametrize("transport", ["tcp", "memory"])
async def test_a_shadow_commit_exchanges_the_buffers_memory_and_every_tensor_sees_it(transport, native, monkeypatch):
    """Over transports whose regions are the memory they were registered with, a commit exchanges the
    two buffers' memory: the user's tensor objects (and references taken before) see each new version
    at once, nothing is rebound, and the landing slot follows the memory: 1, 0, 1, ... Both ways to
    exchange: torch's binding and the probed layout a torch without it uses."""
    from weightsync.engine.datapath import exchange
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import ReceiverOptions, receiver as receiver_module

    monkeypatch.setattr(receiver_module, "memory_exchange", lambda d: exchange.memory_exchange(d, native=native))

    send_t, recv_t = sender_tensors(0), receiver_tensors()
    held = dict(recv_t)  # references a serving engine keeps
    sopts = SenderOptions(transport=transport, transport_options=TransportOptions())
    ropts = ReceiverOptions(transport=transport, transport_options=TransportOptions())
    async with Controller(senders=1, receivers=1) as ctl, \
            WeightSender(ctl.address, send_t, rank=0, options=sopts) as sender, \
            WeightReceiver(ctl.address, recv_t, rank=0, options=ropts) as receiver:
        assert receiver.landing_slot == 1
        for v in (1, 2, 3):
            update_in_place(send_t, v)
            await asyncio.wait_for(await sender.push(v), WATCHDOG)
            assert mismatches(held, v) == [] and receiver.landing_slot == (v + 1) % 2
            assert all(recv_t[name] is t for name, t in held.items())
        assert receiver.storage_swaps == 3 and receiver.version == 3


async def test_a_clean_shutdown_logs_nothing_that_reads_like_an_error(caplog):
    """Senders leave first, then receivers, then the controller closes: every line is INFO or below."""
    ts = sender_tensors(0)
    with caplog.at_level(logging.INFO, "weightsync"):
        async with Controller(senders=2, receivers=2, options=FAST) as ctl:
            receivers = [await WeightReceiver(ctl.address, receiver_tensors(), rank=r).__aenter__() for r in (0, 1)]
            senders = [await WeightSender(ctl.address, t, rank=s).__aenter__()
                       for s, t in enumerate((ts, sender_tensors(0)))]
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            for s in senders:
                update_in_place(s.tensors, 1)
            await asyncio.wait_for(asyncio.gather(*[s.push_nowait(1) for s in senders]), WATCHDOG)
            for worker in [*senders, *receivers]:
                await worker.close()
    loud = [f"{r.levelname}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, loud
    assert any("waiting for members to plan with" in r.getMessage() for r in caplog.records)


async def test_the_heartbeat_outlives_a_beat_that_fails(caplog):
    """A beat that raises (a bad peer, a bad send) is logged and the next one runs: members are still
    timed out and told we are here."""
    from weightsync import Controller, ControllerOptions

    ctl = Controller(senders=1, receivers=0, options=ControllerOptions(heartbeat_s=0.01))
    calls, third = [], asyncio.Event()
    silent = ctl.membership.silent

    def flaky(now, timeout):
        calls.append(now)
        if len(calls) >= 3:
            third.set()
        if len(calls) == 1:
            raise RuntimeError("a beat that fails")
        return silent(now, timeout)

    ctl.membership.silent = flaky
    async with ctl:
        with caplog.at_level(logging.ERROR, logger="weightsync"):
            await asyncio.wait_for(third.wait(), 10)
    assert "heartbeat 1 failed" in caplog.text and "a beat that fails" in caplog.text


async def test_the_controller_learns_round_costs_from_committed_rounds_only_and_predicts_each_round():
    """A plan's first round (connecting, registering) and aborted rounds teach nothing; from the second
    committed round on, each round's report carries the prediction made before it: the plan's data
    makespan or its busiest sender's rows at the per-row host cost the senders reported, whichever is
    longer, plus the per-round cost the model missed."""
    from weightsync.engine.plan import makespan

    async with cluster(2, 2) as (ctl, senders, senders_t, receivers, receivers_t):
        for v in (1, 2):
            await asyncio.gather(*await push_all(senders, senders_t, v))
            await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)
            await asyncio.wait_for(ctl.costs.settled(), WATCHDOG)
        assert (await ctl.wait_round(1)).predicted_s == 0.0 == (await ctl.wait_round(2)).predicted_s
        costs = ctl.costs.learner.costs
        assert costs.rounds == 1 and costs.per_row_s > 0 and ctl.status()["costs"]["rounds"] == 1
        assert all(s > 0 for s in (await ctl.wait_round(2)).senders_host_s.values())
        plan, (ps, pr) = ctl.planning.plan, ctl.planning.participants
        data_s = makespan(plan.senders, ps, pr, dataclasses.replace(FAST.link, per_transfer_s=0.0))
        rows = max(len(t.transfers) for t in plan.senders.values())
        expected = costs.predict(max(data_s, rows * costs.per_row_s))
        assert expected > 0 and ctl.costs.predict(plan.plan_id) == pytest.approx(expected, rel=1e-12)
        from weightsync.roles.daemon import request

        status = (await request(ctl.address, m.StatusRequest(False), timeout_s=WATCHDOG)).body.status  # (over the wire)
        assert status["plan"]["predicted_round_ms"] == round(expected * 1e3, 3) and status["costs"]["rounds"] == 1
        assert status["rounds"][-1]["predicted_s"] == 0.0 and set(status["rounds"][-1]["senders_host_s"]) == {"0", "1"}

        real = senders[0].sources.stage

        async def failing_stage(t, *args):
            raise StagingError(t.name, "injected failure")

        senders[0].sources.stage = failing_stage
        update_in_place(senders_t[0], 3)
        with pytest.raises(RoundAborted):
            await asyncio.wait_for(asyncio.gather(*[s.push(3) for s in senders]), WATCHDOG)
        with pytest.raises(RoundAborted):
            await asyncio.wait_for(ctl.wait_round(3), WATCHDOG)
        await asyncio.wait_for(ctl.costs.settled(), WATCHDOG)
        assert ctl.costs.learner.costs.rounds == 1  # (the abort taught nothing)
        senders[0].sources.stage = real
        await asyncio.gather(*await push_all(senders, senders_t, 4))
        report = await asyncio.wait_for(ctl.wait_round(4), WATCHDOG)
        assert report.predicted_s == pytest.approx(expected, rel=1e-12)  # (made before it ran)
        await asyncio.wait_for(ctl.costs.settled(), WATCHDOG)
        assert ctl.costs.learner.costs.rounds == 2
