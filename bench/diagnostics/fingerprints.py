"""Microbenchmark: the ``fp64`` fingerprints of a whole model on one GPU, as a round's full check takes them.

Times (median of ``--rounds`` after a warm-up) ``checksums.fp64_many`` over every parameter of a
Qwen2.5-7B-shaped bf16 model (one launch, ``weightsync.engine.cuda.fp64_kernel``) beside the torch
reference row by row (``checksums.fp64``, what each row cost before), checks they agree bit for bit, and
prints GB/s of the bytes fingerprinted. A full check reads the model once on each side, so the kernel's
time, once per ``full_check_every`` rounds, is what the default checks add to a dense round.

    python3 bench/diagnostics/fingerprints.py [--arch qwen2.5-7b] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from weightsync.engine.datapath import checksums  # noqa: E402
from weightsync.engine.models.shapes import state_dict_shapes  # noqa: E402


def _time(fn, rounds: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen2.5-7b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    views = [torch.randn(p.shape, generator=gen, device="cuda:0").to(torch.bfloat16)
             for p in state_dict_shapes(args.arch)]
    nbytes = sum(v.numel() * v.element_size() for v in views)
    kernel_s, got = _time(lambda: checksums.fp64_many(views), args.rounds)
    torch_s, want = _time(lambda: [checksums.fp64(v.reshape(-1).view(torch.uint8)) for v in views], args.rounds)
    out = {"arch": args.arch, "tensors": len(views), "bytes": nbytes, "kernel_ms": round(kernel_s * 1e3, 3),
           "torch_rows_ms": round(torch_s * 1e3, 3), "kernel_gbps": round(nbytes / kernel_s / 1e9, 1),
           "speedup": round(torch_s / kernel_s, 2), "equal": got == want, "kernel_ran": not checksums._KERNEL_FAILED,
           "device": torch.cuda.get_device_name(0), "command": "bench/diagnostics/fingerprints.py " + " ".join(
               sys.argv[1:] if argv is None else argv)}
    print(json.dumps(out) if args.json else out)
    return 0 if out["equal"] and out["kernel_ran"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
