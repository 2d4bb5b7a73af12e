"""Levelling and spreading on random instances: the same plan with and without each, in the model.

Levelling (``levelling.balance``) moves flexible work off a sender port that would be the bottleneck;
spreading (``levelling.spread``) moves a receiver's second flexible segment from one sender to a
candidate with less for it. Each lowers something the round depends on, and the lane replay
(``model.makespan``) says whether the round ends sooner. This runs seeded random instances of two
sizes (replicated tensors on random subsets of senders, random needs per receiver, senders and
receivers on different hosts) and prints one JSON line per step and size: how many rounds end
sooner, later, the same, and the geometric mean, best and worst of with over without (levelling
with spreading off in both; spreading with levelling on in both).

    .venv/bin/python bench/planner_levelling.py
"""

from __future__ import annotations

import json
import pathlib
import random
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from weightsync.engine.plan import LinkModel, Participant, PlanOptions, makespan, plan  # noqa: E402

from planner_scale import _manifest, _spec, _transport  # noqa: E402

SIZES = [  # name, instances, senders, receivers, tensors, rows per tensor (in 256-row units)
    ("small", 3000, (2, 3), (2, 5), (2, 6), (1, 6)),
    ("medium", 300, (4, 8), (8, 16), (16, 40), (1, 64)),
]
LINK = LinkModel(net_bw=1e9, per_transfer_s=0.0)


def instance(rnd: random.Random, ns, nr, nt, rows):
    n_s, n_r, n_t = rnd.randint(*ns), rnd.randint(*nr), rnd.randint(*nt)
    shapes = {f"t{i}": (rnd.randint(*rows) * 256, 256) for i in range(n_t)}
    holders = {name: set(rnd.sample(range(n_s), rnd.randint(1, n_s))) for name in shapes}
    senders = []
    for s in range(n_s):
        mine = [_spec(name, shape, "float32") for name, shape in shapes.items() if s in holders[name]]
        if mine:
            senders.append(Participant(s, _manifest(mine), _transport("train", s)))
    held = sorted(shapes)  # (every tensor has a holder, and a holder holds something)
    receivers = [Participant(r, _manifest([_spec(name, shapes[name], "float32")
                                           for name in sorted(rnd.sample(held, rnd.randint(1, len(held))))]),
                             _transport("infer", r)) for r in range(n_r)]
    return senders, receivers


STEPS = {  # step -> the options without it, with it (the other step as the planner has it in both)
    "levelling": (PlanOptions(level=False, spread=False), PlanOptions(level=True, spread=False)),
    "spreading": (PlanOptions(level=True, spread=False), PlanOptions(level=True, spread=True)),
}


def main() -> None:
    for step, (without, with_) in STEPS.items():
        for name, count, *shape in SIZES:
            ratios = []
            for seed in range(count):
                senders, receivers = instance(random.Random(seed), *shape)
                ends = [makespan(plan(senders, receivers, LINK, options).senders, senders, receivers, LINK)
                        for options in (without, with_)]
                ratios.append(ends[1] / ends[0])
            print(json.dumps({
                "step": step, "instances": name, "count": count, "sooner": sum(r < 1 - 1e-9 for r in ratios),
                "later": sum(r > 1 + 1e-9 for r in ratios), "same": sum(abs(r - 1) <= 1e-9 for r in ratios),
                "with_over_without_geomean": round(statistics.geometric_mean(ratios), 4),
                "best": round(min(ratios), 4), "worst": round(max(ratios), 4),
            }), flush=True)


if __name__ == "__main__":
    main()
