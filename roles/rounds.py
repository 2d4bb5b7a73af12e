"""Rounds, as the controller runs them: pushes, one round at a time over the plan's sessions, verdicts.

How this works: ``Rounds`` is the controller's part that owns what is pushed and committed. A push
belongs to the session that sent it (``PushBook``); once every sender session of the plan has pushed
v (``maybe_start``), a round task carries out ``round_state.ROUND_STEPS`` over the plan's sessions:
begin -> writes_done -> fence -> commit -> commit_ack, a round with a single receiver that offers
``fence_commit`` doing fence and commit in one exchange. Every message goes to the session the plan
named for a rank (``_send_to``), never to a later session of that rank. Any failure before commit
aborts the round (``abort`` to every member of the plan, a bug of the controller's included); the
committed version follows the receivers' ``commit_ack`` s (``learn_committed``), and a version that
reached its fence is never run again. The workers' round messages reach the running round through
``on_round_message``; their errors through ``on_error``. Once every receiver has applied a round, the
senders get the next one's parameters (``roles.arms``): a sender may then write on its own push
(``armed_push``, which stands for its ``begin``); writes under an arm that no longer holds are void,
and their version never runs (``roles.arming``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import zmq

from weightsync.engine.aio import Spinner, within
from weightsync.engine.errors import ConfigError, RoundAborted
from weightsync.wire import Origin, Role, State
from weightsync.wire import messages as m

from .arming import Arming
from .membership import Peer
from .planning import Planning
from .pushes import PushBook
from .round_inputs import RoundInputs
from .round_state import RoundReport, RoundState
from .timeline import Timeline

if TYPE_CHECKING:
    from .controller_options import ControllerOptions

log = logging.getLogger("weightsync")


class Rounds:
    def __init__(self, planning: Planning, options: "ControllerOptions", send: Callable[..., Awaitable[None]], *,
                 timeline: Timeline, spinner: Spinner, wake: Callable[[], None],
                 on_finished: Callable[[RoundReport], Any], predict: Callable[[int], float] = lambda plan_id: 0.0) -> None:
        self.planning = planning
        self.options = options
        self.send = send
        self.timeline, self.spinner = timeline, spinner
        self.wake, self.on_finished, self.predict = wake, on_finished, predict
        self.pushes = PushBook()  # pending pushes, by the session that made them
        self.round: Optional[RoundState] = None
        self.task: Optional[asyncio.Task] = None
        self.committed: Optional[int] = None  # the newest version a receiver said it applied
        self.fenced = -1  # the newest version the controller sent a fence for (never run again)
        self.reports: list[RoundReport] = []
        self._waiters: dict[int, asyncio.Future] = {}
        self.inputs = RoundInputs(options, planning.peer_of)  # bases for delta rounds, and each round's check
        self.arming = Arming(planning, self.inputs, self.pushes, options, send, wake)  # arms, and writes under them

    def __repr__(self) -> str:
        return (f"<Rounds committed=v{self.committed} reports={len(self.reports)} pending={sorted(self.pushes.pushes)} "
                f"{self.arming!r} {self.round!r}>")

    # --- versions -----------------------------------------------------------------------------------

    def check_version(self, version: int) -> None:
        floor = max([v for v in (self.committed, self.fenced, self.arming.voided, self.round.version if self.round else None)
                     if v is not None], default=-1)
        if version <= floor:
            raise ConfigError("version", f"version {version} is not newer than {floor}: versions only move forward")

    def learn_committed(self, version: int) -> None:
        """``version`` is applied by a receiver: it is the committed version from now on (never lower)."""
        if self.committed is None or version > self.committed:
            self.committed = version
            self.wake()

    # --- pushes -------------------------------------------------------------------------------------

    async def on_push(self, peer: Peer, version: int) -> None:
        try:
            self.check_version(version)
        except ConfigError as exc:
            await self.send(peer, m.Error(m.ErrorCode.BAD_REQUEST, str(exc), "version", version), version=version)
            return
        error = self.planning.error
        if error is not None and self.planning.error_final and self.planning.holds(peer):
            await self.send(peer, m.Error(m.ErrorCode.PLAN, str(error), error.param or "", version),
                            version=version)  # no plan can be made for these members: the push never starts
            return
        self.pushes.add(peer.identity, version, time.monotonic())
        self.wake()
        await self.refuse_dead_pushes()
        self.maybe_start()

    async def on_armed_push(self, peer: Peer, version: int, arm_id: int) -> None:
        """A push whose sender has started writing under arm ``arm_id``: honoured while that arm holds
        and the version may run, else void (``void``)."""
        why = self.arming.arms.refusal(arm_id)
        if why is None:
            try:
                self.check_version(version)
            except ConfigError as exc:
                why = str(exc)
        if why is not None:
            await self.arming.void(version, f"armed push of v{version} by {peer.name} not honoured: {why}", peer)
            return
        self.arming.arms.took(version, peer.identity)
        await self.on_push(peer, version)

    def drop_pushes(self) -> None:
        """No plan can be made with every configured member joined: the pending pushes never start."""
        for version in sorted(self.pushes.pushes):
            self.pushes.forget(version)
        self.wake()

    def maybe_start(self) -> None:
        if self.task is not None or not self.planning.ready.is_set() or not self.planning.live():
            return
        while (version := self.pushes.complete(self.planning.sender_sessions())) is not None:
            self.pushes.forget(version)
            if self.committed is None or version > self.committed:  # (a restarted controller may have
                self.start(version)                                #  learned more since the push)
                return

    async def refuse_dead_pushes(self, now: Optional[float] = None) -> None:
        """Fail each pending push that can never start a round (``PushBook.dead``) with a typed error."""
        members = self.planning.members
        dead = list(self.pushes.dead(self.planning.sender_sessions(), lambda i: members.get(i).name
                                     if members.get(i) else "a departed sender", self.committed, now,
                                     self.options.round_timeout_s))
        for version, why in dead:
            if self.arming.pending(version):  # (written under an arm: never run)
                await self.arming.void(version, why, field="version")
                continue
            log.warning("controller: %s", why)
            for identity in self.pushes.forget(version):
                peer = members.get(identity)
                if peer is not None and peer.session.allowed(Origin.CONTROLLER, m.Error.TYPE):
                    await self.send(peer, m.Error(m.ErrorCode.BAD_REQUEST, why, "version", version), version=version)

    # --- one round ----------------------------------------------------------------------------------

    def start(self, version: int) -> None:
        plan = self.planning.plan
        if plan is None or not self.planning.ready.is_set() or self.task is not None or not self.planning.live():
            raise ConfigError("round", "no acknowledged plan with every member present yet, or a round is running")
        self.check_version(version)  # never a round that is not newer than the committed version
        senders = {r for role, r in self.planning.sessions if role is Role.SENDER}
        receivers = {r for role, r in self.planning.sessions if role is Role.RECEIVER}
        devices = self.arming.devices()
        self.round = RoundState(version, plan.plan_id, senders, receivers, "", plan.nbytes)
        self.arming.begin_with(self.round, devices)  # (its checksum, slots, bases: an arm's where its senders wrote under one)
        self.round.predicted_s = self.predict(plan.plan_id)
        self.timeline.mark(version, "round:start", self.round.t0)
        if self.options.spin is None and not self.spinner.holders:  # auto: where a member's tensors are on a GPU
            self.spinner.enabled = any(str(d).startswith("cuda") for d in devices)
        self.spinner.hold()
        self.task = asyncio.ensure_future(self._run(self.round))

    async def _run(self, rnd: RoundState) -> None:
        try:
            await self._steps(rnd)
        except RoundAborted as exc:
            rnd.abort(exc.reason, exc.text, exc.culprit)  # no-op when the round recorded it already
        except asyncio.CancelledError:
            rnd.abort(m.AbortReason.SHUTDOWN, "controller shutting down", "controller", force=True)
            raise
        except Exception as exc:  # a bug of ours must never pass for a commit: abort, and say so
            log.exception("controller: round v%d failed", rnd.version)
            rnd.abort(m.AbortReason.CANCELLED, f"controller failed running the round: {exc!r}", "controller")
        finally:
            if rnd.aborted is not None:
                if rnd.arm is not None:  # (written on its senders' own pushes: late writes may still land)
                    self.arming.voided = max(self.arming.voided, rnd.version)
                await asyncio.shield(self._send_aborts(rnd))
            self._finish(rnd, rnd.report())

    async def _steps(self, rnd: RoundState) -> None:
        """``round_state.ROUND_STEPS``, in order."""
        deadline = self.options.round_timeout_s
        landing = rnd.landing
        await self.arming.before_begin(rnd)
        receivers = [(Role.RECEIVER, r) for r in sorted(rnd.receivers)]
        senders = [(Role.SENDER, r) for r in sorted(rnd.senders)]
        gated = self._gated(rnd)
        if gated:  # in-place receivers first: the senders begin once their hooks have run
            await self._begin(rnd, receivers, landing)
            rnd.gate(gated)
            await self._stage(rnd, "ready", deadline)
            await self._begin(rnd, senders, landing)
        else:  # senders first: they start the data moving
            await self._begin(rnd, senders + receivers, landing)
        await self._stage(rnd, "writes_done", deadline)
        rnd.stage = "fencing"
        rnd.one_phase = self._one_phase(rnd)
        self.fenced = max(self.fenced, rnd.version)  # (a receiver may be prepared for it from now: never rerun)
        fence = m.FenceCommit if rnd.one_phase else m.Fence
        rnd.deciding = rnd.one_phase  # (set before it is queued: from then on the receiver may apply on its own)
        try:
            for r in sorted(rnd.receivers):
                await self._send_to((Role.RECEIVER, r), fence(rnd.version, rnd.fence_for(r)), rnd.version)
        except BaseException:
            rnd.deciding = False  # (not queued: no receiver can apply it)
            raise
        await self._stage(rnd, "fenced", deadline)
        if rnd.stage == "fencing":  # (else the lone receiver's commit_ack had the senders' commits sent: ``on_round_message``)
            rnd.stage = "committing"
            rnd.committed = True
            # (one phase: applied already, so the arm goes with, or ahead of, the commit a trainer waits for)
            arm, riding = (await self.arming.offer(rnd, committing=True) if rnd.one_phase else None) or (None, ())
            for key in sorted(self.planning.sessions):
                if (peer := self.planning.peer_of(key)) is not None and not (rnd.one_phase and key[0] is Role.RECEIVER):
                    await self._send_to(key, m.Commit(rnd.version, arm if peer.identity in riding else None), rnd.version)
        await self._stage(rnd, "applied", deadline)
        rnd.stage = "done"
        if not rnd.one_phase:
            await self.arming.offer(rnd)

    async def _begin(self, rnd: RoundState, keys: list[tuple[Role, int]], landing: tuple[m.Slot, ...]) -> None:
        bases, mode = rnd.bases, rnd.delta
        for key in keys:
            peer = self.planning.peer_of(key)
            if peer is not None and peer.identity in rnd.armed_by and peer.session.state in (State.WRITING, State.WRITTEN):
                continue  # (its armed_push stood for its begin: it writes under the arm already)
            slots = landing if key[0] is Role.SENDER else ()
            named = bases if key[0] is Role.SENDER else tuple(b for b in bases if b.rank == key[1])
            await self._send_to(key, m.UpdateBegin(rnd.version, rnd.plan_id, rnd.checksum, slots, named, mode),
                                rnd.version)

    def _gated(self, rnd: RoundState) -> set[int]:
        """In-place receivers that acknowledge ``begin`` once their ``before_update`` hook has run
        (capability ``begin_ack``): the senders begin after them, so no byte lands while serving runs."""
        return {r for r in rnd.receivers if (peer := self.planning.peer_of((Role.RECEIVER, r))) is not None
                and "begin_ack" in peer.hello.capabilities}

    def _one_phase(self, rnd: RoundState) -> bool:
        """A round with a single receiver that can apply on its own verdict needs no second phase:
        nobody else's verdict could still veto it. Saves the commit's round trip."""
        if not self.options.one_phase_commit or len(rnd.receivers) != 1:
            return False
        peer = self.planning.peer_of((Role.RECEIVER, next(iter(rnd.receivers))))
        return peer is not None and "fence_commit" in peer.hello.capabilities

    async def _stage(self, rnd: RoundState, stage: str, deadline: Optional[float]) -> None:
        """Until ``stage`` is reached. Its future is awaited as it is (no shield: this task wakes in the
        loop turn after the message that completes it); a timeout cancels it, and every completion of
        a stage checks that it is not done yet."""
        try:
            await within(rnd.futures[stage], deadline)
        except asyncio.TimeoutError:
            if rnd.abort(m.AbortReason.TIMEOUT, f"stage {stage} took longer than {deadline}s", force=True) or rnd.aborted:
                raise rnd.aborted from None
            missing = sorted(rnd.receivers - rnd.applied)  # committed: whoever applied it has it
            log.warning("controller: v%d committed; no commit_ack within %ss from receiver(s) %s",
                        rnd.version, deadline, missing)
        if rnd.aborted is not None:  # (aborted after the stage was reached, before this task ran again:
            raise rnd.aborted        #  the abort stands, and nothing of the next stage is sent)

    async def _send_to(self, key: tuple[Role, int], body: m.Message, version: int) -> None:
        """Send to the session the plan named for ``key``: never to another session of the same rank."""
        peer = self.planning.peer_of(key)
        name = f"{key[0].value}/{key[1]}"
        if peer is None:
            raise RoundAborted(version, m.AbortReason.PEER_LOST, f"{name} (the session planned) is gone", name)
        await self.send(peer, body, version=version)

    async def _send_aborts(self, rnd: RoundState) -> None:
        a = rnd.aborted
        log.warning("controller: %s", a)
        for key in sorted(self.planning.sessions):
            peer = self.planning.peer_of(key)
            if peer is not None and peer.session.allowed(Origin.CONTROLLER, m.Abort.TYPE):
                try:
                    await self.send(peer, m.Abort(rnd.version, a.reason, a.text, a.culprit), version=rnd.version)
                except zmq.ZMQError as exc:
                    log.warning("controller: abort of v%d to %s not sent: %s", rnd.version, peer.name, exc)

    def _finish(self, rnd: RoundState, report: RoundReport) -> None:
        self.spinner.release()
        self.inputs.finished(rnd, report.ok)
        self.inputs.judge(report)
        if report.ok:
            self.learn_committed(rnd.version)
        self.reports.append(report)
        del self.reports[:-self.options.keep_reports]
        self.round, self.task = None, None
        fut = self._waiters.pop(rnd.version, None)
        if fut is not None and not fut.done():
            try:
                fut.set_result(report_or_raise(report))
            except RoundAborted as exc:
                fut.set_exception(exc)
        self.on_finished(report)

    async def wait_round(self, version: int) -> RoundReport:
        """Wait for the round of ``version``; returns its report or raises ``RoundAborted``."""
        for report in self.reports:
            if report.version == version:
                return report_or_raise(report)
        fut = self._waiters.setdefault(version, asyncio.get_running_loop().create_future())
        return await asyncio.shield(fut)

    # --- what the workers say -----------------------------------------------------------------------

    def on_round_message(self, peer: Peer, body: Any) -> None:
        """begin_ack, writes_done, fence_ack or commit_ack, from a session of the running round's plan."""
        rnd = self.round
        if isinstance(body, m.WritesDone) and self.arming.pending(body.version) and self.planning.holds(peer):
            self.arming.before_round(peer, body)  # (an armed sender's, before its round started)
            return
        if rnd is None or body.version != rnd.version or not self.planning.holds(peer):
            return  # (late messages of old rounds, and sessions the plan does not name, are ignored)
        blame = ""
        if isinstance(body, m.FenceAck):  # a failed verification that names one of the plan's senders blames it
            role, _, rank = (body.blame or "").partition("/")
            if role == Role.SENDER.value and rank.isdigit() and (Role.SENDER, int(rank)) in self.planning.sessions:
                blame = body.blame
        if isinstance(body, m.CommitAck) and body.applied and "slots:2" in peer.hello.capabilities:
            peer.slot = 1 - peer.slot  # it swapped: next round lands in the other buffer
        rnd.receive(peer.hello.rank, body, blame)
        if isinstance(body, m.CommitAck) and body.applied:
            self.inputs.applied(peer, rnd.version)
            self.learn_committed(rnd.version)  # a receiver serves it: committed, whatever comes next
            if rnd.one_phase and rnd.stage == "fencing" and rnd.committed:  # (its verdict and its apply in one message:
                self.arming.commit_senders(rnd)                             #  the commits leave now, not a turn later)

    async def on_error(self, peer: Peer, error: m.Error) -> None:
        """A participant's error fails the running round, or the version it wrote under an arm before its
        round began (``void``). Who is blamed: a data-plane error names the planned peer whose end failed
        (``field``: "receiver/3" when the connection to it broke or it refused our writes); otherwise the
        reporter."""
        log.warning("controller: %s reports %s: %s", peer.name, error.code.name, error.text)
        rnd = self.round
        if self.arming.pending(error.version) and (rnd is None or rnd.version != error.version):
            self.arming.before_round(peer, error)  # (its round fails with it, if it still counts when it starts)
            return
        if rnd is None or error.version != rnd.version or not self.planning.holds(peer):
            return
        role, _, rank = error.field.partition("/")
        culprit = peer.name
        if error.code == m.ErrorCode.TRANSPORT and role in ("sender", "receiver") and rank.isdigit() \
                and (Role(role), int(rank)) in self.planning.sessions:
            culprit = error.field
        rnd.abort(m.AbortReason.PEER_ERROR, f"{peer.name}: {error.text}", culprit, force=peer.hello.role is Role.RECEIVER)

    def fail(self, reason: m.AbortReason, text: str, culprit: str) -> None:
        """Abort the running round, if any, before it commits."""
        if self.round is not None:
            self.round.abort(reason, text, culprit)

    def member_left(self, peer: Peer, why: str, culprit: Optional[str] = None) -> None:
        """A member's session is over: its pushes go with it; a round it takes part in aborts (or, after
        commit, stops waiting for it; so it does for a sender while a one-phase round's receiver decides),
        blaming ``culprit`` (default: the member)."""
        self.pushes.forget_session(peer.identity)
        self.inputs.forget(peer)
        rnd = self.round
        if rnd is not None and self.planning.holds(peer):
            if not rnd.abort(m.AbortReason.PEER_LOST, f"{peer.name} {why}", culprit or peer.name,
                             force=peer.hello.role is Role.RECEIVER):
                rnd.drop(peer.hello.role, peer.hello.rank)

    def cancel(self) -> list[asyncio.Future]:
        """For shutdown: abort the round in flight, fail whoever waits for a round; what to await."""
        if self.round is not None:
            self.round.abort(m.AbortReason.SHUTDOWN, "controller shutting down", force=True)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(RoundAborted(-1, m.AbortReason.SHUTDOWN, "controller closed"))
        if self.task is not None and not self.task.done():
            self.task.cancel()
        return [self.task] if self.task is not None else []


CROSSING = frozenset({m.BeginAck.TYPE, m.WritesDone.TYPE, m.FenceAck.TYPE})


def crossed(rnd: Optional[RoundState], msg_type: str, version: Optional[int]) -> bool:
    """A worker's begin_ack, writes_done or fence_ack of a round that is not the running one: sent before
    the worker heard that round's ``abort`` (a receiver still verifying when another's verdict failed).
    The controller drops it before the session table, which it then leaves as it is (docs/PROTOCOL.md)."""
    return msg_type in CROSSING and (rnd is None or version != rnd.version)


def report_or_raise(report: RoundReport) -> RoundReport:
    if not report.ok:
        reason, _, text = report.reason.partition(": ")
        raise RoundAborted(report.version, reason, text, report.culprit)
    return report
