"""One update round as the controller tracks it, its transitions in one table, and its report.

How this works: a ``RoundState`` knows who takes part (the senders and receivers of the plan that the
round runs) and holds one future per stage. ``receive`` records a participant's round message; a
stage's future resolves when the last one it waits for arrives (``ROUND_STEPS`` says which, and what
the controller sends next: ``rounds.Rounds`` carries it out). ``abort`` fails the stage in progress
(never after commit), which the round task turns into ``abort`` messages. ``report`` turns timings and
byte counts into a ``RoundReport`` (per stage and per link). Pure bookkeeping: no sockets here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Optional

from weightsync.engine.errors import RoundAborted
from weightsync.wire import messages as m

if TYPE_CHECKING:
    from .arms import Arm

# A round's transitions, in order: the stage the controller waits for, what completes it, and what the
# controller sends when it is complete. Any failure before ``commit`` is sent (a participant's error, a
# failed verification, a lost session, a deadline, a bug) aborts the round: ``abort`` to every member,
# nothing becomes visible. After ``commit`` nothing aborts: a receiver that does not acknowledge is
# dropped from the wait, and the version counts as committed once any receiver says it applied it.
ROUND_STEPS = (
    ("ready", "begin_ack from every in-place receiver that offered it (begin went to them first)",
     "begin to the senders"),
    ("writes_done", "writes_done from every sender", "fence to every receiver (fence_commit to a lone one)"),
    ("fenced", "an ok fence_ack from every receiver (a lone one's commit_ack says both)",
     "commit to every member (the senders only, after a one-phase commit)"),
    ("applied", "commit_ack from every receiver still joined", "nothing: the round is over"),
)


STAGES = tuple(step[0] for step in ROUND_STEPS)


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
    whole_bytes: int = 0  # what the round's rows are whole (``nbytes`` is what went: less where deltas went)
    delta_rows: int = 0  # rows that went as deltas
    changed_values: int = 0  # values those deltas changed
    plan_id: int = 0
    predicted_s: float = 0.0  # what the controller predicted before it ran (roles.costs; 0: nothing learned yet)
    senders_host_s: dict[int, float] = dataclasses.field(default_factory=dict)  # per sender: staging + queueing writes
    trying: bool = False  # a sender was still timing its transport's ways (engine.cuda.fastest): not a steady round
    checksum: str = ""  # the algorithm every row of the round was checked with ("": not checked end to end)
    armed: int = 0  # senders that wrote on their own push, under an arm (roles.arms)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["gbps"] = round(self.gbps, 3)
        d["senders_host_s"] = {str(r): s for r, s in self.senders_host_s.items()}  # (JSON keys are strings)
        return d


class RoundState:
    def __init__(self, version: int, plan_id: int, senders: set[int], receivers: set[int], checksum: str,
                 whole_bytes: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self.version = version
        self.plan_id = plan_id
        self.senders = set(senders)
        self.receivers = set(receivers)
        self.checksum = checksum
        self.whole_bytes = whole_bytes
        self.futures = {stage: loop.create_future() for stage in STAGES}
        for fut in self.futures.values():
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.writes: dict[int, m.WritesDone] = {}
        self.predicted_s = 0.0  # (set by ``Rounds.start``)
        self.fence_acks: dict[int, Optional[m.FenceAck]] = {}  # None: a one-phase commit_ack stood for it
        self.commit_acks: dict[int, m.CommitAck] = {}
        self.applied: set[int] = set()
        self.gated: set[int] = set()  # in-place receivers whose begin_ack the senders' begin waits for
        self.begin_acks: set[int] = set()
        self.stage = "writing"
        self.committed = False
        self.one_phase = False  # fence and commit in one exchange (a round with one capable receiver)
        self.deciding = False  # one phase, fence_commit sent: the receiver applies on its own verdict (``abort``)
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.aborted: Optional[RoundAborted] = None
        self.armed_by: set[bytes] = set()  # the sessions that did
        self.arm: Optional["Arm"] = None  # the arm its senders wrote under on their own push (roles.arms)
        self.void: list[int] = []  # other versions written under an arm: never run (``Rounds.start``)
        self.broken: Optional[tuple] = None  # (reason, text, culprit): why writes under an arm do not count, and
        #                                       whom to blame: it aborts (``roles.arming``)
        self.landing: tuple[m.Slot, ...] = ()  # what the round's begin names (``Rounds.start``)
        self.bases: tuple[m.Base, ...] = ()
        self.delta = ""

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
                       blame or f"receiver/{rank}", force=True)
            return
        if self.one_phase:  # the receiver applies on its own verdict: from here the round cannot abort
            self.committed = True
        self._maybe("fenced", set(self.fence_acks) >= self.receivers)

    def on_commit_ack(self, rank: int, body: Optional[m.CommitAck] = None) -> None:
        if self.one_phase and rank not in self.fence_acks:  # verified and applied, said in one message
            self.committed = True
            self.fence_acks[rank] = None
            self._maybe("fenced", set(self.fence_acks) >= self.receivers)
        self.applied.add(rank)
        if body is not None:
            self.commit_acks[rank] = body
        self._maybe("applied", self.applied >= self.receivers)

    def receive(self, rank: int, body: m.Message, blame: str = "") -> None:
        """A participant's round message (``blame``: the sender a failed fence_ack names, if any)."""
        if isinstance(body, m.BeginAck):
            self.on_begin_ack(rank)
        elif isinstance(body, m.WritesDone):
            self.on_writes_done(rank, body)
        elif isinstance(body, m.FenceAck):
            self.on_fence_ack(rank, body, blame)
        elif isinstance(body, m.CommitAck):
            self.on_commit_ack(rank, body)

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
                    out.append(dataclasses.replace(s, peer_rank=sender))
        return tuple(out)

    def _maybe(self, stage: str, complete: bool) -> None:
        fut = self.futures[stage]
        if complete and not fut.done():
            self.marks[stage] = time.perf_counter()
            fut.set_result(None)

    def abort(self, reason: m.AbortReason, text: str, culprit: str = "", *, force: bool = False) -> bool:
        """Fail the round if it is not committed yet; returns whether it did. While the lone receiver of a
        one-phase round decides (``deciding``: from its ``fence_commit`` it applies on its own verdict, and
        an ``abort`` could reach it after it did), only a ``force`` abort counts: its own failed verdict,
        error or loss, the round's timeout, shutdown. Nobody else's failure can stop it from there."""
        if self.committed or self.aborted is not None or (self.deciding and not force):
            return False
        self.aborted = RoundAborted(self.version, reason, text, culprit)
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(self.aborted)
        return True

    def _work_s(self) -> dict[str, float]:
        """The round's busiest sender encoding deltas, and receiver applying them and checking checksums
        (in its fence_ack, or as a one-phase round's receiver in its commit_ack), as they reported (seconds)."""
        def receiver(rank: int, field: str) -> float:
            fence, commit = self.fence_acks.get(rank), self.commit_acks.get(rank)
            return (getattr(fence, field) if fence is not None else 0.0) + (getattr(commit, field) if commit else 0.0)

        ranks = set(self.fence_acks) | set(self.commit_acks)
        return {"sender_encode_max": max((b.encode_s for b in self.writes.values()), default=0.0),
                "receiver_apply_max": max((receiver(r, "apply_s") for r in ranks), default=0.0),
                "receiver_verify_max": max((receiver(r, "verify_s") for r in ranks), default=0.0)}

    def report(self) -> RoundReport:
        end = time.perf_counter()
        marks = {"begin": self.t0, **self.marks}
        stages, prev = {}, self.t0
        for stage, label in (("ready", "gate"), ("writes_done", "transfer"), ("fenced", "fence"), ("applied", "commit")):
            if stage in marks:
                stages[label] = marks[stage] - prev
                prev = marks[stage]
        transfer_s = stages.get("transfer", end - self.t0) or 1e-9
        links, total, rows, changed = [], 0, 0, 0
        for sender, body in sorted(self.writes.items()):
            for s in body.receivers:
                links.append(LinkStat(sender, s.peer_rank, s.nbytes, s.count, s.nbytes / transfer_s / 1e9))
                total += s.nbytes
                rows += len(s.deltas)
                changed += sum(d.changes for d in s.deltas)
        stages["sender_stage_max"] = max((b.stage_s for b in self.writes.values()), default=0.0)
        stages["sender_write_max"] = max((b.write_s for b in self.writes.values()), default=0.0)
        stages.update(self._work_s())
        failed = self.aborted
        if failed is None and not self.applied:  # told to commit, but no receiver said it applied
            failed = RoundAborted(self.version, m.AbortReason.PEER_LOST,
                                  "commit sent, but no receiver acknowledged applying it", "")
        ok = failed is None
        return RoundReport(
            version=self.version, ok=ok, nbytes=total, seconds=end - self.t0, stages=stages, links=links,
            reason="" if ok else getattr(failed.reason, "name", str(failed.reason)) + ": " + failed.text,
            culprit="" if ok else failed.culprit, whole_bytes=self.whole_bytes, delta_rows=rows, changed_values=changed,
            plan_id=self.plan_id, predicted_s=self.predicted_s,
            senders_host_s={r: b.stage_s + b.issue_s for r, b in sorted(self.writes.items())},
            trying=any(b.trying for b in self.writes.values()), checksum=self.checksum,
            armed=len(self.armed_by),
        )
