"""Microbenchmark: a whole model's deltas on one GPU with the batched kernels, beside the torch codec.

A bf16 model of ``--arch``'s shapes, ``--fraction`` of its values moved by one unit in the last place
(a few by more). Times (median of ``--rounds`` after a warm-up): ``delta_kernel.encode_many`` over every
row (the sender: deltas, bases brought to the new bytes, fingerprint changes; one wait for the sizes),
``delta_apply.Applier`` check and apply (the receiver), and the torch codec row by row (``delta.encode``: what GPU
rows cost before), and a device copy of the model (what a colocated dense round moves). Checks that the
applied rows equal the new ones bit for bit and that the packed deltas equal the torch codec's.

    python3 bench/diagnostics/delta_kernels.py [--arch qwen2.5-0.5b] [--fraction 0.01] [--json] [--profile]

``--profile`` adds where one encode and one check + apply spend their time (torch.profiler): the
device time of each operation (Triton kernels and torch's), their sum beside the wall time, and the
operations that take the most host time.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from weightsync.engine.cuda import delta_apply, delta_kernel  # noqa: E402
from weightsync.engine.models.shapes import state_dict_shapes  # noqa: E402
from weightsync.engine.transforms import delta as codec  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, rounds: int, before=lambda: None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(rounds + 1):
        before()
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out


def _stepped(views: list[torch.Tensor], fraction: float, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=views[0].device).manual_seed(seed)
    out = []
    for v in views:
        bits = codec.bits(v.clone())
        picked = torch.rand(bits.shape, generator=gen, device=v.device) < fraction
        bits[picked] += 1
        out.append(bits.view(v.dtype))
    return out


def _profile(fn, before=lambda: None, top: int = 10) -> dict:
    """One call of ``fn`` under torch.profiler: wall ms, device-busy ms, the ``top`` operations by their
    own device time, and the ``top`` by their own host time (host glue: table building, copies, waits)."""
    from torch.profiler import ProfilerActivity, profile

    before()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t0
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                  key=lambda e: e.self_device_time_total, reverse=True)
    busy = sum(e.self_device_time_total for e in rows) / 1e3
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"wall_ms": round(wall * 1e3, 3), "device_busy_ms": round(busy, 3),
            "ops_ms": {e.key[:60]: round(e.self_device_time_total / 1e3, 3) for e in rows[:top]},
            "ops_calls": {e.key[:60]: e.count for e in rows[:top]},
            "host_ops_ms": {e.key[:60]: round(e.self_cpu_time_total / 1e3, 3) for e in host}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen2.5-0.5b")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="where one encode and one check + apply spend their time")
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)  # (cpu: Triton's interpreter)
    ap.add_argument("--max-numel", type=int, default=0, help=argparse.SUPPRESS)  # (smaller tensors only)
    ap.add_argument("--tile", type=int, default=delta_kernel.TILE, help="values per program (count, compact)")
    ap.add_argument("--block", type=int, default=delta_kernel.BLOCK, help="changes per program (measure, pack, apply)")
    ap.add_argument("--warps", type=int, default=delta_kernel.WARPS, help="warps per program")
    args = ap.parse_args(argv)
    delta_kernel.TILE, delta_kernel.BLOCK, delta_kernel.WARPS = args.tile, args.block, args.warps
    gen = torch.Generator(device=args.device).manual_seed(0)
    shapes = state_dict_shapes(args.arch)
    old = [(torch.randn(p.shape, generator=gen, device=args.device) * 0.02).to(torch.bfloat16).reshape(-1)
           for p in shapes if not args.max_numel or math.prod(p.shape) <= args.max_numel]
    new = _stepped(old, args.fraction, 1)
    nbytes = sum(v.numel() * v.element_size() for v in old)
    bases = [v.clone() for v in old]

    def reset():
        for b, o in zip(bases, old):
            b.copy_(o)

    encode_s, encoded = _time(lambda: delta_kernel.encode_many(list(zip(bases, new))), args.rounds, reset)
    region = torch.cat([e.packed for e in encoded if e.packed is not None])
    starts, at = [], 0
    for e in encoded:
        starts.append(at)
        at += e.packed.numel() if e.packed is not None else 0
    kept = [k for k, e in enumerate(encoded) if e.packed is not None]
    heads = delta_apply.headers(region, [starts[k] for k in kept])
    targets = [o.clone() for o in old]

    def land():
        applier = delta_apply.Applier([(region[starts[k]:], targets[k], h) for k, h in zip(kept, heads)])
        assert applier.check() == [None] * len(kept)
        return applier.apply()

    def reset_targets():
        for k in kept:
            targets[k].copy_(old[k])

    apply_s, _ = _time(land, args.rounds, reset_targets)
    exact = all(torch.equal(targets[k], new[k]) for k in kept)
    torch_s, refs = _time(lambda: [codec.encode(o, n) for o, n in zip(old, new)], 1)
    same = all((r is None) == (e.packed is None) and (r is None or torch.equal(codec.pack_tensor(r), e.packed))
               for r, e in zip(refs, encoded))
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
    copy_s, _ = _time(lambda: torch.cat(new, out=flat), args.rounds)
    out = {"arch": args.arch, "tensors": len(old), "bytes": nbytes, "fraction": args.fraction,
           "tile": args.tile, "block": args.block, "warps": args.warps,
           "delta_bytes": region.numel(), "rows_as_deltas": len(kept),
           "encode_ms": round(encode_s * 1e3, 3), "check_apply_ms": round(apply_s * 1e3, 3),
           "torch_encode_ms": round(torch_s * 1e3, 3), "copy_ms": round(copy_s * 1e3, 3),
           "encode_gbps": round(nbytes / encode_s / 1e9, 1), "bit_exact": exact, "equal_to_torch": same,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else args.device,
           "command": "bench/diagnostics/delta_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.profile and torch.cuda.is_available():
        out["encode_profile"] = _profile(lambda: delta_kernel.encode_many(list(zip(bases, new))), reset)
        out["check_apply_profile"] = _profile(land, reset_targets)
    print(json.dumps(out) if args.json else out)
    return 0 if exact and same else 1


if __name__ == "__main__":
    sys.exit(main())
