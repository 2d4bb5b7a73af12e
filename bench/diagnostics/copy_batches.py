"""Copy patterns of a 7B state dict from GPU 0 to GPU 1: one call per tensor against batches of copies.

Why: the engine's cuda_ipc writes are pointer copies into the receiver's tensors; this measures, apart
from the engine, what issuing them one ``cudaMemcpyAsync`` per tensor costs against one copy of the
same bytes (the bound), and against ``cudaMemcpyBatchAsync`` (CUDA 12.8+) with N tensors per call on
one or two streams, to choose ``CudaIpcConnection.batch``. Qwen2.5-7B shapes, bf16, random values;
median of ``--rounds`` after a warm-up, both GPUs idle between calls (``transfer_gpu._timed``).
Results: docs/results/copy_batches_h200x2.txt.

    python3 bench/diagnostics/copy_batches.py [--rounds 9] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from transfer_gpu import _timed, make_state, peer_copies, pointer_copies  # noqa: E402

SMALL = 1 << 20  # "small" tensors: under 1 MiB (norms and biases)


def patterns(pairs: list[tuple[int, int, int]], streams: list[torch.cuda.Stream], dst_device: int = 1) -> dict:
    """name -> a function issuing the copies ``(dst, src, nbytes)`` in that pattern."""
    from weightsync.engine.cuda import cuda_rt

    small = [p for p in pairs if p[2] < SMALL]
    out = {
        "per tensor, 2 streams round robin": pointer_copies(pairs, streams[:2], 1, dst_device),
        f"only the {len(pairs) - len(small)} tensors >= 1 MiB, per tensor, 2 streams": pointer_copies(
            [p for p in pairs if p[2] >= SMALL], streams[:2], 1, dst_device),
        f"only the {len(small)} tensors < 1 MiB, per tensor, 1 stream": pointer_copies(small, streams[:1], 1, dst_device),
    }
    if cuda_rt.batch_copies():
        out[f"only the {len(small)} tensors < 1 MiB, one batch call"] = pointer_copies(small, streams[:1], len(small), dst_device)
        for size in (16, 64):
            for n in (1, 2):
                out[f"batches of {size}, {n} stream{'s' if n > 1 else ''}"] = pointer_copies(pairs, streams[:n], size, dst_device)
    return out


def replays(pairs: list[tuple[int, int, int]], streams: list[torch.cuda.Stream], dst_device: int) -> dict:
    """name -> a function replaying the copies the way a compiled round may: one batch call, batch calls
    of 256 on two streams, and (same GPU) one Triton launch. (A CUDA graph of batch calls is not an
    option: capturing ``cudaMemcpyBatchAsync`` fails with error 900, CUDA 12.9.) The kernel's other shapes:
    ``bench/diagnostics/copy_kernel.py``."""
    from weightsync.engine.cuda.copy_kernel import CopyKernel

    out = {"all in one batch call": pointer_copies(pairs, streams[:1], len(pairs), dst_device),
           "batch calls of 256, 2 streams": pointer_copies(pairs, streams[:2], 256, dst_device)}
    if dst_device == 0:
        kernel = CopyKernel(pairs, 0)
        out["one Triton launch (CopyKernel)"] = lambda: kernel.launch(streams[0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="")
    ap.add_argument("--model", default="qwen2.5-7b", help="qwen2.5-7b or qwen3-30b-a3b (per-expert tensors)")
    ap.add_argument("--colocated", action="store_true", help="GPU0 -> GPU0 (trainer and inference on one GPU)")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2 and not args.colocated:
        print("needs two GPUs")
        return 0
    from weightsync.engine.cuda import cuda_rt

    dst_device = 0 if args.colocated else 1
    src = make_state("cuda:0", model=args.model)
    dst, pairs = peer_copies(src, dst_device)
    nbytes = sum(p[2] for p in pairs)
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_device}")
    streams = [torch.cuda.Stream(device=0) for _ in range(2)]
    rows = {"one copy of the same bytes (the bound)": lambda: b.copy_(a),
            **replays(pairs, streams, dst_device), **patterns(pairs, streams, dst_device)}
    print(f"{args.model}: {len(pairs)} tensors, {nbytes / 1e9:.2f} GB, GPU0 -> GPU{dst_device}; "
          f"CUDA runtime {cuda_rt.runtime_version()}, "
          f"batch calls {'available' if cuda_rt.batch_copies() else 'unavailable'}; median of {args.rounds}")
    results = {}
    for name, fn in rows.items():
        results[name] = statistics.median(_timed(fn, args.rounds))
        print(f"  {name:<58} {results[name] * 1e3:8.3f} ms")
    for t in dst.values():  # then check that the batched copies deliver every byte
        t.zero_()
    ok = True
    for name in [n for n in ("all in one batch call", "one Triton launch (CopyKernel)") if n in rows]:
        for t in dst.values():
            t.zero_()
        _timed(rows[name], 1)
        same = all(torch.equal(dst[k].to(v.device), v) for k, v in src.items())
        print(f"  destination equals source after {name}: {'yes' if same else 'NO'}")
        ok &= same
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"bytes": nbytes, "seconds": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
