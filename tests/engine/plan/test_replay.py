"""The fluid replay the makespan model runs (``engine/plan/replay.py``): max-min fair rates, lanes held
back by their releases, events taken together only ever late."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.engine.plan import LinkModel, makespan
from weightsync.engine.plan.replay import FluidReplay, max_min_rates
from weightsync.wire import SenderTable, Transfer
from plan_helpers import participant, tensor


@st.composite
def flows(draw):
    n_s, n_r = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n = draw(st.integers(1, 12))
    sport = np.array(draw(st.lists(st.integers(0, n_s - 1), min_size=n, max_size=n)))
    rport = np.array(draw(st.lists(st.integers(0, n_r - 1), min_size=n, max_size=n)))
    caps = st.sampled_from([1.0, 2.0, 3.0, 8.0])
    return sport, rport, np.array(draw(st.lists(caps, min_size=n_s, max_size=n_s))), \
        np.array(draw(st.lists(caps, min_size=n_r, max_size=n_r)))


@settings(max_examples=300, deadline=None)
@given(flows())
def test_max_min_rates_are_feasible_and_fair(case):
    """No port carries more than its capacity, and every flow has a full port on which no flow is
    faster (the definition of max-min fairness: no flow can grow without slowing one no faster)."""
    sport, rport, cap_s, cap_r = case
    rate = max_min_rates(sport, rport, cap_s, cap_r)
    load_s, load_r = np.bincount(sport, rate, len(cap_s)), np.bincount(rport, rate, len(cap_r))
    assert (load_s <= cap_s * (1 + 1e-9)).all() and (load_r <= cap_r * (1 + 1e-9)).all()
    for i in range(len(rate)):
        s_full = load_s[sport[i]] >= cap_s[sport[i]] * (1 - 1e-9) and rate[i] >= rate[sport == sport[i]].max() * (1 - 1e-9)
        r_full = load_r[rport[i]] >= cap_r[rport[i]] * (1 - 1e-9) and rate[i] >= rate[rport == rport[i]].max() * (1 - 1e-9)
        assert s_full or r_full, (i, rate)


@st.composite
def lanes(draw):
    sport, rport, cap_s, cap_r = draw(flows())
    transfers = [[(draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])), draw(st.integers(1, 8)))
                  for _ in range(draw(st.integers(1, 3)))] for _ in sport]
    return sport, rport, transfers, cap_s, cap_r


@settings(max_examples=200, deadline=None)
@given(lanes())
def test_events_taken_together_only_delay_the_round(case):
    """Taking events within a window together, at the latest of them, never ends the round before the
    exact replay does, nor more than a few windows after it; and no lane ends before its bytes could
    have crossed its busier port, nor before its last transfer is released."""
    sport, rport, transfers, cap_s, cap_r = case
    exact = FluidReplay(sport, rport, transfers, cap_s, cap_r)
    exact.window = 0.0
    want = exact.run()
    together = FluidReplay(sport, rport, transfers, cap_s, cap_r)
    together.window = 0.05
    got = together.run()
    assert want * (1 - 1e-9) <= got <= want + 4 * 0.05 * (1 + sum(map(len, transfers)))
    for s, r, items in zip(sport, rport, transfers):
        total = sum(n for _, n in items)
        assert want >= max(total / cap_s[s], total / cap_r[r], max(q for q, _ in items)) * (1 - 1e-9)


def _tables(lanes_of: dict[int, list[tuple[int, int, int]]]) -> dict[int, SenderTable]:
    """Each sender's table: its lanes' transfers ((receiver, count, bytes) writes) in that order."""
    out = {}
    for s, lanes_ in lanes_of.items():
        rows = [(r, k, n) for r, count, n in lanes_ for k in range(count)]
        out[s] = SenderTable(s, tuple(Transfer(i, "w", None, r, "w", 0, k * n, n, "")
                                      for i, (r, k, n) in enumerate(rows)), ())
    return out


def test_a_port_shares_its_bandwidth_between_lanes():
    """Receiver 0 takes 2 units from sender 2 and 1 from sender 1; sender 1 also owes receiver 1 one
    unit, whose other sender, 0, owes it 2 (the shape of Kimi-K2's FP8 round, where one sender serves
    two receivers that each also wait on a larger lane). Shared by bandwidth, sender 1's two lanes
    move at half its rate alongside the large ones and the round ends at the bound, 3 units, to the
    byte; ports that carry one transfer at a time in turn end there or later."""
    unit, writes = 64 << 20, 8
    link = LinkModel(net_bw=1e9, per_transfer_s=0.0)
    senders = [participant(s, [tensor("w", (1024, 1024))], host=f"s{s}") for s in range(3)]
    receivers = [participant(r, [tensor("w", (1024, 1024))], host=f"r{r}") for r in range(2)]
    small, large = (writes, unit // writes), (writes, 2 * unit // writes)
    tables = _tables({0: [(1, *large)], 1: [(0, *small), (1, *small)], 2: [(0, *large)]})
    bound = 3 * unit / link.net_bw
    assert makespan(tables, senders, receivers, link) == pytest.approx(bound, rel=1e-6)
    assert makespan(tables, senders, receivers, link, sharing="slots") >= bound * (1 - 1e-9)
    with pytest.raises(ValueError, match="sharing"):
        makespan(tables, senders, receivers, link, sharing="round-robin")
