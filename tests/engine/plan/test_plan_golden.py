"""Golden tables: what the planner makes for a few small jobs of real architectures, as a digest of
every sender's transfers and every receiver's entries (``bench/diagnostics/planner_compare.digest``),
against the digests in tests/golden/plans.json.

The planner is deterministic, and most changes to it are meant to make the same tables faster: this
fails on any change of any table, where the other planner tests check properties a wrong table could
still have. The jobs take every path: FSDP trainers with and without EP, gatherers designated where the
gathers do not fit (``expand.Expanded.designate``), flexible streams through the list schedule,
block FP8 receivers with their scales, and a colocated job spread over local, NVLink and network ports.
After a change that is meant to change tables, regenerate (and say why in the commit):

    .venv/bin/python tests/engine/plan/test_plan_golden.py --regen
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden" / "plans.json"
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "bench" / "diagnostics")]

import planner_scale as ps  # noqa: E402
from planner_compare import digest  # noqa: E402

from weightsync.engine.plan import Catalog, LinkModel, PlanCache, PlanOptions, build_pieces, plan  # noqa: E402
from weightsync.engine.plan.needs import Resolver, index_sources  # noqa: E402
from weightsync.engine.plan.trainer import TrainerLayout  # noqa: E402

# name -> (arch, decoder layers, trainer layout, receivers, inference TP, EP, colocated, fp8)
JOBS = {
    "kimi-k2 3 layers 32->16 tp8": ("kimi-k2", 3, TrainerLayout(32), 16, 8, 1, False, False),
    "kimi-k2 3 layers 32->16 tp8+ep16 fp8": ("kimi-k2", 3, TrainerLayout(32), 16, 8, 16, False, True),
    "kimi-k2 3 layers 24->16 ep24 (uneven) tp8+ep16": ("kimi-k2", 3, TrainerLayout(24, ep=24), 16, 8, 16, False, False),
    "qwen3-235b 2 layers 16->8 pp2+ep8 tp4+ep4": ("qwen3-235b-a22b", 2, TrainerLayout(16, pp=2, ep=8), 8, 4, 4, False, False),
    "qwen2.5-7b 2 layers 16->16 colocated": ("qwen2.5-7b", 2, TrainerLayout(16), 16, 1, 1, True, False),
}
LINK = LinkModel(net_bw=400e9 / 8, per_transfer_s=2e-6)


def participants(arch, layers, layout, n_recv, tp, ep, colocated, fp8):
    senders, receivers, _ = ps.participants(arch, layout, n_recv, tp, ep, colocated, fp8, layers=layers)
    return senders, receivers


def tables_of(name: str) -> dict:
    senders, receivers = participants(*JOBS[name])
    routing = plan(senders, receivers, LINK, PlanOptions(), cache=PlanCache())
    return {"transfers": routing.transfer_count, "tables": digest(routing)}


def _stored() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_tables_are_the_golden_ones(name):
    want = _stored().get(name)
    assert want is not None, f"no golden tables for {name!r}: regenerate ({__doc__.splitlines()[-1].strip()})"
    assert tables_of(name) == want


def test_the_jobs_designate_gatherers_and_cut_pieces():
    """The jobs reach what the golden tables are there to hold still: gatherers designated (the
    gathers of a tp8 job from FSDP do not fit) and pieces cut (the colocated job makes more transfers
    than pieces: spread over its classes, taken in chunks)."""
    senders, receivers = participants(*JOBS["kimi-k2 3 layers 32->16 tp8"])
    resolver = Resolver(index_sources(senders))
    expanded = resolver.expanded((p.rank, p.manifest) for p in receivers)
    assert expanded.designate(resolver.sources, len(senders), resolver.intern)
    senders, receivers = participants(*JOBS["qwen2.5-7b 2 layers 16->16 colocated"])
    pieces, _ = build_pieces(senders, receivers)
    assert tables_of("qwen2.5-7b 2 layers 16->16 colocated")["transfers"] > len(pieces)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_a_plan_from_the_index_a_catalog_kept_is_the_golden_one(name):
    """The controller plans from what its ``Catalog`` kept as members joined (``Catalog.lend``): the
    senders' sources and the receivers' layout numbers. Members join in any order, so the catalog's
    holder lists are in join order; the tables are the golden ones all the same."""
    senders, receivers = participants(*JOBS[name])
    catalog = Catalog()
    order = random.Random(name).sample([*senders, *receivers], len(senders) + len(receivers))
    for p in order:
        if p in senders:
            catalog.admit_sender(p.rank, p.manifest)
        else:
            catalog.admit_receiver(p.rank, p.manifest, senders_complete=len(catalog.senders) == len(senders))
    cache = PlanCache()
    routing = plan(senders, receivers, LINK, PlanOptions(), cache=cache, index=catalog.lend())
    assert digest(routing) == _stored()[name]["tables"]
    assert cache._resolver.sources is catalog.sources  # (no sender tensor indexed again)
    others = [*senders[:-1], ps.Participant(senders[-1].rank, senders[-1].manifest, senders[-1].transport)]
    routing = plan(others, receivers, LINK, PlanOptions(), cache=PlanCache(), index=catalog.lend())
    assert digest(routing) == _stored()[name]["tables"]  # (the same tensors: the catalog's index is used)
    fresh = participants(*JOBS[name])[0]  # equal manifests, but not those the catalog holds: indexed afresh
    cache = PlanCache()
    assert digest(plan(fresh, receivers, LINK, PlanOptions(), cache=cache, index=catalog.lend())) == \
        _stored()[name]["tables"]
    assert cache._resolver.sources is not catalog.sources


@pytest.mark.parametrize("name", ["kimi-k2 3 layers 32->16 tp8", "kimi-k2 3 layers 32->16 tp8+ep16 fp8",
                                  "qwen2.5-7b 2 layers 16->16 colocated"])
@pytest.mark.parametrize("from_catalog", [False, True])
def test_the_stage_timer_takes_the_plans_own_steps(name, from_catalog):
    """``bench/diagnostics/planner_stages.py`` times ``plan()``'s steps by calling them one by one (from
    scratch, or from a catalog's index): its tables must be the golden ones, or it would be timing
    something else."""
    import planner_stages

    senders, receivers = (sorted(g, key=lambda p: p.rank) for g in participants(*JOBS[name]))
    catalog = ps.joined(senders, receivers)[0] if from_catalog else None
    took, routing = planner_stages.stages(senders, receivers, LINK, PlanOptions(), catalog)
    assert digest(routing) == _stored()[name]["tables"]
    assert set(took) == {"index", "resolve + expand", "gatherers", "pieces + streams", "locality", "schedule",
                         "levelling", "spread", "tables"}


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        raise SystemExit(__doc__)
    GOLDEN.write_text(json.dumps({name: tables_of(name) for name in sorted(JOBS)}, indent=1) + "\n")
    print(GOLDEN.read_text())
