"""Does a planner change make plans faster, and are its tables the same? This tree against another
checkout, paired.

Question it answers: plan time on the shared 2-core machine moves by 20-60% from one run to the next,
so a change to the planner is judged against its base only side by side: this script plans each
``bench/planner_scale.py`` scenario in this tree and in ``--against`` (another checkout, e.g. ``git
worktree add /tmp/base main``), alternating the two trees ``--rounds`` times, each round a fresh
process per tree making ``--plans`` cold plans (CPU seconds of ``plan()``, as the bench measures
them). It prints per scenario each tree's median, their ratio and each round's ratio, and whether
the two trees made the same tables (a digest of every sender's transfers and receiver's entries).
Where the machine is so busy that even paired rounds disagree, ``--instructions`` counts what one
cold plan executes in each tree under callgrind (valgrind; counting only inside ``plan()``, both trees
at once, a few minutes per Kimi-K2 scenario): a count that does not move with the machine's load,
though memory stalls, which it does not see, are part of the time.

    .venv/bin/python bench/diagnostics/planner_compare.py --against /tmp/base
    .venv/bin/python bench/diagnostics/planner_compare.py --against /tmp/base --only "1024->512" --rounds 2 --plans 1
    .venv/bin/python bench/diagnostics/planner_compare.py --against /tmp/base --only "256->128" --instructions

Prints one JSON line per scenario, then a table (rich).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parents[2]


def worker(root: str, which: str, plans: int, instructions: bool = False) -> None:
    """In a fresh process: ``plans`` cold plans of the scenario named ``which`` with ``root``'s planner.
    ``instructions``: under callgrind, which counts only while the plan runs (the collector off
    throughout, so no pass it would set off afterwards is counted)."""
    import gc
    import time

    sys.path[:0] = [root + "/bench", root]
    import planner_scale as ps
    import weightsync
    from weightsync.engine.plan import LinkModel, PlanCache, PlanOptions, plan

    if not weightsync.__file__.startswith(root):
        raise SystemExit(f"imported weightsync from {weightsync.__file__}, not from {root}")
    _, arch, layout, n_recv, tp, ep, colocated, *fp8 = next(s for s in ps.SCENARIOS + ps.LARGE if s[0] == which)
    if hasattr(ps, "participants"):
        senders, receivers, _ = ps.participants(arch, layout, n_recv, tp, ep, colocated, bool(fp8 and fp8[0]))
    else:  # (a base from before ``participants``)
        from weightsync.engine.models.shapes import state_dict_shapes
        from weightsync.engine.plan import Participant

        params, where = state_dict_shapes(arch), "train" if colocated else "infer"
        senders = [Participant(r, ps.sender_manifest(params, r, layout), ps._transport("train", r))
                   for r in range(layout.world)]
        receivers = [Participant(r, ps.receiver_manifest(params, r, tp, ep, bool(fp8 and fp8[0])),
                                 ps._transport(where, r)) for r in range(n_recv)]
    for p in (*senders, *receivers):  # both trees plan manifests checked as decoding checks them (names
        p.manifest._check()  # hashed), whether or not their bench's ``participants`` did
    link = LinkModel(net_bw=400e9 / 8, per_transfer_s=2e-6)
    seconds, routing = [], None
    for _ in range(plans):
        routing = None
        gc.collect()
        if instructions:
            gc.disable()
            _count("on")
        t0 = time.process_time()
        routing = plan(senders, receivers, link, PlanOptions(), cache=PlanCache())
        seconds.append(time.process_time() - t0)
        if instructions:
            _count("off")
            gc.enable()
    print(json.dumps({"seconds": seconds, "tables": digest(routing)}))


def _count(state: str) -> None:
    """Callgrind's counting on or off in this process (it waits for callgrind to confirm)."""
    import os

    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def counted(root: str, which: str) -> subprocess.Popen:
    """One cold plan under callgrind, counting the instructions of ``plan()`` alone (``instructions``)."""
    return subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                             sys.executable, __file__, "--worker", root, which, "1", "--instructions"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def instructions(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the counted plan failed:\n{err[-2000:]}")
    found = re.search(r"Collected : (\d+)", err)
    if found is None:
        raise SystemExit(f"callgrind reported no count:\n{err[-2000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "instructions": int(found.group(1))}


def digest(routing) -> str:
    """The tables' rows, sender by sender and receiver by receiver, hashed."""
    h = hashlib.sha256()
    for rank, table in sorted(routing.senders.items()):
        h.update(repr((rank, tuple(table.transfers), [p.rank for p in table.peers])).encode())
    for rank, table in sorted(routing.receivers.items()):
        h.update(repr((rank, tuple(table.entries))).encode())
    return h.hexdigest()[:16]


def run(root: str, which: str, plans: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", root, which, str(plans)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="the other checkout (its root)")
    ap.add_argument("--only", default="kimi-k2 256->128", help="scenarios whose name contains this")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two trees")
    ap.add_argument("--plans", type=int, default=3, help="cold plans per process")
    ap.add_argument("--instructions", action="store_true",
                    help="count the instructions of one plan per tree under callgrind (valgrind) instead of timing")
    ap.add_argument("--worker", nargs=3, metavar=("ROOT", "SCENARIO", "PLANS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args.instructions)
        return 0
    if not args.against:
        ap.error("--against is required")
    sys.path.insert(0, str(HERE / "bench"))
    import planner_scale as ps

    trees = {"this": str(HERE), "base": str(pathlib.Path(args.against).resolve())}
    if args.instructions:
        return compare_instructions(trees, [s[0] for s in ps.SCENARIOS + ps.LARGE if args.only in s[0]])
    rows = []
    for scenario in ps.SCENARIOS + ps.LARGE:
        if args.only not in scenario[0]:
            continue
        got: dict[str, list[dict]] = {"this": [], "base": []}
        for i in range(args.rounds):
            for label in (("base", "this") if i % 2 else ("this", "base")):  # (alternating which goes first)
                got[label].append(run(trees[label], scenario[0], args.plans))
        med = {k: statistics.median(s for r in v for s in r["seconds"]) for k, v in got.items()}
        row = {"scenario": scenario[0], "this_s": round(med["this"], 3), "base_s": round(med["base"], 3),
               "this_over_base": round(med["this"] / med["base"], 3),
               "rounds_this_over_base": [round(statistics.median(a["seconds"]) / statistics.median(b["seconds"]), 3)
                                         for a, b in zip(got["this"], got["base"])],
               "same_tables": got["this"][0]["tables"] == got["base"][0]["tables"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    from rich.console import Console
    from rich.table import Table

    table = Table("scenario", "this (s)", "base (s)", "this / base", "each round", "same tables")
    for r in rows:
        table.add_row(r["scenario"], str(r["this_s"]), str(r["base_s"]), str(r["this_over_base"]),
                      " ".join(map(str, r["rounds_this_over_base"])), "yes" if r["same_tables"] else "NO")
    Console(stderr=True, width=140).print(table)
    return 0


def compare_instructions(trees: dict[str, str], scenarios: list[str]) -> int:
    """Per scenario, the two trees' instruction counts for one cold plan, counted at once (a count does
    not depend on what else the machine runs), their ratio, and whether the tables are the same."""
    from rich.console import Console
    from rich.table import Table

    table = Table("scenario", "this (10^9 instructions)", "base", "this / base", "same tables")
    for which in scenarios:
        procs = {label: counted(root, which) for label, root in trees.items()}
        got = {label: instructions(proc) for label, proc in procs.items()}
        row = {"scenario": which, "this_instructions": got["this"]["instructions"],
               "base_instructions": got["base"]["instructions"],
               "this_over_base": round(got["this"]["instructions"] / got["base"]["instructions"], 4),
               "same_tables": got["this"]["tables"] == got["base"]["tables"]}
        print(json.dumps(row), flush=True)
        table.add_row(which, f"{row['this_instructions'] / 1e9:.3f}", f"{row['base_instructions'] / 1e9:.3f}",
                      str(row["this_over_base"]), "yes" if row["same_tables"] else "NO")
    Console(stderr=True, width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
