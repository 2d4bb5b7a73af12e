"""The planner's tables for the GPU machine's M -> N cases, with no GPU: bound and modelled makespan
under the per-row cost the model assumes and under the one the engine pays.

Question it answers: is a gap between the planner's prediction and its bound in the tables, or in the
model's per-row term? ``bench/transfer_mn.py`` on 2 x H200 predicted 12.8 ms for the Qwen3-30B-A3B
2 -> 2 colocated round against a 3.3 ms bound: 12,658 rows at the 2 us ``LinkModel.per_transfer_s``
default are 12.7 ms of issuing alone, while the engine's senders spend 0.16-0.18 us a row (pitched
rows go in one descriptor-table launch). This plans each case from synthetic manifests (the same
shapes as ``bench_model``, FSDP2 dim-0 shards, TP slices; ``bench/planner_scale.py``'s builders) with
the bandwidths measured there (``--across-gbps``, ``--local-gbps``) and prints, per case and per-row
cost, the rows, the lower bound and the makespan of the planner's tables (one JSON line each).

    .venv/bin/python bench/diagnostics/planner_mn.py [--per-row-us 2,0.17]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from planner_scale import _transport, receiver_manifest, sender_manifest  # noqa: E402
from weightsync.engine.models.shapes import bench_model  # noqa: E402
from weightsync.engine.plan import LinkModel, Participant, PlanOptions, build_pieces, lower_bound, makespan, plan  # noqa: E402
from weightsync.engine.plan.trainer import TrainerLayout  # noqa: E402

CASES = [("qwen2.5-7b", False), ("qwen3-30b-a3b", False), ("qwen2.5-7b", True)]  # (model, FP8 receivers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--across-gbps", type=float, default=391.78, help="GB/s into another GPU (2 x H200: 391.78)")
    ap.add_argument("--local-gbps", type=float, default=2057.46, help="GB/s of a same-GPU copy (2 x H200: 2057.46)")
    ap.add_argument("--per-row-us", default="2,0.17", help="per-row costs to replay with (comma-separated)")
    args = ap.parse_args(argv)
    for model, fp8 in CASES:
        params = bench_model(model)
        layout = TrainerLayout(args.senders)
        senders = [Participant(r, sender_manifest(params, r, layout), _transport("train", r)) for r in range(args.senders)]
        receivers = [Participant(r, receiver_manifest(params, r, args.receivers, 1, fp8), _transport("train", r))
                     for r in range(args.receivers)]  # (colocated: receiver r on trainer r's GPU)
        for per_row in (float(x) * 1e-6 for x in args.per_row_us.split(",")):
            link = LinkModel(host_bw=args.across_gbps * 1e9, local_bw=args.local_gbps * 1e9, per_transfer_s=per_row)
            routing = plan(senders, receivers, link, PlanOptions(), {}, 1)
            bound = lower_bound(build_pieces(senders, receivers)[0], senders, receivers, link)
            span = makespan(routing.senders, senders, receivers, link)
            print(json.dumps({"case": f"{args.senders} -> {args.receivers} colocated", "model": model, "fp8": fp8,
                              "per_row_us": round(per_row * 1e6, 3), "rows": routing.transfer_count,
                              "bound_ms": round(bound * 1e3, 3), "makespan_ms": round(span * 1e3, 3),
                              "makespan_over_bound": round(span / bound, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
