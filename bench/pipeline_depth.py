"""Pipelining depth: writes in flight per connection (1..64) against tensor-size mixes, per transport.

For each transport that can run here (tcp and memory always; cuda_ipc GPU0 -> GPU1 where two GPUs
are), runs the engine's ``Pipeline`` over one connection for three mixes — many 64 KiB tensors, a mixed
state dict, a few 256 MiB tensors — at depths 1, 2, 4, 8, 16, 32, 64, and reports GB/s and the mean
per-transfer latency (issue to completion). Best of 3 runs per point. Every row goes through the
stage -> write pipeline (``PipelineOptions(compiled=False)``): depth is that path's window (transforms,
gathers, checksums); a compiled replay has none. Writes JSON and, where matplotlib is installed, a PNG
next to it.

    python3 bench/pipeline_depth.py --out bench/results/pipeline_depth.json
    python3 bench/pipeline_depth.py --plot bench/results/pipeline_depth.json   # only re-plot
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from weightsync.engine.datapath.pipeline import Pipeline, PipelineOptions  # noqa: E402
from weightsync.engine.datapath.staging import SourceSet  # noqa: E402
from weightsync.engine.transport import TransportOptions, connect_authorized, create_transport  # noqa: E402
from weightsync.wire import PeerInfo, Transfer  # noqa: E402

DEPTHS = (1, 2, 4, 8, 16, 32, 64)
KiB, MiB = 1 << 10, 1 << 20


def mixes(total: int) -> dict[str, list[int]]:
    mixed = [64 * MiB] * 2 + [MiB] * 32 + [64 * KiB] * 256 + [KiB] * 64
    scale = max(1, total // sum(mixed))
    return {
        "many_64KiB": [64 * KiB] * (total // (64 * KiB)),
        "mixed": mixed * scale,
        "few_256MiB": [256 * MiB] * max(2, total // (256 * MiB)),
    }


async def one_point(kind: str, src_dev: str, dst_dev: str, sizes: list[int], depth: int) -> tuple[float, float]:
    dst_t = create_transport(kind, TransportOptions(device=dst_dev))
    src_t = create_transport(kind, TransportOptions(device=src_dev))
    info = await dst_t.start(1)
    await src_t.start(0)
    total = sum(sizes)
    region = torch.empty(total, dtype=torch.uint8, device=dst_dev)
    rinfo = dst_t.register(0, region)
    conn = await connect_authorized(src_t, dst_t, PeerInfo(1, info, (rinfo,)))
    source = torch.empty(total, dtype=torch.uint8, device=src_dev)
    tensors, transfers, at = {}, [], 0
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = source[at:at + n]
        transfers.append(Transfer(i, f"t{i}", None, 1, f"t{i}", 0, at, n, ""))
        at += n
    pipe = Pipeline(SourceSet(tensors), PipelineOptions(depth=depth, max_inflight_bytes=max(1 << 30, depth * max(sizes)),
                                                        compiled=False))  # (a compiled replay has no window)
    best, latency = float("inf"), 0.0
    for epoch in range(1, 4):
        t0 = time.perf_counter()
        report = await pipe.run(transfers, {1: conn}, epoch=epoch)
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, latency = elapsed, report.write_s / max(report.lanes[1].count, 1)
    await conn.close()
    await src_t.close()
    await dst_t.close()
    return total / best / 1e9, latency


async def sweep(budget_bytes: dict[str, int], only: set[str]) -> list[dict]:
    rows = []
    plans = [("tcp", "cpu", "cpu"), ("memory", "cpu", "cpu")]
    if torch.cuda.device_count() >= 2:
        plans.append(("cuda_ipc", "cuda:0", "cuda:1"))
    plans = [p for p in plans if not only or p[0] in only]
    for kind, src, dst in plans:
        for mix, sizes in mixes(budget_bytes.get(kind, 256 * MiB)).items():
            for depth in DEPTHS:
                gbps, lat = await one_point(kind, src, dst, sizes, depth)
                rows.append({"transport": kind, "mix": mix, "depth": depth, "gbps": gbps, "latency_us": lat * 1e6,
                             "tensors": len(sizes), "bytes": sum(sizes)})
                print(f"{kind:>9} {mix:>11} depth {depth:>2}: {gbps:8.2f} GB/s  {lat * 1e6:9.1f} us/transfer",
                      flush=True)
    return rows


def plot(rows: list[dict], png: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = sorted({r["transport"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for mix in ("many_64KiB", "mixed", "few_256MiB"):
            pts = [r for r in rows if r["transport"] == kind and r["mix"] == mix]
            ax.plot([r["depth"] for r in pts], [r["gbps"] for r in pts], marker="o", label=mix)
        ax.set_xscale("log", base=2)
        ax.set_title(kind)
        ax.set_xlabel("writes in flight per connection")
        ax.set_ylabel("GB/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/pipeline_depth.json")
    ap.add_argument("--plot", default="", help="only plot this JSON file")
    ap.add_argument("--cpu-mib", type=int, default=128, help="bytes per point for CPU transports")
    ap.add_argument("--gpu-mib", type=int, default=2048, help="bytes per point for cuda_ipc")
    ap.add_argument("--transports", default="", help="comma-separated subset (default: all available)")
    args = ap.parse_args(argv)
    if args.plot:
        src = pathlib.Path(args.plot)
        rows = json.loads(src.read_text())["rows"]
        print("plotted" if plot(rows, src.with_suffix(".png")) else "matplotlib is not installed")
        return 0
    from weightsync.engine.aio import install_uvloop

    install_uvloop()
    only = {t for t in args.transports.split(",") if t}
    budgets = {"tcp": args.cpu_mib * MiB, "memory": args.cpu_mib * MiB, "cuda_ipc": args.gpu_mib * MiB}
    rows = asyncio.run(sweep(budgets, only))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
