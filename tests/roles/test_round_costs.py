"""The controller's ``Costs`` part (``roles/costs.py``) on its own: a round that finishes before its plan's
replay is learned from once the replay is done, a replaced plan's late replay is dropped, and a
prediction is the data makespan or the busiest sender's rows at the learned cost, whichever is longer,
plus the per-round cost."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from weightsync.engine.plan import LinkModel, RoutingPlan, makespan
from weightsync.roles.costs import Costs
from weightsync.roles.round_state import RoundReport
from weightsync.wire import SenderTable, Transfer
from plan_helpers import participant, tensor

LINK = LinkModel(net_bw=1e9)


def _plan(plan_id: int, rows: int) -> tuple[RoutingPlan, tuple]:
    senders = [participant(0, [tensor("w", (1024, 1024))], host="s")]
    receivers = [participant(0, [tensor("w", (1024, 1024))], host="r")]
    table = SenderTable(0, tuple(Transfer(i, "w", None, 0, "w", 0, i * 4096, 4096, "") for i in range(rows)), ())
    return RoutingPlan(plan_id, {0: table}, {}), (senders, receivers)


def _report(version: int, plan_id: int, seconds: float, host_s: float) -> RoundReport:
    return RoundReport(version, True, 0, seconds, {}, [], plan_id=plan_id, senders_host_s={0: host_s})


async def test_rounds_that_finish_before_the_replay_are_learned_from_once_it_is_done():
    costs = Costs(LINK)
    plan, members = _plan(1, 100)
    costs.on_plan(plan, members)  # (its replay runs in a thread: not done yet)
    for v, seconds in ((1, 9.0), (2, 0.004), (3, 0.004)):  # the first, slow one teaches nothing
        costs.on_round(_report(v, 1, seconds, host_s=100 * 20e-6), plan, members)
    assert costs.predict(1) == 0.0
    await asyncio.wait_for(costs.settled(), 30)
    data_s = makespan(plan.senders, *members, dataclasses.replace(LINK, per_transfer_s=0.0))
    learned = costs.learner.costs
    assert learned.rounds == 2 and learned.per_row_s == pytest.approx(20e-6)
    assert learned.per_round_s == pytest.approx(0.004 - max(data_s, 100 * 20e-6))
    assert costs.predict(1) == pytest.approx(0.004)


async def test_a_new_plan_is_predicted_with_what_the_last_one_taught_and_a_replaced_plans_replay_is_dropped():
    costs = Costs(LINK)
    small, members = _plan(1, 10)
    costs.on_plan(small, members)
    await asyncio.wait_for(costs.settled(), 30)
    for v in (1, 2, 3):
        costs.on_round(_report(v, 1, 0.003, host_s=10 * 50e-6), small, members)
    large, _ = _plan(2, 1000)
    costs.on_plan(large, members)
    costs.on_round(_report(4, 1, 1.0, host_s=1.0), small, members)  # (a round of the replaced plan: ignored)
    await asyncio.wait_for(costs.settled(), 30)
    learned = costs.learner.costs
    assert learned.rounds == 2 and costs.predict(1) == 0.0
    data_s = makespan(large.senders, *members, dataclasses.replace(LINK, per_transfer_s=0.0))
    assert costs.predict(2) == pytest.approx(max(data_s, 1000 * 50e-6) + learned.per_round_s)
    assert costs.status() == learned.to_json()


async def test_rounds_in_which_a_sender_was_still_timing_its_ways_teach_nothing():
    """cuda_ipc times its ways into another GPU on a plan's first rounds, alternating a slow and a fast
    one (``writes_done.trying``): those rounds are not what the plan costs, so the prediction comes from
    the rounds after them only."""
    costs = Costs(LINK)
    plan, members = _plan(1, 100)
    costs.on_plan(plan, members)
    await asyncio.wait_for(costs.settled(), 30)
    rounds = [(1, 9.0, False), (2, 0.030, True), (3, 0.010, True), (4, 0.030, True), (5, 0.010, False),
              (6, 0.010, False)]
    for v, seconds, trying in rounds:
        costs.on_round(dataclasses.replace(_report(v, 1, seconds, host_s=100 * 20e-6), trying=trying), plan, members)
    assert costs.learner.costs.rounds == 2
    assert costs.predict(1) == pytest.approx(0.010)
