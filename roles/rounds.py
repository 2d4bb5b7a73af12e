"""One update round as the controller tracks it, and the report it produces.

How this works: a ``RoundState`` knows who takes part (the senders and receivers of the current plan)
and holds one future per stage (writes done, fenced, applied). Handlers record each participant's
message; a stage's future resolves when the last one arrives. ``abort`` fails the stage in progress,
which the round task turns into ``abort`` messages. ``report`` turns timings and byte counts into a
``RoundReport`` (per stage and per link). No I/O here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Optional

from engine.errors import RoundAborted
from wire import messages as m

STAGES = ("writes_done", "fenced", "applied")


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
        self.fence_acks: dict[int, m.FenceAck] = {}
        self.applied: set[int] = set()
        self.stage = "writing"
        self.committed = False
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.aborted: Optional[RoundAborted] = None

    def __repr__(self) -> str:
        return (f"<Round v{self.version} {self.stage} writes={len(self.writes)}/{len(self.senders)} "
                f"fenced={len(self.fence_acks)}/{len(self.receivers)} applied={len(self.applied)}/{len(self.receivers)}>")

    def on_writes_done(self, rank: int, body: m.WritesDone) -> None:
        self.writes[rank] = body
        self._maybe("writes_done", set(self.writes) >= self.senders)

    def on_fence_ack(self, rank: int, body: m.FenceAck) -> None:
        self.fence_acks[rank] = body
        if not body.ok:
            self.abort(m.AbortReason.CHECKSUM_MISMATCH,
                       f"receiver/{rank} failed verification: {body.text} {list(body.mismatches)[:5]}",
                       f"receiver/{rank}")
            return
        self._maybe("fenced", set(self.fence_acks) >= self.receivers)

    def on_commit_ack(self, rank: int) -> None:
        self.applied.add(rank)
        self._maybe("applied", self.applied >= self.receivers)

    def drop(self, role: m.Role, rank: int) -> None:
        """A participant is gone after commit: stop waiting for it."""
        group = self.senders if role is m.Role.SENDER else self.receivers
        group.discard(rank)
        for stage, cond in (("writes_done", set(self.writes) >= self.senders),
                            ("fenced", set(self.fence_acks) >= self.receivers),
                            ("applied", self.applied >= self.receivers)):
            self._maybe(stage, cond)

    def fence_for(self, receiver: int) -> tuple[m.WriteSummary, ...]:
        """What every sender reported for ``receiver``, with peer_rank set to the sender."""
        out = []
        for sender, body in sorted(self.writes.items()):
            for s in body.receivers:
                if s.peer_rank == receiver:
                    out.append(m.WriteSummary(sender, s.count, s.nbytes, s.checksums))
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
        ok = self.aborted is None
        return RoundReport(
            version=self.version, ok=ok, nbytes=total, seconds=end - self.t0, stages=stages, links=links,
            reason="" if ok else getattr(self.aborted.reason, "name", str(self.aborted.reason)) + ": " + self.aborted.text,
            culprit="" if ok else self.aborted.culprit,
        )
