"""Armed pushes (roles.arms): a sender writes on its own push under the arm the controller offered after
the last round, before its begin; writes under an arm that no longer holds never become a version."""

from __future__ import annotations

import asyncio
import select
import contextlib
import dataclasses
import threading

import pytest
import zmq

from weightsync.engine.errors import ConfigError, RoundAborted, VersionError
from weightsync.roles import Controller, SenderOptions, WeightReceiver, WeightSender
from weightsync.roles.arms import Arms
from weightsync.wire import messages as m
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place
from test_roles import FAST as PLAIN, WATCHDOG, cluster as plain_cluster, push_all

FAST = dataclasses.replace(PLAIN, arm_pushes=True)


def cluster(n_send=1, n_recv=1, options=FAST, **kw):
    return plain_cluster(n_send, n_recv, options=options, **kw)


def handler_events(workers, handler: str) -> list[asyncio.Event]:
    """One event per worker, set whenever its ``handler`` (``_on_arm``: it read an ``arm``; ``_on_plan``:
    it took a plan, its ``plan_ack`` handed to the socket) has run."""
    events = []
    for w in workers:
        event, run = asyncio.Event(), getattr(w, handler)

        async def wrapped(env, run=run, event=event):
            await run(env)
            event.set()
        setattr(w, handler, wrapped)  # (the receive loop looks handlers up by name)
        events.append(event)
    return events


def arm_events(senders) -> list[asyncio.Event]:
    return handler_events(senders, "_on_arm")


async def _round(senders, senders_t, version):
    handles = await push_all(senders, senders_t, version)
    await asyncio.wait_for(asyncio.gather(*handles), WATCHDOG)


@pytest.mark.parametrize("n_send,n_recv", [(1, 1), (2, 2)])
async def test_after_the_first_round_each_push_writes_at_once_with_no_begin_and_lands_bit_exact(n_send, n_recv):
    async with cluster(n_send, n_recv) as (ctl, senders, senders_t, receivers, receivers_t):
        armed = arm_events(senders)
        await _round(senders, senders_t, 1)  # (no arm yet: the usual way)
        assert (await ctl.wait_round(1)).armed == 0
        for v in (2, 3, 4):
            if n_recv > 1:  # (the arm comes once every receiver applied, after the senders' commit)
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in armed)), WATCHDOG)
            for e in armed:
                e.clear()
            await _round(senders, senders_t, v)
            report = await ctl.wait_round(v)  # (one receiver: the arm came before the commit; several: after)
            assert report.ok and report.armed == n_send and report.checksum == "crc32"  # (the arm's, FAST's)
            for s in senders:  # wrote on its own push: its armed_push stood for its begin
                marks = s.timeline.of(v)
                assert marks["send:armed_push"] < marks["pipeline:start"] < marks["send:writes_done"]
                assert "recv:begin" not in marks and f"send:begin>{s.name}" not in ctl.timeline.of(v)
            for r, t in zip(receivers, receivers_t):
                assert r.version == v and mismatches(t, v) == []
        assert [s.early.pushes for s in senders] == [3] * n_send and ctl.rounds.arming.arms.offered == 4
        assert ctl.status()["arms"] == {"offered": 4, "current": True, "voided_version": None}


async def test_one_receiver_back_to_back_every_push_after_the_first_is_armed():
    async with cluster() as (ctl, senders, senders_t, receivers, receivers_t):
        for v in range(1, 7):  # (each push as soon as the last committed at the sender: the arm came first)
            await _round(senders, senders_t, v)
        reports = [await ctl.wait_round(v) for v in range(1, 7)]
        assert [r.armed for r in reports] == [0, 1, 1, 1, 1, 1] and mismatches(receivers_t[0], 6) == []


async def test_a_push_after_a_step_that_held_the_loop_reads_the_arm_delivered_meanwhile_and_writes_under_it():
    """A trainer's step holds its event loop (synchronous compute between pushes). With two receivers the
    arm comes after the commit, so it is delivered while the loop is held: the push reads the control
    messages delivered before it, the arm among them, and writes under it rather than waiting for a begin."""
    opts = dataclasses.replace(FAST, heartbeat_s=30.0, timeout_s=60.0)  # (nothing else is delivered meanwhile)
    ts, recvs = sender_tensors(0), [receiver_tensors(), receiver_tensors()]
    loop, held, arm_sent = asyncio.get_running_loop(), asyncio.Event(), threading.Event()

    def trainer() -> tuple:
        async def main():
            async with WeightSender(ctl.address, ts, rank=0) as s:
                update_in_place(ts, 1)
                await (await s.push(1))
                loop.call_soon_threadsafe(held.set)
                assert arm_sent.wait(WATCHDOG)  # the step: this loop runs nothing until the arm has been sent
                assert select.select([s._channel.streams.links[b""].sock], [], [], WATCHDOG)[0]  # ... and is delivered here
                #                                                          (on the session's stream: roles.channel_stream)
                assert s.early.arm is None  # (not read yet)
                update_in_place(ts, 2)
                handle = s.push_nowait(2)
                after = s.push_nowait(3)  # (the same bytes, pushed behind it: it leaves after v2)
                armed = await asyncio.wait_for(handle.sent, WATCHDOG)
                assert await asyncio.wait_for(asyncio.gather(handle, after), WATCHDOG) == [2, 3]
                return armed, after.sent.result(), s.early.pushes, "recv:begin" in s.timeline.of(2)
        return asyncio.run(main())

    async with Controller(senders=1, receivers=2, options=opts) as ctl, \
            WeightReceiver(ctl.address, recvs[0], rank=0) as r0, WeightReceiver(ctl.address, recvs[1], rank=1) as r1:
        ctl_receivers = (r0, r1)
        offer = ctl.rounds.arming.offer

        async def offer_once_held(rnd, committing=False):  # (the arm of v1 leaves once the trainer's loop is held)
            await held.wait()
            return await offer(rnd, committing)
        ctl.rounds.arming.offer = offer_once_held
        trained = asyncio.ensure_future(asyncio.to_thread(trainer))
        try:
            await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)  # (ends after its arm was handed to the socket)
        finally:
            arm_sent.set()
        assert await asyncio.wait_for(trained, WATCHDOG) == (True, False, 1, False)  # (v3: a plain push, after v2's)
        reports = [await ctl.wait_round(v) for v in (2, 3)]
        assert [(r.ok, r.armed) for r in reports] == [(True, 1), (True, 0)]
        assert all(r.version == 3 and mismatches(t, 2) == [] for r, t in zip(ctl_receivers, recvs))


async def test_the_arm_rides_in_the_commit_and_a_sender_without_commit_arm_gets_it_on_its_own():
    """One receiver (one phase): the next round's arm is in the sender's commit, no ``arm`` message goes;
    a sender that offers ``arm`` but not ``commit_arm`` (a 3.1 peer) gets an ``arm`` ahead of its commit,
    whose bytes then carry no arm. Both push armed, bit-exact."""
    async with cluster() as (ctl, senders, senders_t, receivers, receivers_t):
        for v in range(1, 5):
            await _round(senders, senders_t, v)
            assert f"send:arm>{senders[0].name}" not in ctl.timeline.of(v) and "recv:arm" not in senders[0].timeline.of(v)
        assert [(await ctl.wait_round(v)).armed for v in range(1, 5)] == [0, 1, 1, 1] and mismatches(receivers_t[0], 4) == []
    old = dataclasses.replace(SenderOptions(), capabilities=("checksum", "arm"), arm=False)  # (as a 3.1 sender says it)
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=1, receivers=1, options=FAST))
        sent, served = sender_tensors(0), receiver_tensors()
        sender = await stack.enter_async_context(WeightSender(ctl.address, sent, rank=0, options=old))
        receiver = await stack.enter_async_context(WeightReceiver(ctl.address, served, rank=0))
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        commits = []
        take = sender._on_commit

        async def on_commit(env):
            commits.append(env.body.arm)
            await take(env)
        sender._on_commit = on_commit
        for v in range(1, 5):
            await _round([sender], [sent], v)
            if v > 1:
                assert "recv:arm" in sender.timeline.of(v - 1) and f"send:arm>{sender.name}" in ctl.timeline.of(v - 1)
        assert commits == [None] * 4 and [(await ctl.wait_round(v)).armed for v in range(1, 5)] == [0, 1, 1, 1]
        assert receiver.version == 4 and mismatches(served, 4) == []


async def test_a_one_phase_rounds_commit_leaves_while_the_receivers_commit_ack_is_handled():
    """One receiver: its ``commit_ack`` says it verified and applied; the senders' ``commit`` (with the next
    arm) is handed to the socket by the handler of that ack, not a loop turn later by the round's task,
    and the rounds stay armed and bit-exact."""
    async with cluster() as (ctl, senders, senders_t, receivers, receivers_t):
        sent_by_then, handle = [], ctl.rounds.on_round_message

        def on_round_message(peer, body):
            handle(peer, body)
            if isinstance(body, m.CommitAck):
                sent_by_then.append(f"send:commit>{senders[0].name}" in ctl.timeline.of(body.version))
        ctl.rounds.on_round_message = on_round_message  # (the controller's handlers look it up per message)
        for v in range(1, 5):
            await _round(senders, senders_t, v)
        assert sent_by_then == [True] * 4
        assert [(await ctl.wait_round(v)).armed for v in range(1, 5)] == [0, 1, 1, 1] and mismatches(receivers_t[0], 4) == []


async def test_no_arm_where_a_receiver_writes_in_place_or_the_controller_offers_none():
    async with cluster(mode="inplace") as (ctl, senders, senders_t, receivers, receivers_t):
        for v in (1, 2, 3):
            await _round(senders, senders_t, v)
        assert senders[0].early.pushes == 0 and ctl.rounds.arming.arms.offered == 0 and mismatches(receivers_t[0], 3) == []
    async with cluster(options=dataclasses.replace(PLAIN, arm_pushes=False)) as (ctl, senders, senders_t, _, rt):
        for v in (1, 2, 3):
            await _round(senders, senders_t, v)
        assert senders[0].early.pushes == 0 and ctl.rounds.arming.arms.offered == 0 and mismatches(rt[0], 3) == []


async def test_a_push_under_an_arm_that_no_longer_holds_never_becomes_a_version():
    opts = dataclasses.replace(FAST, checksum="", full_check="crc32")
    async with cluster(options=opts) as (ctl, senders, senders_t, receivers, receivers_t):
        await _round(senders, senders_t, 1)
        await _round(senders, senders_t, 2)
        assert ctl.reports[-1].checksum == ""  # (a round between the full checks)
        arm = senders[0].early.arm
        assert arm is not None
        senders[0].early.arm = dataclasses.replace(arm, arm_id=arm.arm_id + 100)  # (as an arm from a round since)
        update_in_place(senders_t[0], 3)
        handle = senders[0].push_nowait(3)
        with pytest.raises(RoundAborted) as e:
            await asyncio.wait_for(handle, WATCHDOG)
        assert e.value.version == 3 and "arm" in str(e.value) and "not the current one" in str(e.value)
        assert receivers[0].version == 2 and mismatches(receivers_t[0], 2) == []  # nothing of v3 is served
        assert ctl.rounds.arming.voided == 3 and [r.version for r in ctl.reports] == [1, 2]
        with pytest.raises(ConfigError):
            ctl.rounds.check_version(3)  # (it never runs)
        await _round(senders, senders_t, 4)  # the next round: checked end to end, bit-exact
        assert ctl.reports[-1].ok and ctl.reports[-1].checksum == "crc32" and mismatches(receivers_t[0], 4) == []


async def test_a_version_written_under_an_arm_that_can_never_start_is_void_and_the_next_lands_bit_exact():
    async with cluster(2, 1) as (ctl, senders, senders_t, receivers, receivers_t):
        await _round(senders, senders_t, 1)
        update_in_place(senders_t[0], 2)
        early = senders[0].push_nowait(2)  # under the arm: writes v2 at once
        assert await asyncio.wait_for(early.sent, WATCHDOG) and senders[0].early.under is not None and senders[0].early.under[0] == 2
        await asyncio.wait_for(early.released, WATCHDOG)  # (all of its v2 writes have landed)
        update_in_place(senders_t[1], 3)
        late = senders[1].push_nowait(3)  # sender 1 passes v2: it can never start
        with pytest.raises(VersionError, match="can never start"):
            await asyncio.wait_for(early, WATCHDOG)
        assert ctl.rounds.arming.voided == 2
        update_in_place(senders_t[0], 3)
        await asyncio.wait_for(asyncio.gather(await senders[0].push(3), late), WATCHDOG)
        assert receivers[0].version == 3 and mismatches(receivers_t[0], 3) == []  # v2's writes counted for nothing


def test_an_arm_holds_until_a_round_starts_and_a_new_plan_keeps_its_writes_or_they_reached_no_one_planned():
    arms = Arms()
    table = object()  # (a sender's table: compared by equality)
    arm = arms.offer(7, "crc32", (m.Slot(0, 1),), (m.Base(0, 4),), "auto", {b"s0": table}, {0: b"r0"})
    assert arms.refusal(arm.arm_id) is None and "not the current one" in arms.refusal(arm.arm_id + 1)
    slots, bases = (m.Slot(0, 1),), (m.Base(0, 4),)
    assert arm.kept({b"s0": table}, {0: b"r0"}, slots, bases) is None  # (a replan that changed nothing of it)
    assert "tables changed" in arm.kept({b"s0": object()}, {0: b"r0"}, slots, bases)[0]
    assert arm.kept({b"s0": table}, {0: b"r0-restarted"}, slots, bases)[1] == "receiver/0"  # (blames who changed)
    assert arm.kept({b"s0": table}, {0: b"r0"}, (m.Slot(0, 0),), bases)[1] == "receiver/0"
    came = arms.offer(8, "", slots, bases, "auto", {b"s1": table}, {0: b"r0"}, {1: b"s1"})
    why, blamed = came.kept({b"s1": object()}, {0: b"r0"}, slots, bases, {0: b"s0-new", 1: b"s1"})
    assert blamed == "sender/0" and "sender(s) [0]" in why  # (tables changed as sender/0 came back)
    assert came.kept({b"s1": object()}, {0: b"r0"}, slots, bases, {1: b"s1"})[1] == "controller"
    arm = arms.offer(7, "crc32", (m.Slot(0, 1),), (m.Base(0, 4),), "auto", {b"s0": table}, {0: b"r0"})
    assert arm.landed_nowhere({0: b"r0-restarted"}) and not arm.landed_nowhere({0: b"r0", 1: b"r1"})
    arms.took(5, b"s0")
    arms.took(6, b"s1")
    taken, sessions, others = arms.take(5)
    assert taken == arm and sessions == {b"s0"} and others == [6] and arms.current is None
    assert "not the current one" in arms.refusal(arm.arm_id)
    assert arms.void(6) == {b"s1"} and arms.wrote == {}


async def _die(receiver):
    """The receiver's process dies, saying nothing."""
    receiver._channel.close()
    for task in receiver._tasks:
        task.cancel()
    await asyncio.gather(*receiver._tasks, return_exceptions=True)
    await receiver.transport.close()


async def test_an_armed_push_whose_receivers_all_restarted_runs_the_usual_way():
    opts = dataclasses.replace(FAST, heartbeat_s=0.05, timeout_s=0.5)
    ts = sender_tensors(0)
    async with Controller(senders=1, receivers=1, options=opts) as ctl, WeightSender(ctl.address, ts, rank=0) as s0:
        old = await WeightReceiver(ctl.address, receiver_tensors(), rank=0).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await _round([s0], [ts], 1)
        await _die(old)
        await asyncio.wait_for(ctl.waiters.wait(lambda: len(ctl.peers) == 1), WATCHDOG)  # (the controller noticed)
        update_in_place(ts, 2)
        pending = s0.push_nowait(2)  # under the arm (no plan since): its writes go to a process that is gone
        assert await asyncio.wait_for(pending.sent, WATCHDOG) and s0.early.writing(2)
        recv = receiver_tensors()
        async with WeightReceiver(ctl.address, recv, rank=0) as new:
            await asyncio.wait_for(pending, WATCHDOG)
            report = await ctl.wait_round(2)
            assert report.ok and report.armed == 0 and new.version == 2 and mismatches(recv, 2) == []


async def test_an_armed_push_that_reached_a_receiver_still_planned_never_runs_once_it_failed():
    """Receiver 1 dies unnoticed as sender/0 writes v2 under its arm, so receiver 0 holds some of v2:
    v2 fails (its round, or the plan that replaced its arm's), is never served anywhere and never runs;
    v3 is bit-exact on both."""
    opts = dataclasses.replace(FAST, heartbeat_s=0.05, timeout_s=0.5)
    ts, recvs = sender_tensors(0), [receiver_tensors(), receiver_tensors()]
    async with Controller(senders=1, receivers=2, options=opts) as ctl, WeightSender(ctl.address, ts, rank=0) as s0, \
            WeightReceiver(ctl.address, recvs[0], rank=0) as r0:
        old = await WeightReceiver(ctl.address, receiver_tensors(), rank=1).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        armed = arm_events([s0])
        await _round([s0], [ts], 1)
        await asyncio.wait_for(armed[0].wait(), WATCHDOG)  # (two receivers: the arm comes after the commit)
        await _die(old)
        update_in_place(ts, 2)
        pending = s0.push_nowait(2)
        assert await asyncio.wait_for(pending.sent, WATCHDOG) and s0.early.writing(2)
        async with WeightReceiver(ctl.address, recvs[1], rank=1) as r1:
            with pytest.raises(RoundAborted) as e:
                await asyncio.wait_for(pending, WATCHDOG)
            assert e.value.version == 2
            assert r0.version == 1 and mismatches(recvs[0], 1) == []  # nothing of v2 is served
            with pytest.raises(ConfigError):
                ctl.rounds.check_version(2)
            await _round([s0], [ts], 3)  # (the sender's commit does not wait for the receivers to read theirs)
            await asyncio.wait_for(asyncio.gather(r0.wait_for(3), r1.wait_for(3)), WATCHDOG)
            assert r0.version == r1.version == 3 and mismatches(recvs[0], 3) == [] == mismatches(recvs[1], 3)


async def test_writes_under_an_arm_that_a_returning_sender_replanned_abort_blaming_that_sender():
    """sender/0 leaves, sender/1 alone holds an arm; sender/0 comes back, and the receivers take the plan
    that splits the rows again (in which sender/1 no longer writes to receiver/0) before sender/1 hears of
    it: sender/1's push under the old arm writes to receiver/0, which refuses it. That version aborts
    blaming sender/0, whose return changed the tables (not receiver/0, not the controller), nothing of it
    is served, and the next round is bit-exact on both receivers."""
    opts = dataclasses.replace(FAST, heartbeat_s=0.05, timeout_s=0.5)
    ts, recvs = [sender_tensors(0), sender_tensors(0)], [receiver_tensors(), receiver_tensors()]
    async with Controller(senders=2, receivers=2, options=opts) as ctl, \
            WeightSender(ctl.address, ts[1], rank=1) as s1, \
            WeightReceiver(ctl.address, recvs[0], rank=0) as r0, WeightReceiver(ctl.address, recvs[1], rank=1) as r1:
        async with WeightSender(ctl.address, ts[0], rank=0) as s0:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            await _round([s0, s1], ts, 1)
        armed = arm_events([s1])
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)  # (the plan without sender/0)
        await _round([s1], [ts[1]], 2)
        await asyncio.wait_for(armed[0].wait(), WATCHDOG)
        assert 1 in r0.transport.guard.keys  # sender/1 writes to receiver/0 under this arm's plan
        gate, send_plans = asyncio.Event(), ctl.planning._send_sender_plans

        async def held() -> None:  # the senders hear of the next plan only once the gate opens
            await gate.wait()
            await send_plans()
        ctl.planning._send_sender_plans = held
        taken = handler_events([r0, r1], "_on_plan")
        async with WeightSender(ctl.address, ts[0], rank=0) as back:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in taken)), WATCHDOG)
            assert 1 not in r0.transport.guard.keys  # (the new plan: receiver/0 takes sender/0's rows alone)
            update_in_place(ts[1], 3)
            early = s1.push_nowait(3)
            assert await asyncio.wait_for(early.sent, WATCHDOG) and s1.early.writing(3)
            gate.set()
            update_in_place(ts[0], 3)
            late = back.push_nowait(3)
            outcomes = await asyncio.wait_for(asyncio.gather(early, late, return_exceptions=True), WATCHDOG)
            aborted = [o for o in outcomes if isinstance(o, RoundAborted)]
            assert aborted and all(o.culprit == "sender/0" and o.version == 3 for o in aborted), outcomes
            assert r0.version == r1.version == 2 and mismatches(recvs[0], 2) == [] == mismatches(recvs[1], 2)
            update_in_place(ts[0], 4)
            update_in_place(ts[1], 4)
            await _round([back, s1], ts, 4)
            await asyncio.wait_for(asyncio.gather(r0.wait_for(4), r1.wait_for(4)), WATCHDOG)
            assert mismatches(recvs[0], 4) == [] == mismatches(recvs[1], 4)
