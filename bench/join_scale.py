"""Joins at scale: every trainer and inference rank of a scenario joins the controller, in a seeded
random order (as a launcher starts them), and admission checks each one.

Side by side, the same joins checked two ways: ``catalog`` (what the controller does: the newcomer
against what the joined members hold, ``engine.plan.catalog``) and ``revalidate`` (the planner's whole
validation, ``build_pieces``, over every joined member and the newcomer, at every join). Prints one
JSON line per (scenario, way): members rejected (a rejected worker fails to start: none should be),
total and worst CPU seconds of admission. Scenarios and manifests are ``planner_scale``'s.

    .venv/bin/python bench/join_scale.py                  # all scenarios
    .venv/bin/python bench/join_scale.py --only qwen3     # scenarios whose name contains "qwen3"
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from weightsync.engine.errors import PlanError  # noqa: E402
from weightsync.engine.plan import Catalog, Participant, build_pieces  # noqa: E402
from weightsync.roles.admission import admission_problem  # noqa: E402
from weightsync.wire import PROTOCOL_VERSION, Role  # noqa: E402
from weightsync.wire import messages as m  # noqa: E402

from planner_scale import SCENARIOS, _transport, receiver_manifest, sender_manifest, state_dict_shapes  # noqa: E402

NAMES = [  # trainer layouts whose senders each hold a part (EP, PP), and an FSDP one
    "qwen3-235b 128->32 tp8+ep8",
    "qwen3-235b 128->32 pp4+ep32 tp8+ep8",
    "kimi-k2 256->128 ep256 (uneven) tp8+ep128",
    "kimi-k2 128->128 fsdp+ep64 tp8+ep128",
    "kimi-k2 256->128 tp8",
]


def hellos(arch, layout, n_recv, tp, ep, fp8=False, seed=0) -> list[m.Hello]:
    params = state_dict_shapes(arch)
    out = []
    for role, count, make, where in ((Role.SENDER, layout.world, lambda r: sender_manifest(params, r, layout), "train"),
                                     (Role.RECEIVER, n_recv, lambda r: receiver_manifest(params, r, tp, ep, fp8), "infer")):
        for rank in range(count):
            transport = _transport(where, rank)
            out.append(m.Hello(role, rank, transport.host, transport.device, 1000 + rank, PROTOCOL_VERSION[0],
                               PROTOCOL_VERSION[1], (), make(rank), transport))
    random.Random(seed).shuffle(out)
    return out


def by_catalog(hello, expected, joined, state) -> bool:
    code, _ = admission_problem(hello, expected, joined, state)
    return code is None


def by_revalidation(hello, expected, joined, state) -> bool:
    senders, receivers = state
    newcomer = Participant(hello.rank, hello.manifest, hello.transport)
    try:
        if hello.role is Role.SENDER:
            build_pieces([*senders, newcomer], receivers)
        elif senders:
            build_pieces(senders, [*receivers, newcomer])
    except PlanError:
        return False
    (senders if hello.role is Role.SENDER else receivers).append(newcomer)
    return True


def run(name, arch, layout, n_recv, tp, ep, colocated, fp8=False) -> list[dict]:
    joins = hellos(arch, layout, n_recv, tp, ep, fp8)
    expected = {Role.SENDER: layout.world, Role.RECEIVER: n_recv}
    rows = []
    for way, admit, state in (("catalog", by_catalog, Catalog()), ("revalidate", by_revalidation, ([], []))):
        joined: dict = {}
        rejected, total, worst = 0, 0.0, 0.0
        for hello in joins:
            t0 = time.process_time()
            ok = admit(hello, expected, joined, state)
            dt = time.process_time() - t0
            total, worst = total + dt, max(worst, dt)
            if ok:
                joined[(hello.role, hello.rank)] = True
            else:
                rejected += 1
        rows.append({"scenario": name, "way": way, "joins": len(joins), "rejected": rejected,
                     "total_s": round(total, 2), "worst_join_s": round(worst, 3)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    args = ap.parse_args(argv)
    for scenario in SCENARIOS:
        if scenario[0] in NAMES and args.only in scenario[0]:
            for row in run(*scenario):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
