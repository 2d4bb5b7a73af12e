"""Where a cold plan's time goes: ``plan()``'s steps timed one by one, for one planner_scale scenario.

Question it answers: which stage to work on. It runs the steps ``planner._plan`` runs, in its order and
with its arguments, each timed in CPU seconds (the collector paused, as ``plan()`` pauses it): the
senders' index, the receivers' tensors resolved and expanded into rows, the gatherers designated, the
pieces made and cut into streams, locality, the schedule (its forced streams placed, apart), levelling,
the lanes spread
and the tables. ``--plans`` plans in one process; the first pays for what a process does once. The
tables are checked against ``plan()``'s own (the same digest as ``planner_compare.py``), so the steps
timed are the plan's.

    .venv/bin/python bench/diagnostics/planner_stages.py --only "kimi-k2 1024->512" --plans 2
    .venv/bin/python bench/diagnostics/planner_stages.py --only "kimi-k2 1024->512" --catalog

``--catalog``: as the controller plans, from the index its ``Catalog`` kept as the members joined
(``Catalog.lend``; the joins are not timed): the index step is the lend, and each receiver layout is
resolved once by the number the catalog gave it.

Prints one JSON line per plan, then a table (rich).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(HERE / "bench"), str(HERE / "bench" / "diagnostics"), str(HERE)]

import planner_scale as ps  # noqa: E402
from planner_compare import digest  # noqa: E402

from weightsync.engine.plan import LinkModel, PlanCache, PlanOptions, plan  # noqa: E402
from weightsync.engine.plan.needs import Resolver, sources_of  # noqa: E402
from weightsync.engine.plan.planner import group_by_locality, tables_for  # noqa: E402
from weightsync.engine.plan.levelling import balance, spread  # noqa: E402
from weightsync.engine.plan.schedule import _ClassSchedule, schedule  # noqa: E402


def stages(senders, receivers, link: LinkModel, options: PlanOptions, catalog=None) -> tuple[dict[str, float], object]:
    """One plan from scratch (or from ``catalog``'s index), step by step as ``planner._plan`` takes them
    (senders and receivers in rank order): CPU seconds per step, and the tables."""
    took: dict[str, float] = {}
    t = time.process_time()

    def lap(name: str) -> None:
        nonlocal t
        now = time.process_time()
        took[name] = round(now - t, 3)
        t = now

    groups, streams, kept = streams_by_class(senders, receivers, link, options, lap, catalog)
    sched = schedule(groups, link, options)
    lap("schedule")
    if options.level:
        balance(sched, link, options)
    lap("levelling")
    if options.spread:
        spread(sched, link)
    lap("spread")
    routing = tables_for(sched, senders, receivers, 0, streams, link, options)
    lap("tables")
    del kept  # (freed after the clock stops: a PlanCache keeps the index, as the bench's plans keep it)
    return took, routing


def streams_by_class(senders, receivers, link: LinkModel, options: PlanOptions, lap=lambda name: None,
                     catalog=None):
    """``plan()``'s steps up to locality: the streams by link class that the schedule takes, and what
    made them (the index, the expanded rows), to be freed by the caller when its clock is off."""
    index = catalog.lend() if catalog is not None else None
    resolver = Resolver(sources_of(senders, index))
    lap("index")
    expanded = resolver.expanded(((p.rank, p.manifest) for p in receivers), index.layout_of if index else None)
    lap("resolve + expand")
    narrowed = expanded.designate(resolver.sources, len(senders), resolver.intern)
    lap("gatherers")
    pieces, streams = expanded.streams(narrowed, resolver.sources, resolver.intern)
    lap("pieces + streams")
    groups = group_by_locality(pieces, senders, receivers, options.prefer_locality, link, streams)
    lap("locality")
    return groups, streams, (resolver, expanded)


def forced_seconds(groups, link: LinkModel, options: PlanOptions) -> tuple[float, float]:
    """CPU seconds of the schedule's set-up (streams sorted into forced and flexible) and of its forced
    placement alone (on fresh streams: placing forced work cuts the streams' pieces)."""
    t0 = time.process_time()
    ones = [_ClassSchedule(cls, groups[cls], link, options) for cls in sorted(groups)]
    t1 = time.process_time()
    for one in ones:
        one._place_forced()
    return round(t1 - t0, 3), round(time.process_time() - t1, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="kimi-k2 256->128 tp8+ep128 fp8",
                    help="the scenario of this name, else the first whose name contains this")
    ap.add_argument("--plans", type=int, default=2, help="plans in this process, each timed")
    ap.add_argument("--catalog", action="store_true", help="plan from the index a Catalog kept as members joined")
    args = ap.parse_args(argv)
    scenarios = ps.SCENARIOS + ps.LARGE
    name, arch, layout, n_recv, tp, ep, colocated, *fp8 = next(  # (an exact name first)
        s for s in sorted(scenarios, key=lambda s: s[0] != args.only) if args.only in s[0])
    senders, receivers, _ = ps.participants(arch, layout, n_recv, tp, ep, colocated, bool(fp8 and fp8[0]))
    senders, receivers = sorted(senders, key=lambda p: p.rank), sorted(receivers, key=lambda p: p.rank)
    link, options = LinkModel(net_bw=400e9 / 8, per_transfer_s=2e-6), PlanOptions()
    want = digest(plan(senders, receivers, link, options, cache=PlanCache()))
    catalog = ps.joined(senders, receivers)[0] if args.catalog else None
    rows = []
    for i in range(args.plans):
        gc.collect()
        gc.disable()
        try:
            took, routing = stages(senders, receivers, link, options, catalog)
            same = digest(routing) == want
            del routing
            setup, forced = forced_seconds(streams_by_class(senders, receivers, link, options, catalog=catalog)[0],
                                           link, options)
        finally:
            gc.enable()
        row = {"scenario": name, "plan": i + 1, **took, "total": round(sum(took.values()), 3),
               "schedule set-up": setup, "forced placement": forced, "same tables as plan()": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
    from rich.console import Console
    from rich.table import Table

    table = Table(*rows[0])
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    Console(stderr=True, width=200).print(table)
    return 0 if all(r["same tables as plan()"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
