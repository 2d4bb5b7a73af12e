"""The round costs the controller learns (``engine/plan/costs.py``): recovered from rounds the model
itself generates, carried over to a plan of other shapes, robust to one odd round."""

from __future__ import annotations

import dataclasses

import pytest

from weightsync.engine.plan import LinkModel, makespan
from weightsync.engine.plan.costs import CostLearner
from weightsync.wire import SenderTable, Transfer
from plan_helpers import participant, tensor

PER_ROW, PER_ROUND = 40e-6, 1.5e-3  # the "engine" the learner watches
LINK = LinkModel(net_bw=10e9, per_transfer_s=2e-6)


def _plan(rows: int, nbytes: int):
    """One sender writing ``rows`` rows of ``nbytes`` to each of two receivers on other hosts."""
    senders = [participant(0, [tensor("w", (1024, 1024))], host="s")]
    receivers = [participant(r, [tensor("w", (1024, 1024))], host=f"r{r}") for r in range(2)]
    transfers = tuple(Transfer(i, "w", None, i % 2, "w", 0, (i // 2) * nbytes, nbytes, "") for i in range(rows))
    return {0: SenderTable(0, transfers, ())}, senders, receivers


def _round(plan, per_row=PER_ROW, extra=0.0) -> tuple[float, dict]:
    """What the watched engine does: (its round's seconds, its senders' host seconds and rows)."""
    tables, senders, receivers = plan
    seconds = makespan(tables, senders, receivers, dataclasses.replace(LINK, per_transfer_s=per_row)) + PER_ROUND + extra
    return seconds, {0: (per_row * len(tables[0].transfers), len(tables[0].transfers))}


def _learn(learner: CostLearner, plan, **kw) -> float:
    seconds, hosts = _round(plan, **kw)
    per_row = learner.observe_rows(hosts)
    tables, senders, receivers = plan
    learner.observe_round(seconds, makespan(tables, senders, receivers, dataclasses.replace(LINK, per_transfer_s=per_row)))
    return seconds


def _predict(learner: CostLearner, plan) -> float:
    tables, senders, receivers = plan
    costs = learner.costs
    return costs.predict(makespan(tables, senders, receivers, dataclasses.replace(LINK, per_transfer_s=costs.per_row_s)))


def test_costs_learned_on_a_few_large_rows_predict_a_plan_of_many_small_ones():
    """Learned where data dominates (8 rows of 4 MB), the costs predict a plan where issuing does (4,000
    rows of 1 KB): the model's own makespan is 7x off there, the learned prediction exact."""
    learner = CostLearner()
    for _ in range(3):
        _learn(learner, _plan(8, 4 << 20))
    assert learner.costs.per_row_s == pytest.approx(PER_ROW) and learner.costs.per_round_s == pytest.approx(PER_ROUND)
    many = _plan(4000, 1024)
    truth, _ = _round(many)
    tables, senders, receivers = many
    assert makespan(tables, senders, receivers, LINK) < truth / 7  # (what the bare model predicts)
    assert _predict(learner, many) == pytest.approx(truth, rel=1e-9)


def test_one_odd_round_moves_neither_cost():
    learner = CostLearner(keep=5)
    plan = _plan(64, 1 << 20)
    for _ in range(2):
        _learn(learner, plan)
    _learn(learner, plan, per_row=10 * PER_ROW, extra=0.5)  # (a stall: a page fault storm, a noisy neighbour)
    for _ in range(2):
        _learn(learner, plan)
    assert learner.costs.per_row_s == pytest.approx(PER_ROW) and learner.costs.per_round_s == pytest.approx(PER_ROUND)
    assert learner.costs.rounds == 5


def test_nothing_learned_predicts_nothing_and_costs_are_never_negative():
    learner = CostLearner()
    assert learner.costs is None and learner.per_row_s == 0.0
    assert learner.observe_rows({0: (1.0, 0)}) == 0.0  # (a sender with no rows says nothing of rows)
    learner.observe_round(0.001, 0.002)  # faster than the model: the link beat its modelled bandwidth
    assert learner.costs.per_round_s == 0.0
    with pytest.raises(ValueError, match="keep"):
        CostLearner(keep=0)
