"""The controller's part that learns what rounds cost and predicts the next one.

How this works: a plan, once installed (``on_plan``), is replayed (``engine.plan.model.makespan``, in
a worker thread: a plan of many thousand rows takes up to a second) at every per-row cost of ``GRID``,
while its first round runs. After every committed round but a plan's first (which connects, registers
and compiles: a cost paid once per plan, not per round), ``on_round`` hands
``engine.plan.costs.CostLearner`` each sender's host seconds (its ``writes_done``) with its rows in the
plan, reads the plan's makespan at the learned per-row cost from those replays (interpolated between
the two around it; makespans grow with the per-row cost), learns the per-round cost from the round's
seconds and predicts the next round, all at once, before the next round can start; a replay at exactly
the learned cost then refines the prediction. ``predict(plan_id)`` is what ``Rounds`` stores in each
round's report before it runs (0 while nothing is learned), beside its measured seconds; a new plan
is predicted with what earlier plans taught once its replays are done; ``status`` shows the costs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional, Sequence

import numpy

from weightsync.engine.plan import LinkModel, RoutingPlan
from weightsync.engine.plan.costs import CostLearner
from weightsync.engine.plan.links import Participant
from weightsync.engine.plan.model import makespan

from .round_state import RoundReport

log = logging.getLogger("weightsync")
REUSE = 0.02  # a replay stands for per-row costs within 2% of its own
GRID = (0.0, 1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)  # per-row costs every plan is replayed at


class Costs:
    def __init__(self, link: LinkModel, keep: int = 8) -> None:
        self.link = link
        self.learner = CostLearner(keep)
        self._predicted: dict[int, float] = {}  # plan id -> the next round's predicted seconds
        self._replays: dict[float, float] = {}  # the plan's makespan at each per-row cost replayed (GRID and exact)
        self._plan_id = 0  # (whose replays those are)
        self._lock = asyncio.Lock()  # (one replay at a time, in the order asked)
        self._tasks: set[asyncio.Task] = set()
        self._first = (0, -1)  # (plan id, version) of the latest plan's first committed round: not learned from

    def __repr__(self) -> str:
        return f"<Costs {self.learner!r} predicted={self._predicted}>"

    def predict(self, plan_id: int) -> float:
        """The next round of ``plan_id``, in seconds (0.0: nothing learned for it yet)."""
        return self._predicted.get(plan_id, 0.0)

    def on_plan(self, plan: RoutingPlan, participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        """A plan is installed: replay it at every ``GRID`` per-row cost (during its first round, which
        teaches nothing), so each later round is learned from and predicted at once."""
        if plan.plan_id == self._plan_id:
            return  # (acknowledged again: its replays stand)
        self._plan_id, self._replays, self._predicted = plan.plan_id, {}, {}
        self._spawn(self._replayed(plan, participants, GRID))

    def on_round(self, report: RoundReport, plan: Optional[RoutingPlan],
                 participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        if not report.ok or plan is None or report.plan_id != plan.plan_id or not report.senders_host_s:
            return
        if self._first[0] != plan.plan_id:
            self._first = (plan.plan_id, report.version)
        if self._first[1] == report.version:
            return
        hosts = {r: (host_s, len(plan.senders[r].transfers)) for r, host_s in report.senders_host_s.items()
                 if r in plan.senders}
        per_row = self.learner.observe_rows(hosts)
        span = self._makespan(plan.plan_id, per_row)
        if span is None:  # (its replays are still running: learn once they are done)
            self._spawn(self._learn(report.seconds, plan, participants, per_row))
            return
        self.learner.observe_round(report.seconds, span)
        self._refresh(plan.plan_id)
        if self._exact(self.learner.per_row_s) is None:  # refine: a replay at exactly the learned cost
            self._spawn(self._replayed(plan, participants, (self.learner.per_row_s,)))

    def _makespan(self, plan_id: int, per_row: float) -> Optional[float]:
        """The plan's makespan at ``per_row``: a replay within ``REUSE`` of it, else interpolated between
        the replays around it (makespans grow with the per-row cost); None before any."""
        if plan_id != self._plan_id or len(self._replays) < 2:
            return None
        exact = self._exact(per_row)
        if exact is not None:
            return exact
        points = sorted(self._replays.items())
        return float(numpy.interp(per_row, [a for a, _ in points], [m for _, m in points]))

    def _exact(self, per_row: float) -> Optional[float]:
        near = [a for a in self._replays if abs(a - per_row) <= REUSE * max(a, 1e-12)]
        return self._replays[near[0]] if near else None

    def _refresh(self, plan_id: int) -> None:
        span, costs = self._makespan(plan_id, self.learner.per_row_s), self.learner.costs
        if span is not None and costs is not None:
            self._predicted[plan_id] = costs.predict(span)

    async def _learn(self, round_s: float, plan: RoutingPlan, participants, per_row: float) -> None:
        await self._replay(plan, participants, (per_row,))
        span = self._makespan(plan.plan_id, per_row)
        if span is not None:  # (None: the plan was replaced meanwhile)
            self.learner.observe_round(round_s, span)
            self._refresh(plan.plan_id)

    async def _replayed(self, plan: RoutingPlan, participants, per_rows: Sequence[float]) -> None:
        await self._replay(plan, participants, per_rows)
        self._refresh(plan.plan_id)

    async def _replay(self, plan: RoutingPlan, participants, per_rows: Sequence[float]) -> None:
        """Replay the plan at each of ``per_rows`` not replayed yet (in a worker thread: a plan of many
        thousand rows takes a while)."""
        async with self._lock:
            todo = [a for a in per_rows if self._exact(a) is None]
            if plan.plan_id != self._plan_id or not todo:
                return
            senders, receivers = participants
            spans = await asyncio.to_thread(
                lambda: [makespan(plan.senders, senders, receivers, dataclasses.replace(self.link, per_transfer_s=a))
                         for a in todo])
            if plan.plan_id == self._plan_id:  # (not replaced meanwhile)
                self._replays.update(zip(todo, spans))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a prediction is never worth a round
            log.warning("controller: learning round costs failed: %r", task.exception())

    async def settled(self) -> None:
        """Until every replay queued so far is done (tests, benches)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel(self) -> list[asyncio.Task]:
        for task in self._tasks:
            task.cancel()
        return list(self._tasks)

    def status(self) -> Optional[dict]:
        costs = self.learner.costs
        return None if costs is None else costs.to_json()
