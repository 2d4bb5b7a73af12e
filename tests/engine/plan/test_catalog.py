"""The admission catalog: members checked one at a time against what the joined ones hold."""

from __future__ import annotations

import random

import pytest

from weightsync.engine import errors
from weightsync.engine.plan import Catalog, build_pieces, plan
from weightsync.engine.plan.sources import Interned, index_sources
from plan_helpers import participant, tensor

EXPERTS = (8, 4)  # a fused expert tensor: 8 experts of 4 columns, split over EP ranks by rows


def _ep_sender(rank, n, cut=None, dtype="float32"):
    """Sender ``rank`` of ``n`` expert-parallel ranks: its own rows of the experts (``cut`` overrides
    them), an FSDP shard of the attention weight, and a replica of the norm."""
    lo, hi = cut or (8 * rank // n, 8 * (rank + 1) // n)
    attn = (8 * rank // n, 8 * (rank + 1) // n)
    return participant(rank, [tensor("experts", EXPERTS, dtype, shard=(0, lo, hi)),
                              tensor("attn", (8, 2), shard=(0, *attn), gatherable=True),
                              tensor("norm", (4,))], host=f"t{rank}")


def _receiver(rank, names=("experts", "attn", "norm"), dtype="float32"):
    shapes = {"experts": EXPERTS, "attn": (8, 2), "norm": (4,)}
    return participant(rank, [tensor(n, shapes[n], dtype if n == "experts" else "float32") for n in names],
                       host=f"i{rank}")


def _holdings(sources):
    """Every field a plan reads from the senders' sources, as plain values."""
    intern = Interned()
    return {name: (s.dtype, s.full_shape, sorted(s.full), s.replicas,
                   {k: sorted(v) for k, v in s.shards.items()}, {k: sorted(v) for k, v in s.gshards.items()},
                   {d: (starts, [(a, b, sorted(h)) for a, b, h in rows]) for d, (starts, rows) in s.cuts().items()},
                   s.full_cands(intern), s.spans(intern).rows)
            for name, s in sorted(sources.items())}


@pytest.mark.parametrize("seed", range(20))
def test_a_catalog_kept_through_joins_and_leaves_holds_what_a_fresh_index_would(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 5])
    pool = {r: _ep_sender(r, n) for r in range(n)}
    catalog, joined = Catalog(), {}
    for _ in range(30):
        rank = rng.randrange(n)
        if rank in joined and rng.random() < 0.5:
            del joined[rank]  # it left
        elif rank not in joined:
            joined[rank] = pool[rank].manifest
            if rng.random() < 0.5:  # admitted through the checks, or recorded by sync
                catalog.admit_sender(rank, joined[rank])
        catalog.sync(joined, {})
        fresh = index_sources([participant for r, participant in sorted(pool.items()) if r in joined])
        assert _holdings(catalog.sources) == _holdings(fresh)


@pytest.mark.parametrize("seed", range(10))
def test_what_a_catalog_lent_stays_as_it_was_while_members_join_and_leave(seed):
    """A planning thread reads what the catalog lent (``Catalog.lend``) while the event loop admits and
    releases members: the catalog copies a lent source before it changes it, so the lent index keeps
    the holdings of the senders of its time, and the catalog those of today's."""
    rng = random.Random(seed)
    n = rng.choice([3, 5])
    pool = {r: _ep_sender(r, n) for r in range(n)}
    catalog, joined, lent = Catalog(), {}, []
    for _ in range(30):
        rank = rng.randrange(n)
        if rank in joined:
            del joined[rank]
        else:
            joined[rank] = pool[rank].manifest
        catalog.sync(joined, {0: _receiver(0).manifest})
        if rng.random() < 0.3:
            index = catalog.lend()
            lent.append((index, _holdings(index.sources), dict(index.senders)))
        for index, holdings, senders in lent:
            assert _holdings(index.sources) == holdings and index.senders == senders
        fresh = index_sources([participant for r, participant in sorted(pool.items()) if r in joined])
        assert _holdings(catalog.sources) == _holdings(fresh)
    assert lent and catalog.copied > 0
    for index, _, senders in lent:  # a plan from what was lent is the plan from scratch of its senders
        members = [pool[r] for r in sorted(senders)]
        if members:
            assert _plan_or_error(members, index) == _plan_or_error(members, None)


def _plan_or_error(senders, index):
    try:
        return plan(senders, [_receiver(0)], index=index)
    except errors.PlanError as exc:  # (rows no sender of those holds)
        return str(exc)


def test_a_receiver_may_join_before_the_experts_holder_and_not_once_all_senders_are_in():
    catalog = Catalog()
    catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    catalog.admit_receiver(0, _receiver(0).manifest, senders_complete=False)  # rows 4:8 come with sender 1
    with pytest.raises(errors.Unsuppliable, match="rows 4:8"):  # the same, with every sender in
        catalog.admit_receiver(1, _receiver(1).manifest, senders_complete=True)
    catalog.admit_sender(1, _ep_sender(1, 2).manifest)
    catalog.admit_receiver(1, _receiver(1).manifest, senders_complete=True)
    assert sorted(catalog.receivers) == [0, 1]
    build_pieces([_ep_sender(r, 2) for r in range(2)], [_receiver(r) for r in range(2)])  # and it plans


def test_a_name_no_sender_has_waits_for_the_last_sender_too():
    catalog = Catalog()
    catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    stray = participant(0, [tensor("norm", (4,)), tensor("atn", (8, 2))]).manifest
    catalog.admit_receiver(0, stray, senders_complete=False)  # (a pipeline stage still to come may hold it)
    with pytest.raises(errors.UnknownParameter, match="closest: attn .parameter 'atn'"):
        catalog.admit_receiver(1, stray, senders_complete=True)


def test_senders_that_disagree_are_refused_naming_the_parameter_and_both_ranks():
    catalog = Catalog()
    catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    with pytest.raises(errors.ManifestMismatch, match="float32.*float16") as e:
        catalog.admit_sender(1, _ep_sender(1, 2, dtype="float16").manifest)
    assert e.value.param == "experts" and e.value.ranks == ("sender/0", "sender/1")
    with pytest.raises(errors.BadTiling, match=r"shards \[0:4\] and \[2:6\] overlap") as e:
        catalog.admit_sender(1, _ep_sender(1, 2, cut=(2, 6)).manifest)
    assert e.value.ranks == ("sender/1", "sender/0")
    across = participant(1, [tensor("experts", EXPERTS, shard=(1, 0, 2))]).manifest
    with pytest.raises(errors.BadTiling, match="along dim 1 where the others are cut along dim 0"):
        catalog.admit_sender(1, across)
    assert sorted(catalog.senders) == [0]  # nothing refused was recorded
    catalog.admit_sender(1, _ep_sender(0, 2).manifest)  # the same rows again: a replica, not an overlap
    assert catalog.sources["experts"].shards[(0, 0, 4)] == [0, 1]


def test_rows_freed_by_a_sender_that_left_may_be_taken_by_another():
    catalog = Catalog()
    catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    with pytest.raises(errors.BadTiling):
        catalog.admit_sender(1, _ep_sender(1, 2, cut=(2, 6)).manifest)
    catalog.sync({}, {})  # rank 0 left
    catalog.admit_sender(1, _ep_sender(1, 2, cut=(2, 6)).manifest)
    assert catalog.sources["experts"].shards == {(0, 2, 6): [1]} and catalog.sources["norm"].full == [1]


def test_a_sender_whose_new_name_a_joined_receiver_cannot_take_is_refused_and_not_recorded():
    catalog = Catalog()
    catalog.admit_receiver(0, _receiver(0, dtype="int32").manifest, senders_complete=False)  # no senders yet
    with pytest.raises(errors.ManifestMismatch, match="receiver cannot take what sender/0 holds") as e:
        catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    assert e.value.param == "experts" and e.value.ranks[:2] == ("sender/0", "receiver/0")
    assert not catalog.senders and not catalog.sources


def test_receivers_of_one_layout_are_resolved_once():
    catalog = Catalog()
    catalog.admit_sender(0, _ep_sender(0, 2).manifest)
    catalog.admit_receiver(0, _receiver(0).manifest, senders_complete=False)
    first = catalog.resolved
    catalog.admit_sender(1, _ep_sender(1, 2).manifest)  # no new name: what was checked still stands
    catalog.admit_receiver(1, _receiver(1).manifest, senders_complete=False)
    assert first == 3 and catalog.resolved == first
    for r in range(2, 6):  # every sender in: resolved once more, with rows and holders, then shared
        catalog.admit_receiver(r, _receiver(r).manifest, senders_complete=True)
    assert catalog.resolved == 2 * first
    assert repr(catalog) == "<Catalog senders=2 receivers=6 params=3 resolved=6 layouts=1 copied=0>"


def test_a_receiver_of_a_layout_checked_against_todays_senders_passes_as_it_did(monkeypatch):
    """A join is resolved once per layout while the senders stay: the next receiver of that layout (every
    instance's TP rank r) passes as the first did. Once a sender leaves or joins, it is resolved again."""
    resolved = []
    real = Catalog._resolve
    monkeypatch.setattr(Catalog, "_resolve", lambda self, absent_ok, receivers: (
        resolved.extend(rank for rank, _ in receivers), real(self, absent_ok, receivers))[-1])
    catalog = Catalog()
    senders = {r: _ep_sender(r, 2).manifest for r in range(2)}
    for r, manifest in senders.items():
        catalog.admit_sender(r, manifest)
    catalog.admit_receiver(0, _receiver(0).manifest, senders_complete=True)
    catalog.admit_receiver(1, _receiver(1).manifest, senders_complete=True)  # receiver 0's layout
    catalog.admit_receiver(2, _receiver(2, names=("experts", "attn")).manifest, senders_complete=True)  # another
    assert resolved == [0, 2] and catalog.layouts == {0: 0, 1: 0, 2: 1}
    catalog.sync({0: senders[0]}, catalog.receivers)  # sender 1 left, and comes back
    catalog.admit_sender(1, senders[1])
    catalog.admit_receiver(3, _receiver(3).manifest, senders_complete=True)
    assert resolved == [0, 2, 3]
    with pytest.raises(errors.PlanError):  # a layout not checked yet is still refused when it must be
        catalog.admit_receiver(4, _receiver(4, dtype="int32").manifest, senders_complete=True)
    assert 4 not in catalog.receivers and resolved == [0, 2, 3, 4]
