"""Routing tables from an assignment: each sender's transfers in order, mirrored into the receivers'
entries sorted by (region, offset) with a tie in (sender, index) order (``engine/plan/tables.py``)."""

from __future__ import annotations

import random

import pytest

from plan_helpers import participant, tensor
from weightsync.engine.plan import Piece, tables_from_assignment
from weightsync.wire import ExpectedEntry, Slice


def _piece(receiver, name, region, offset, nbytes=8):
    return Piece(receiver, name, name, Slice(0, 0, 1), nbytes, region, offset, nbytes, "", (0,))


def _reference(assignment, ranks):
    """Each receiver's entries the plain way: a row per transfer, sorted by (region, offset), a tie in
    (sender, index) order."""
    rows = {r: [] for r in ranks}
    for s in sorted(assignment):
        for i, p in enumerate(assignment[s]):
            rows[p.receiver].append(((p.region, p.offset), ExpectedEntry(p.dst_name, s, i, p.slice, p.region, p.offset,
                                                                        p.nbytes, p.transform)))
    return {r: tuple(e for _, e in sorted(got, key=lambda kv: kv[0])) for r, got in rows.items()}


def test_receiver_entries_are_sorted_by_region_and_offset_and_a_tie_keeps_sender_and_index_order():
    rng = random.Random(7)
    senders = [participant(s, [tensor("w", (4,))], host=f"t{s}") for s in range(3)]
    receivers = [participant(r, [tensor("w", (4,))], host=f"i{r}") for r in range(4)]  # receiver 3 gets nothing
    assignment = {s: [_piece(rng.randrange(3), f"p{s}.{i}", rng.randrange(2), rng.randrange(6) * 8)  # ties abound
                      for i in range(40)] for s in range(3)}
    routing = tables_from_assignment(assignment, senders, receivers)
    want = _reference(assignment, range(4))
    for r in range(4):
        assert tuple(routing.receivers[r].entries) == want[r]
    assert len(routing.receivers[3].entries) == 0
    for s, pieces in assignment.items():
        t = routing.senders[s]
        assert [(x.index, x.name, x.dst_rank, x.dst_offset) for x in t.transfers] == [
            (i, p.src_name, p.receiver, p.offset) for i, p in enumerate(pieces)]
        assert [p.rank for p in t.peers] == sorted({p.receiver for p in pieces})


def test_a_piece_for_a_receiver_not_planned_for_names_it_and_its_sender():
    senders = [participant(0, [tensor("w", (4,))], host="t0")]
    receivers = [participant(0, [tensor("w", (4,))], host="i0")]
    with pytest.raises(KeyError, match=r"sender/0 .* receivers \[5\]"):
        tables_from_assignment({0: [_piece(5, "w", 0, 0)]}, senders, receivers)


def test_no_transfers_at_all_give_empty_tables():
    senders = [participant(0, [tensor("w", (4,))], host="t0")]
    receivers = [participant(r, [tensor("w", (4,))], host=f"i{r}") for r in range(2)]
    routing = tables_from_assignment({}, senders, receivers)
    assert routing.transfer_count == 0 and all(len(t.entries) == 0 for t in routing.receivers.values())


def test_a_gatherers_pieces_take_their_place_in_its_table_when_it_has_gathered_them():
    """``build_tables`` with ``gathers`` (when each designated sender has each parameter it gathers, in
    the schedule's seconds): sender 0's pieces of what it gathers take their place at that time (small
    at 2.5, after what starts sooner; big at 24, last), the others at their start, each kept in
    schedule order at a tie; sender 1 gathers nothing and keeps the schedule's order."""
    from weightsync.engine.plan import LinkClass, LinkModel
    from weightsync.engine.plan.work import Schedule, Segment
    from weightsync.engine.plan.tables import build_tables

    def seg(sender, receiver, name, start):
        piece = Piece(receiver, name, name, None, 64, 0, 64 * start, 0, "", (0, 1))
        g = Segment(receiver, LinkClass.NET, [piece], sender, 64, frozenset({0, 1}))
        g.start = float(start)
        return g

    order = [("big", 0), ("ready", 1), ("small", 2), ("big", 3), ("ready", 4), ("small", 5)]
    segments = [seg(s, 0, name, t) for s in (0, 1) for name, t in order]
    link = LinkModel(net_bw=1e9)
    senders = [participant(s, [tensor(n, (64,), "uint8") for n in ("big", "small", "ready")]) for s in (0, 1)]
    receivers = [participant(0, [tensor(n, (64,), "uint8") for n in ("big", "small", "ready")])]
    routing = build_tables(Schedule.of(segments, link), senders, receivers, 0, {(0, "small"): 2.5, (0, "big"): 24.0})
    taken = {s: [(t.name, t.dst_offset // 64) for t in table.transfers] for s, table in routing.senders.items()}
    assert taken[0] == [("ready", 1), ("small", 2), ("small", 5), ("ready", 4), ("big", 0), ("big", 3)]
    assert taken[1] == order


def test_pieces_of_gathers_the_schedule_chose_take_their_place_when_their_window_ends():
    """``build_tables`` with ``undesignated`` (parameters whose gatherers the schedule chose, with their
    gather pieces' candidates) and a ``timer``: the timer is asked once, for exactly the (sender, name)
    pairs whose gather pieces the schedule gave that sender, and those pieces take their place at the
    time it says; a piece of the same parameter with other candidates (its sender's own rows, no
    gather) keeps its start."""
    from weightsync.engine.plan import LinkClass, LinkModel
    from weightsync.engine.plan.work import Schedule, Segment
    from weightsync.engine.plan.tables import build_tables

    full, own = (0, 1), (0,)

    def seg(sender, name, start, cands):
        piece = Piece(0, name, name, None, 64, 0, 64 * start, 0, "", cands)
        g = Segment(0, LinkClass.NET, [piece], sender, 64, frozenset(cands))
        g.start = float(start)
        return g

    segments = [seg(0, "w", 0, full), seg(0, "ready", 1, own), seg(0, "w", 2, own), seg(1, "w", 3, full),
                seg(1, "ready", 4, full)]
    asked = []

    def timer(pairs):
        asked.append(pairs)
        return {(0, "w"): 5.0, (1, "w"): 1.0}

    senders = [participant(s, [tensor(n, (64,), "uint8") for n in ("w", "ready")]) for s in (0, 1)]
    receivers = [participant(0, [tensor(n, (64,), "uint8") for n in ("w", "ready")])]
    routing = build_tables(Schedule.of(segments, LinkModel(net_bw=1e9)), senders, receivers, 0, {}, {"w": full}, timer)
    taken = {s: [(t.name, t.dst_offset // 64) for t in table.transfers] for s, table in routing.senders.items()}
    assert asked == [[(0, "w"), (1, "w")]]
    assert taken[0] == [("ready", 1), ("w", 2), ("w", 0)]  # the gathered piece at 5; its own rows at 2
    assert taken[1] == [("w", 3), ("ready", 4)]  # gathered at 1: before its start (3), so where it was
