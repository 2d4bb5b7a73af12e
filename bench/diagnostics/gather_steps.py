"""What each of the planner's gather steps buys: the makespan over the bound with each turned off alone.

Question it answers: where FSDP senders gather long tensors (fused expert stacks sent to TP receivers),
three steps keep the receivers' ports full (docs/PLANNER.md, Results): the early work
(``expand._early_work``), spreading (``levelling.spread``) and the tables' gather order
(``tables._when_gathered``). This plans each shape with all three, without each one alone, and
without any, and replays every plan in the model (``makespan`` over ``lower_bound``, each against the
bound of its own pieces). Shapes: two ``planner_scale`` scenarios and Kimi-K2 128 -> 64 tp8, which
the bench does not run.

    .venv/bin/python bench/diagnostics/gather_steps.py

Prints one JSON line per shape.
"""

from __future__ import annotations

import json
import pathlib
import sys
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(HERE / "bench"), str(HERE)]

import planner_scale as ps  # noqa: E402

from weightsync.engine.plan import LinkModel, PlanOptions, build_pieces, lower_bound, makespan, plan  # noqa: E402
from weightsync.engine.plan.trainer import TrainerLayout  # noqa: E402

SHAPES = {  # name -> (arch, trainer layout, receivers, inference TP, EP, colocated)
    "kimi-k2 256->128 tp8": ("kimi-k2", TrainerLayout(256), 128, 8, 1, False),
    "qwen3-235b 128->32 tp8": ("qwen3-235b-a22b", TrainerLayout(128), 32, 8, 1, False),
    "kimi-k2 128->64 tp8 (not in the bench)": ("kimi-k2", TrainerLayout(128), 64, 8, 1, False),
}
OFF = {  # what turning each step off replaces
    "early work": ("weightsync.engine.plan.expand._early_work", lambda *a, **k: None),
    "spreading": ("weightsync.engine.plan.planner.spread", lambda *a, **k: 0),
    "gather order": ("weightsync.engine.plan.planner.gathered_at", lambda *a, **k: {}),
}
LINK = LinkModel(net_bw=400e9 / 8, per_transfer_s=2e-6)


def ratio(senders, receivers, off: tuple[str, ...]) -> float:
    patches = [mock.patch(OFF[step][0], OFF[step][1]) for step in off]
    for p in patches:
        p.start()
    try:
        routing = plan(senders, receivers, LINK, PlanOptions())
        pieces, _ = build_pieces(senders, receivers)
        return round(makespan(routing.senders, senders, receivers, LINK) / lower_bound(pieces, senders, receivers, LINK), 4)
    finally:
        for p in patches:
            p.stop()


def main() -> int:
    for name, shape in SHAPES.items():
        senders, receivers, _ = ps.participants(*shape)
        row = {"shape": name, "all": ratio(senders, receivers, ())}
        for step in OFF:
            row[f"without {step}"] = ratio(senders, receivers, (step,))
        row["none"] = ratio(senders, receivers, tuple(OFF))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
