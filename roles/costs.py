"""The controller's part that learns what rounds cost and predicts the next one.

How this works: after every committed round but a plan's first (which connects, registers and compiles:
a cost paid once per plan, not per round), ``on_round`` hands ``engine.plan.costs.CostLearner`` each
sender's host seconds (its ``writes_done``) with its rows in the plan, then replays the plan's makespan
with the learned per-row cost (``engine.plan.model.makespan``, in a worker thread: a plan of thousands
of rows takes milliseconds to replay) and learns the per-round cost from the round's seconds. Each
replay also gives the prediction for the next round of that plan; a new plan (``on_plan``) is replayed
with the costs learned so far, so its first round is predicted too. ``predict(plan_id)`` is what
``Rounds`` stores in each round's report before it runs (0 while nothing is learned), beside its
measured seconds; ``status`` shows the learned costs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional, Sequence

from weightsync.engine.plan import LinkModel, RoutingPlan
from weightsync.engine.plan.costs import CostLearner
from weightsync.engine.plan.links import Participant
from weightsync.engine.plan.model import makespan

from .round_state import RoundReport

log = logging.getLogger("weightsync")
REUSE = 0.02  # a replay stands for per-row costs within 2% of its own


class Costs:
    def __init__(self, link: LinkModel, keep: int = 8) -> None:
        self.link = link
        self.learner = CostLearner(keep)
        self._predicted: dict[int, float] = {}  # plan id -> the next round's predicted seconds
        self._replays: dict[tuple[int, float], float] = {}  # (plan id, per-row seconds) -> makespan
        self._lock = asyncio.Lock()  # (one replay at a time, in the order rounds finished)
        self._tasks: set[asyncio.Task] = set()
        self._first: dict[int, int] = {}  # plan id -> the version of its first committed round (not learned from)

    def __repr__(self) -> str:
        return f"<Costs {self.learner!r} predicted={self._predicted}>"

    def predict(self, plan_id: int) -> float:
        """The next round of ``plan_id``, in seconds (0.0: nothing learned for it yet)."""
        return self._predicted.get(plan_id, 0.0)

    def on_plan(self, plan: RoutingPlan, participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        if self.learner.costs is not None:
            self._spawn(self._predict(plan, participants))

    def on_round(self, report: RoundReport, plan: Optional[RoutingPlan],
                 participants: tuple[Sequence[Participant], Sequence[Participant]]) -> None:
        if not report.ok or plan is None or report.plan_id != plan.plan_id or not report.senders_host_s:
            return
        if self._first.setdefault(plan.plan_id, report.version) == report.version:
            self._first = {plan.plan_id: report.version}
            return
        hosts = {r: (host_s, len(plan.senders[r].transfers)) for r, host_s in report.senders_host_s.items()
                 if r in plan.senders}
        per_row = self.learner.observe_rows(hosts)
        self._spawn(self._learn(report.seconds, plan, participants, per_row))

    async def _learn(self, round_s: float, plan: RoutingPlan, participants, per_row: float) -> None:
        self.learner.observe_round(round_s, await self._replay(plan, participants, per_row))
        await self._predict(plan, participants)

    async def _predict(self, plan: RoutingPlan, participants) -> None:
        costs = self.learner.costs
        self._predicted[plan.plan_id] = costs.predict(await self._replay(plan, participants, costs.per_row_s))
        for old in [p for p in self._predicted if p < plan.plan_id]:
            del self._predicted[old]

    async def _replay(self, plan: RoutingPlan, participants, per_row: float) -> float:
        """The plan's makespan with ``per_row`` as its issue cost; a replay of the same plan with a
        per-row cost within ``REUSE`` of it stands in (a plan of many thousand rows takes a while)."""
        async with self._lock:
            near = [k for k in self._replays if k[0] == plan.plan_id and abs(k[1] - per_row) <= REUSE * max(k[1], 1e-9)]
            key = near[0] if near else (plan.plan_id, per_row)
            if key not in self._replays:
                link = dataclasses.replace(self.link, per_transfer_s=per_row)
                senders, receivers = participants
                self._replays = {k: v for k, v in self._replays.items() if k[0] == plan.plan_id}
                self._replays[key] = await asyncio.to_thread(makespan, plan.senders, senders, receivers, link)
            return self._replays[key]

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
