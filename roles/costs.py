"""The controller's part that learns what rounds cost and predicts the next one.

How this works: a plan, once installed (``on_plan``), has its data replayed once with no per-row cost
(``engine.plan.model.makespan``, in a worker thread while its first round runs: 34 ms for a 12,658-row
MoE plan; replays at every per-row cost would hold the GIL for seconds, slowing the rounds beside
them). After every committed round but a plan's first (which connects, registers and compiles: a cost
paid once per plan, not per round), ``on_round`` hands ``engine.plan.costs.CostLearner`` each sender's
host seconds (its ``writes_done``) with its rows in the plan (not a round in which a sender was still
timing its transport's ways, ``writes_done.trying``: cuda_ipc alternates slow and fast ways then), takes the plan's makespan at the learned
per-row cost as the larger of that data makespan and the busiest sender's rows at that cost
(``_makespan``), learns the per-round cost from the round's seconds and predicts the next round, all at
once, before the next round can start. ``predict(plan_id)`` is what ``Rounds`` stores in each
round's report before it runs (0 while nothing is learned), beside its measured seconds; a new plan
is predicted with what earlier plans taught once its replays are done; ``status`` shows the costs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional, Sequence

from weightsync.engine.plan import LinkModel, RoutingPlan
from weightsync.engine.plan.costs import CostLearner, makespan_at
from weightsync.engine.plan.links import Participant
from weightsync.engine.plan.model import makespan

from .round_state import RoundReport

log = logging.getLogger("weightsync")


class Costs:
    def __init__(self, link: LinkModel, keep: int = 8) -> None:
        self.link = link
        self.learner = CostLearner(keep)
        self._plan_id = 0  # the latest plan's: its data's makespan (None until replayed), most rows a sender
        self._data_s: Optional[float] = None  # has, and its next round's predicted seconds (0: none yet)
        self._rows = 0
        self._next_s = 0.0
        self._lock = asyncio.Lock()  # (one replay at a time)
        self._tasks: set[asyncio.Task] = set()
        self._first = (0, -1)  # (plan id, version) of the latest plan's first committed round: not learned from

    def __repr__(self) -> str:
        return f"<Costs {self.learner!r} plan={self._plan_id} next={self._next_s * 1e3:.3f}ms>"

    def predict(self, plan_id: int) -> float:
        """The next round of ``plan_id``, in seconds (0.0: nothing learned for it yet)."""
        return self._next_s if plan_id == self._plan_id else 0.0

    def on_plan(self, plan: RoutingPlan, participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        """A plan is installed: replay its data once (no per-row cost), during its first round, which
        teaches nothing; each later round is then learned from and predicted at once."""
        if plan.plan_id == self._plan_id:
            return  # (acknowledged again: its replay stands)
        self._plan_id, self._data_s, self._next_s = plan.plan_id, None, 0.0
        self._rows = max((len(t.transfers) for t in plan.senders.values()), default=0)
        self._spawn(self._replay(plan, participants))

    def on_round(self, report: RoundReport, plan: Optional[RoutingPlan],
                 participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        if not report.ok or plan is None or report.plan_id != plan.plan_id or not report.senders_host_s:
            return
        if report.trying:  # (a sender still timing its ways: that round's cost is not the plan's)
            return
        if self._first[0] != plan.plan_id:
            self._first = (plan.plan_id, report.version)
        if self._first[1] == report.version:
            return
        hosts = {r: (host_s, len(plan.senders[r].transfers)) for r, host_s in report.senders_host_s.items()
                 if r in plan.senders}
        per_row = self.learner.observe_rows(hosts)
        if not self._observe(plan.plan_id, report.seconds, per_row):  # (its replay is still running)
            self._spawn(self._learn(report.seconds, plan, participants, per_row))

    def _observe(self, plan_id: int, round_s: float, per_row: float) -> bool:
        """Learn the round's per-round cost and predict the next; False while the plan's replay runs
        (or once the plan was replaced)."""
        span = self._makespan(plan_id, per_row)
        if span is None:
            return False
        self.learner.observe_round(round_s, span)
        self._refresh(plan_id)
        return True

    def _makespan(self, plan_id: int, per_row: float) -> Optional[float]:
        """The plan's makespan at ``per_row`` (``makespan_at``); None before its data's replay is done."""
        if plan_id != self._plan_id or self._data_s is None:
            return None
        return makespan_at(self._data_s, self._rows, per_row)

    def _refresh(self, plan_id: int) -> None:
        span, costs = self._makespan(plan_id, self.learner.per_row_s), self.learner.costs
        if span is not None and costs is not None:
            self._next_s = costs.predict(span)

    async def _learn(self, round_s: float, plan: RoutingPlan, participants, per_row: float) -> None:
        await self._replay(plan, participants)
        self._observe(plan.plan_id, round_s, per_row)

    async def _replay(self, plan: RoutingPlan, participants) -> None:
        """The plan's data makespan, once (in a worker thread, like planning: 34 ms for 12,658 rows)."""
        async with self._lock:
            if plan.plan_id != self._plan_id or self._data_s is not None:
                return
            senders, receivers = participants
            link = dataclasses.replace(self.link, per_transfer_s=0.0)
            data_s = await asyncio.to_thread(makespan, plan.senders, senders, receivers, link)
            if plan.plan_id == self._plan_id:  # (not replaced meanwhile)
                self._data_s = data_s
                self._refresh(plan.plan_id)

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
