"""Copy patterns of a 7B state dict from GPU 0 to GPU 1: one call per tensor against batches of copies.

Why: the engine's cuda_ipc writes are pointer copies into the receiver's tensors; this measures, apart
from the engine, what issuing them one ``cudaMemcpyAsync`` per tensor costs against one copy of the
same bytes (the bound), and against ``cudaMemcpyBatchAsync`` (CUDA 12.8+) with N tensors per call on
one or two streams, to choose ``CudaIpcConnection.batch``. Qwen2.5-7B shapes, bf16, random values;
median of ``--rounds`` after a warm-up, both GPUs idle between calls (``transfer_gpu._timed``).
Results: docs/results/copy_batches_h200x2.txt.

    python3 bench/copy_batches.py [--rounds 9] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from transfer_gpu import _timed, make_state, peer_copies, pointer_copies  # noqa: E402

SMALL = 1 << 20  # "small" tensors: under 1 MiB (norms and biases)


def patterns(pairs: list[tuple[int, int, int]], streams: list[torch.cuda.Stream]) -> dict:
    """name -> a function issuing the copies ``(dst, src, nbytes)`` in that pattern."""
    from engine import cuda_rt

    small = [p for p in pairs if p[2] < SMALL]
    out = {
        "per tensor, 2 streams round robin": pointer_copies(pairs, streams[:2]),
        f"only the {len(pairs) - len(small)} tensors >= 1 MiB, per tensor, 2 streams": pointer_copies(
            [p for p in pairs if p[2] >= SMALL], streams[:2]),
        f"only the {len(small)} tensors < 1 MiB, per tensor, 1 stream": pointer_copies(small, streams[:1]),
    }
    if cuda_rt.batch_copies():
        out[f"only the {len(small)} tensors < 1 MiB, one batch call"] = pointer_copies(small, streams[:1], len(small))
        out["all in one batch call"] = pointer_copies(pairs, streams[:1], len(pairs))
        for size in (4, 8, 16, 32, 64):
            for n in (1, 2):
                out[f"batches of {size}, {n} stream{'s' if n > 1 else ''}"] = pointer_copies(pairs, streams[:n], size)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 0
    from engine import cuda_rt

    src = make_state("cuda:0")
    dst, pairs = peer_copies(src)
    nbytes = sum(p[2] for p in pairs)
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    streams = [torch.cuda.Stream(device=0) for _ in range(2)]
    rows = {"one copy of the same bytes (the bound)": lambda: b.copy_(a), **patterns(pairs, streams)}
    print(f"{len(pairs)} tensors, {nbytes / 1e9:.2f} GB, GPU0 -> GPU1; CUDA runtime {cuda_rt.runtime_version()}, "
          f"batch calls {'available' if cuda_rt.batch_copies() else 'unavailable'}; median of {args.rounds}")
    results = {}
    for name, fn in rows.items():
        results[name] = statistics.median(_timed(fn, args.rounds))
        print(f"  {name:<58} {results[name] * 1e3:8.3f} ms")
    for t in dst.values():  # then check that the batched copies deliver every byte
        t.zero_()
    full = rows.get("all in one batch call") or rows["per tensor, 2 streams round robin"]
    _timed(full, 1)
    ok = all(torch.equal(dst[k].to(v.device), v) for k, v in src.items())
    print(f"  destination equals source after one batch call of all tensors: {'yes' if ok else 'NO'}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"bytes": nbytes, "seconds": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
