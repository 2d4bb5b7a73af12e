"""The round costs the makespan model misses, learned from committed rounds.

How this works: ``model.makespan`` replays a plan's data over its links, with one host thread per
sender issuing a row every ``LinkModel.per_transfer_s``, and stops there. A round also costs what no
bandwidth explains, and both are learned from the rounds themselves:

- **per row**: each sender reports its own host seconds in ``writes_done`` (staging and queueing every
  row's write: ``stage_s`` + ``issue_s``). Over its rows that is its per-row host cost; a round's
  observation is the busiest sender's (the slowest issuer holds the round back).
- **per round**: the control messages, the fence and the commit, and whatever else the model still
  misses: the measured round less the plan's makespan at the learned per-row cost.

Each cost is the median of the last ``keep`` observations (one odd round moves neither), never below
zero. A plan's makespan at a per-row cost (``makespan_at``) is the larger of its data's (replayed once
with no per-row cost) and its busiest sender's rows issued at that cost: both are lower bounds of a
full replay at that cost, and within 2.3% of it on a 12,658-row MoE plan from 0 to 1 ms a row. A
prediction is that plus the learned per-round cost; the costs carry over to other plans (more or fewer
rows, other links), which is what makes them a model and not an echo of the last round. Pure: the
controller feeds it and replays the data (off its event loop, ``roles.costs``).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Mapping, Optional


def makespan_at(data_s: float, rows: int, per_row_s: float) -> float:
    """A plan's makespan when each row costs its sender ``per_row_s`` of host time: ``data_s`` (its
    makespan with no per-row cost) or its busiest sender's ``rows`` issued one after another, whichever
    is longer."""
    return max(data_s, rows * per_row_s)


@dataclasses.dataclass(frozen=True)
class RoundCosts:
    """What the learner holds now: seconds per row (host), seconds per round (fixed), and the
    committed rounds behind them."""

    per_row_s: float
    per_round_s: float
    rounds: int

    def predict(self, makespan_s: float) -> float:
        """A round whose makespan at ``per_row_s`` (``makespan_at``) is ``makespan_s``."""
        return makespan_s + self.per_round_s

    def to_json(self) -> dict:
        return {"per_row_us": round(self.per_row_s * 1e6, 3), "per_round_ms": round(self.per_round_s * 1e3, 3),
                "rounds": self.rounds}


class CostLearner:
    """Observations in, ``RoundCosts`` out. Per committed round: ``observe_rows`` with each sender's
    (host seconds, rows), which returns the per-row cost learned so far; then ``observe_round`` with
    the round's seconds and the plan's makespan at that cost."""

    def __init__(self, keep: int = 8) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self._per_row: collections.deque[float] = collections.deque(maxlen=keep)
        self._per_round: collections.deque[float] = collections.deque(maxlen=keep)
        self.rounds = 0

    def __repr__(self) -> str:
        costs = self.costs
        shown = "nothing yet" if costs is None else (f"{costs.per_row_s * 1e6:.2f} us/row "
                                                     f"{costs.per_round_s * 1e3:.3f} ms/round")
        return f"<CostLearner {shown} rounds={self.rounds}>"

    def observe_rows(self, hosts: Mapping[int, tuple[float, int]]) -> float:
        """``hosts``: per sender rank, (its host seconds this round, its rows). -> the per-row cost
        learned so far (this round included)."""
        rates = [host_s / rows for host_s, rows in hosts.values() if rows > 0]
        if rates:
            self._per_row.append(max(0.0, max(rates)))
        return self.per_row_s

    def observe_round(self, round_s: float, makespan_s: float) -> None:
        """The round took ``round_s``; the plan's makespan at ``per_row_s`` is ``makespan_s``."""
        self._per_round.append(max(0.0, round_s - makespan_s))
        self.rounds += 1

    @property
    def per_row_s(self) -> float:
        return statistics.median(self._per_row) if self._per_row else 0.0

    @property
    def costs(self) -> Optional[RoundCosts]:
        if not self._per_round:
            return None
        return RoundCosts(self.per_row_s, statistics.median(self._per_round), self.rounds)
