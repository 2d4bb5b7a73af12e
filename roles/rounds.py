"""One update round as the controller tracks it, and the report it produces.

How this works: a ``RoundState`` knows who takes part (the senders and receivers of the current plan)
and holds one future per stage (writes done, fenced, applied). Handlers record each participant's
message; a stage's future resolves when the last one arrives. ``abort`` fails the stage in progress,
which the round task turns into ``abort`` messages. ``report`` turns timings and byte counts into a
``RoundReport`` (per stage and per link). ``RoundRunner`` is the controller's side that drives a round
over its sockets: begin -> writes_done -> fence -> commit -> commit_ack, or abort; a round with a single
receiver that offers ``fence_commit`` does fence and commit in one exchange (``_one_phase``).
The workers' round messages (begin_ack, writes_done, fence_ack, commit_ack) reach the running
round through it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Optional

import zmq

from weightsync.engine.errors import ConfigError, RoundAborted
from weightsync.wire import Envelope, Origin, Role
from weightsync.wire import messages as m

if TYPE_CHECKING:
    from .controller import Peer

log = logging.getLogger("weightsync")

STAGES = ("ready", "writes_done", "fenced", "applied")  # ready: the in-place receivers' begin_acks


@dataclasses.dataclass
class LinkStat:
    sender: int
    receiver: int
    nbytes: int
    count: int
    gbps: float


@dataclasses.dataclass
class RoundReport:
    version: int
    ok: bool
    nbytes: int
    seconds: float
    stages: dict[str, float]
    links: list[LinkStat]
    reason: str = ""
    culprit: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["gbps"] = round(self.gbps, 3)
        return d


class RoundState:
    def __init__(self, version: int, plan_id: int, senders: set[int], receivers: set[int], checksum: str) -> None:
        loop = asyncio.get_running_loop()
        self.version = version
        self.plan_id = plan_id
        self.senders = set(senders)
        self.receivers = set(receivers)
        self.checksum = checksum
        self.futures = {stage: loop.create_future() for stage in STAGES}
        for fut in self.futures.values():
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.writes: dict[int, m.WritesDone] = {}
        self.fence_acks: dict[int, Optional[m.FenceAck]] = {}  # None: a one-phase commit_ack stood for it
        self.applied: set[int] = set()
        self.gated: set[int] = set()  # in-place receivers whose begin_ack the senders' begin waits for
        self.begin_acks: set[int] = set()
        self.stage = "writing"
        self.committed = False
        self.one_phase = False  # fence and commit in one exchange (a round with one capable receiver)
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.aborted: Optional[RoundAborted] = None

    def __repr__(self) -> str:
        return (f"<Round v{self.version} {self.stage} writes={len(self.writes)}/{len(self.senders)} "
                f"fenced={len(self.fence_acks)}/{len(self.receivers)} applied={len(self.applied)}/{len(self.receivers)}>")

    def gate(self, receivers: set[int]) -> None:
        """Senders begin once these receivers have acknowledged ``begin`` (none: at once)."""
        self.gated = set(receivers)
        self._maybe("ready", self.begin_acks >= self.gated)

    def on_begin_ack(self, rank: int) -> None:
        self.begin_acks.add(rank)
        self._maybe("ready", self.begin_acks >= self.gated)

    def on_writes_done(self, rank: int, body: m.WritesDone) -> None:
        self.writes[rank] = body
        self._maybe("writes_done", set(self.writes) >= self.senders)

    def on_fence_ack(self, rank: int, body: m.FenceAck, blame: str = "") -> None:
        """``blame``: the sender the receiver's failed verification names (else the receiver is blamed)."""
        self.fence_acks[rank] = body
        if not body.ok:
            self.abort(m.AbortReason.CHECKSUM_MISMATCH,
                       f"receiver/{rank} failed verification: {body.text} {list(body.mismatches)[:5]}",
                       blame or f"receiver/{rank}")
            return
        if self.one_phase:  # the receiver applies on its own verdict: from here the round cannot abort
            self.committed = True
        self._maybe("fenced", set(self.fence_acks) >= self.receivers)

    def on_commit_ack(self, rank: int) -> None:
        if self.one_phase and rank not in self.fence_acks:  # verified and applied, said in one message
            self.committed = True
            self.fence_acks[rank] = None
            self._maybe("fenced", set(self.fence_acks) >= self.receivers)
        self.applied.add(rank)
        self._maybe("applied", self.applied >= self.receivers)

    def drop(self, role: m.Role, rank: int) -> None:
        """A participant is gone after commit: stop waiting for it."""
        group = self.senders if role is m.Role.SENDER else self.receivers
        group.discard(rank)
        if role is m.Role.RECEIVER:
            self.gated.discard(rank)
        for stage, cond in (("ready", self.begin_acks >= self.gated),
                            ("writes_done", set(self.writes) >= self.senders),
                            ("fenced", set(self.fence_acks) >= self.receivers),
                            ("applied", self.applied >= self.receivers)):
            self._maybe(stage, cond)

    def fence_for(self, receiver: int) -> tuple[m.WriteSummary, ...]:
        """What every sender reported for ``receiver``, with peer_rank set to the sender."""
        out = []
        for sender, body in sorted(self.writes.items()):
            for s in body.receivers:
                if s.peer_rank == receiver:
                    out.append(m.WriteSummary(sender, s.count, s.nbytes, s.checksums, s.proof))
        return tuple(out)

    def _maybe(self, stage: str, complete: bool) -> None:
        fut = self.futures[stage]
        if complete and not fut.done():
            self.marks[stage] = time.perf_counter()
            fut.set_result(None)

    def abort(self, reason: m.AbortReason, text: str, culprit: str = "") -> bool:
        """Fail the round if it is not committed yet; returns whether it did."""
        if self.committed or self.aborted is not None:
            return False
        self.aborted = RoundAborted(self.version, reason, text, culprit)
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(self.aborted)
        return True

    def report(self) -> RoundReport:
        end = time.perf_counter()
        marks = {"begin": self.t0, **self.marks}
        stages, prev = {}, self.t0
        for stage, label in (("writes_done", "transfer"), ("fenced", "fence"), ("applied", "commit")):
            if stage in marks:
                stages[label] = marks[stage] - prev
                prev = marks[stage]
        transfer_s = stages.get("transfer", end - self.t0) or 1e-9
        links, total = [], 0
        for sender, body in sorted(self.writes.items()):
            for s in body.receivers:
                links.append(LinkStat(sender, s.peer_rank, s.nbytes, s.count, s.nbytes / transfer_s / 1e9))
                total += s.nbytes
        stages["sender_stage_max"] = max((b.stage_s for b in self.writes.values()), default=0.0)
        stages["sender_write_max"] = max((b.write_s for b in self.writes.values()), default=0.0)
        failed = self.aborted
        if failed is None and not self.applied:  # told to commit, but no receiver said it applied
            failed = RoundAborted(self.version, m.AbortReason.PEER_LOST,
                                  "commit sent, but no receiver acknowledged applying it", "")
        ok = failed is None
        return RoundReport(
            version=self.version, ok=ok, nbytes=total, seconds=end - self.t0, stages=stages, links=links,
            reason="" if ok else getattr(failed.reason, "name", str(failed.reason)) + ": " + failed.text,
            culprit="" if ok else failed.culprit,
        )


class RoundRunner:
    """Mixin of ``Controller``: runs one round at a time over the sessions of the current plan."""

    def _plan_peer(self, key: tuple[Role, int]):
        """The live session the current plan named for ``key``, or None (it left or was replaced)."""
        identity = self.plan_sessions.get(key)
        return None if identity is None else self.peers.get(identity)

    def _plan_live(self) -> bool:
        return bool(self.plan_sessions) and all(i in self.peers for i in self.plan_sessions.values())

    def _in_plan(self, peer: "Peer") -> bool:
        return self.plan_sessions.get(peer.key) == peer.identity

    def _start_round(self, version: int) -> None:
        if self.plan is None or not self._ready.is_set() or self._round_task is not None or not self._plan_live():
            raise ConfigError("round", "no acknowledged plan with every member present yet, or a round is running")
        self._check_version(version)  # never a round that is not newer than the committed version
        senders = {r for role, r in self.plan_sessions if role is Role.SENDER}
        receivers = {r for role, r in self.plan_sessions if role is Role.RECEIVER}
        self.round = RoundState(version, self.plan.plan_id, senders, receivers, self.options.checksum)
        self.timeline.mark(version, "round:start", self.round.t0)
        self.spinner.hold()
        self._round_task = asyncio.ensure_future(self._run_round(self.round))

    async def _run_round(self, rnd: RoundState) -> None:
        try:
            await self._round_steps(rnd)
        except RoundAborted as exc:
            rnd.abort(exc.reason, exc.text, exc.culprit)  # no-op when the round recorded it already
        except asyncio.CancelledError:
            rnd.abort(m.AbortReason.SHUTDOWN, "controller shutting down", "controller")
            raise
        except Exception as exc:  # a bug of ours must never pass for a commit: abort, and say so
            log.exception("controller: round v%d failed", rnd.version)
            rnd.abort(m.AbortReason.CANCELLED, f"controller failed running the round: {exc!r}", "controller")
        finally:
            if rnd.aborted is not None:
                await asyncio.shield(self._send_aborts(rnd))
            self._finish_round(rnd, rnd.report())

    async def _round_steps(self, rnd: RoundState) -> None:
        deadline = self.options.round_timeout_s
        landing = tuple(m.Slot(r, self._plan_peer((Role.RECEIVER, r)).slot)
                        for r in sorted(rnd.receivers) if self._plan_peer((Role.RECEIVER, r)) is not None)
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
        fence = m.FenceCommit if rnd.one_phase else m.Fence
        for r in sorted(rnd.receivers):
            await self._send_to((Role.RECEIVER, r), fence(rnd.version, rnd.fence_for(r)), version=rnd.version)
        await self._stage(rnd, "fenced", deadline)
        rnd.stage = "committing"
        rnd.committed = True
        self.commit_sent = max(self.commit_sent, rnd.version)  # (a version told to commit is never reused)
        for key in sorted(self.plan_sessions):
            if self._plan_peer(key) is not None and not (rnd.one_phase and key[0] is Role.RECEIVER):
                await self._send_to(key, m.Commit(rnd.version), version=rnd.version)
        await self._stage(rnd, "applied", deadline)
        rnd.stage = "done"

    async def _begin(self, rnd: RoundState, keys: list[tuple[Role, int]], landing: tuple[m.Slot, ...]) -> None:
        for key in keys:
            slots = landing if key[0] is Role.SENDER else ()
            await self._send_to(key, m.UpdateBegin(rnd.version, rnd.plan_id, rnd.checksum, slots), version=rnd.version)

    def _gated(self, rnd: RoundState) -> set[int]:
        """In-place receivers that acknowledge ``begin`` once their ``before_update`` hook has run
        (capability ``begin_ack``): the senders begin after them, so no byte lands while serving runs."""
        return {r for r in rnd.receivers if (peer := self._plan_peer((Role.RECEIVER, r))) is not None
                and "begin_ack" in peer.hello.capabilities}

    def _one_phase(self, rnd: RoundState) -> bool:
        """A round with a single receiver that can apply on its own verdict needs no second phase:
        nobody else's verdict could still veto it. Saves the commit's round trip."""
        if not self.options.one_phase_commit or len(rnd.receivers) != 1:
            return False
        peer = self._plan_peer((Role.RECEIVER, next(iter(rnd.receivers))))
        return peer is not None and "fence_commit" in peer.hello.capabilities

    async def _stage(self, rnd: RoundState, stage: str, deadline: Optional[float]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(rnd.futures[stage]), deadline)
        except asyncio.TimeoutError:
            if not rnd.abort(m.AbortReason.TIMEOUT, f"stage {stage} took longer than {deadline}s"):
                missing = sorted(rnd.receivers - rnd.applied)  # committed: whoever applied it has it
                log.warning("controller: v%d committed; no commit_ack within %ss from receiver(s) %s",
                            rnd.version, deadline, missing)
                return
            await rnd.futures[stage]

    async def _send_to(self, key: tuple[Role, int], body: m.Message, *, version: Optional[int] = None) -> None:
        """Send to the session the plan named for ``key``: never to another session of the same rank."""
        peer = self._plan_peer(key)
        name = f"{key[0].value}/{key[1]}"
        if peer is None:
            raise RoundAborted(version or 0, m.AbortReason.PEER_LOST, f"{name} (the session planned) is gone", name)
        await self._send(peer, body, version=version)

    async def _send_aborts(self, rnd: RoundState) -> None:
        a = rnd.aborted
        log.warning("controller: %s", a)
        for key in sorted(self.plan_sessions):
            peer = self._plan_peer(key)
            if peer is not None and peer.session.allowed(Origin.CONTROLLER, m.Abort.TYPE):
                try:
                    await self._send(peer, m.Abort(rnd.version, a.reason, a.text, a.culprit), version=rnd.version)
                except zmq.ZMQError as exc:
                    log.warning("controller: abort of v%d to %s not sent: %s", rnd.version, peer.name, exc)

    def _finish_round(self, rnd: RoundState, report: RoundReport) -> None:
        self.spinner.release()
        if report.ok:
            self._learn_committed(rnd.version)
        self.reports.append(report)
        del self.reports[:-self.options.keep_reports]
        self.round, self._round_task = None, None
        fut = self._round_waiters.pop(rnd.version, None)
        if fut is not None and not fut.done():
            try:
                fut.set_result(self._report_or_raise(report))
            except RoundAborted as exc:
                fut.set_exception(exc)
        if self.on_round is not None:
            self.on_round(report)
        self._maybe_plan()
        self._maybe_start_rounds()

    # --- the round's messages from workers ------------------------------------------------------

    @staticmethod
    def _report_or_raise(report: RoundReport) -> RoundReport:
        if not report.ok:
            reason, _, text = report.reason.partition(": ")
            raise RoundAborted(report.version, reason, text, report.culprit)
        return report

    def _round_of(self, version: Optional[int]) -> Optional[RoundState]:
        """The running round if ``version`` is its version (late messages of old rounds are ignored)."""
        rnd = self.round
        return rnd if rnd is not None and version == rnd.version else None

    def _round_for(self, peer: "Peer", version: Optional[int]) -> Optional[RoundState]:
        """The running round, if ``version`` is its version and ``peer`` the session the plan named."""
        rnd = self._round_of(version)
        return rnd if rnd is not None and self._in_plan(peer) else None

    async def _on_begin_ack(self, peer: "Peer", env: Envelope) -> None:
        rnd = self._round_for(peer, env.body.version)
        if rnd is not None:
            rnd.on_begin_ack(peer.hello.rank)

    async def _on_writes_done(self, peer: "Peer", env: Envelope) -> None:
        rnd = self._round_for(peer, env.body.version)
        if rnd is not None:
            rnd.on_writes_done(peer.hello.rank, env.body)

    async def _on_fence_ack(self, peer: "Peer", env: Envelope) -> None:
        rnd = self._round_for(peer, env.body.version)
        if rnd is not None:
            rnd.on_fence_ack(peer.hello.rank, env.body, self._blamed(env.body))

    async def _on_commit_ack(self, peer: "Peer", env: Envelope) -> None:
        rnd = self._round_for(peer, env.body.version)
        if rnd is not None:
            if "slots:2" in peer.hello.capabilities and env.body.applied:
                peer.slot = 1 - peer.slot  # it swapped: next round lands in the other buffer
            rnd.on_commit_ack(peer.hello.rank)
            if env.body.applied:
                self._learn_committed(rnd.version)  # a receiver serves it: committed, whatever comes next

    def _blamed(self, ack: m.FenceAck) -> str:
        """The sender a failed verification blames (its writes were refused, out of bounds or short),
        if the plan names it; otherwise the receiver is blamed."""
        role, _, rank = (ack.blame or "").partition("/")
        if role == Role.SENDER.value and rank.isdigit() and (Role.SENDER, int(rank)) in self.plan_sessions:
            return ack.blame
        return ""
