"""Pieces made from columns (``engine/plan/expand.py``): the streams the schedule starts from are the
pieces grouped by receiver and candidate tuple, in order, and the designated candidates replace the full
holders in exactly the pieces that had them; the schedule makes the same work from those streams as
columns as from the pieces grouped by dicts."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "bench")]

import planner_scale as ps  # noqa: E402

from weightsync.engine.plan import LinkModel, PlanOptions, build_pieces  # noqa: E402
from weightsync.engine.plan.needs import Resolver, build_streams, index_sources  # noqa: E402
from weightsync.engine.plan.planner import _cut, group_by_locality  # noqa: E402
from weightsync.engine.plan.schedule import schedule  # noqa: E402
from weightsync.engine.plan.sources import Streams  # noqa: E402
from weightsync.engine.plan.trainer import TrainerLayout  # noqa: E402

JOBS = {  # (arch, layers, trainer layout, receivers, TP, EP, colocated, fp8), as in test_plan_golden
    "kimi-k2 tp8 designated": ("kimi-k2", 2, TrainerLayout(32), 16, 8, 1, False, False),
    "kimi-k2 tp8+ep16 fp8": ("kimi-k2", 2, TrainerLayout(32), 16, 8, 16, False, True),
    "qwen2.5-7b colocated": ("qwen2.5-7b", 2, TrainerLayout(16), 16, 1, 1, True, False),
}


def _job(name):
    arch, layers, layout, n_recv, tp, ep, colocated, fp8 = JOBS[name]
    senders, receivers, _ = ps.participants(arch, layout, n_recv, tp, ep, colocated, fp8, layers=layers)
    return senders, receivers


@pytest.mark.parametrize("name", sorted(JOBS))
def test_streams_are_the_pieces_by_receiver_and_candidates_in_order(name):
    senders, receivers = _job(name)
    pieces, streams = build_streams(senders, receivers)
    raw: dict = {}
    _cut(build_pieces(senders, receivers)[0], raw)
    want = [same for by_cands in raw.values() for same in by_cands.values()]
    lists = streams.lists()
    assert lists == want and pieces == [p for same in want for p in same]  # (the pieces made in the streams' order)
    assert len(streams) > len(receivers)  # (more than one candidate tuple per receiver)
    # each stream's columns are read off its pieces: receiver, candidate tuple (the same object), bytes
    assert streams.receiver.tolist() == [same[0].receiver for same in lists]
    assert all(streams.tuples[k] is same[0].cands for k, same in zip(streams.key.tolist(), lists))
    assert streams.nbytes.tolist() == [sum(p.nbytes for p in same) for same in lists]


def test_designated_candidates_replace_the_full_holders_only():
    """The tp8 job's gathers do not fit: its gather-only pieces go to their designated holders, and every
    other piece keeps the candidates its template had."""
    senders, receivers = _job("kimi-k2 tp8 designated")
    resolver = Resolver(index_sources(senders))
    expanded = resolver.expanded((p.rank, p.manifest) for p in receivers)
    narrowed = expanded.designate(resolver.sources, len(senders), resolver.intern)
    assert narrowed
    before, after = expanded.pieces(), expanded.pieces(narrowed)
    swapped = 0
    for a, b in zip(before, after, strict=True):
        assert a[:9] == b[:9]
        pair = narrowed.get(a.src_name)
        if pair is not None and a.cands is pair[0]:
            assert b.cands is pair[1] and set(b.cands) < set(a.cands)
            swapped += 1
        else:
            assert b.cands is a.cands
    assert swapped > 0


def test_positions_and_distinct_counts_agree_with_sorting():
    """``_positions`` counts changes where values never decrease (a plan's receiver column) and sorts
    otherwise; ``_distinct`` marks a table of pairs where it is small and sorts pairs otherwise: both
    ways give ``numpy.unique``'s answers."""
    import numpy as np

    from weightsync.engine.plan.expand import _distinct, _positions

    rng = np.random.default_rng(7)
    for values in (np.sort(rng.integers(0, 50, 400)), rng.integers(0, 50, 400), np.zeros(0, np.int64)):
        want = np.unique(values, return_inverse=True)[1].reshape(-1)
        assert np.array_equal(_positions(values), want)
    a, b = rng.integers(0, 30, 2000), rng.integers(0, 40, 2000)
    want = np.array([len(set(b[a == i].tolist())) for i in range(30)])
    assert np.array_equal(_distinct(a, b, 30, 40), want)
    assert np.array_equal(_distinct(a, b * (1 << 22), 30, 40 << 22), want)  # (too large a table: by sorting)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_schedule_of_the_streams_as_columns_is_that_of_the_grouped_pieces(name):
    """Where no receiver has a sender on its host the streams go to the schedule as columns; the
    schedule splits them into forced and flexible by indexing. It makes the same runs, segments and
    port times as from the same pieces grouped by receiver and candidate tuple in dicts (the path
    every other layout takes), with or without a locality preference."""
    senders, receivers = _job(name)
    link, options = LinkModel(net_bw=50e9, per_transfer_s=2e-6), PlanOptions()
    for prefer in (False, True):
        pieces, streams = build_streams(senders, receivers)
        columns = group_by_locality(pieces, senders, receivers, prefer, link, streams)
        dicts = group_by_locality(pieces, senders, receivers, prefer, link)
        assert any(isinstance(g, Streams) for g in columns.values()) == (prefer is False or "colocated" not in name)
        got, want = schedule(columns, link, options), schedule(dicts, link, options)
        assert [(r.start.tolist(), r.receiver.tolist(), r.sender.tolist(), r.pieces) for r in got.forced] == \
            [(r.start.tolist(), r.receiver.tolist(), r.sender.tolist(), r.pieces) for r in want.forced]
        assert [(g.sender, g.receiver, g.pieces, g.start) for g in got.segments] == \
            [(g.sender, g.receiver, g.pieces, g.start) for g in want.segments]
        assert (got.sending, got.receiving) == (want.sending, want.receiving)


def test_each_designated_sender_gathers_shortest_first():
    """``gather_queues``: a designated sender pulls its parameters shortest first, each the full tensor
    less its own shard: when it has each, as the bytes pulled by then."""
    from weightsync.engine.plan.expand import gather_queues
    from weightsync.engine.plan.sources import Interned, Source

    big, small = Source("big", "bfloat16", (8, 4)), Source("small", "bfloat16", (4, 4))
    for r in range(4):  # FSDP: big's 64 bytes as 16 a rank, small's 32 as 8
        big.hold(r, (0, 2 * r, 2 * r + 2), True)
        small.hold(r, (0, r, r + 1), True)
    narrowed = {"big": (tuple(range(4)), (0, 1)), "small": (tuple(range(4)), (1, 2))}
    got, pulls = gather_queues(narrowed, {"big": big, "small": small}, Interned())
    assert got == {(0, "big"): 48, (1, "small"): 24, (1, "big"): 24 + 48, (2, "small"): 24}  # (1: small, then big)
    assert pulls == {(0, "big"): 48, (1, "small"): 24, (1, "big"): 48, (2, "small"): 24}  # (each pull alone)


def test_a_sender_whose_gathers_all_end_late_also_takes_a_shorter_one():
    """``_early_work``: the holders designated only for the longest gather (their ports idle until it
    is done) each also gather the parameter with a shorter gather that several holders share, if they
    hold it; a sender with a short gather already, and one that does not hold it, stay as they are."""
    from weightsync.engine.plan.expand import _early_work
    from weightsync.engine.plan.sources import Interned

    everyone = tuple(range(6))
    narrowed = {"long": (everyone, (0, 1, 2)), "short": ((0, 1, 3, 4, 5), (3, 4)), "tiny": (everyone, (5,))}
    intern = Interned()
    _early_work(narrowed, {"long": 100, "short": 50, "tiny": 1}, {"long": 300, "short": 200, "tiny": 1}, {}, 0, intern)
    assert narrowed == {"long": (everyone, (0, 1, 2)), "short": ((0, 1, 3, 4, 5), (0, 1, 3, 4)), "tiny": (everyone, (5,))}
    assert narrowed["short"][1] is intern[(0, 1, 3, 4)]  # (interned: pieces compare candidates by identity)
