"""The colocated copy kernel's shapes against one flat copy of the same bytes (the bound), per model.

Why: a colocated round moves a model's tensors from the trainer's memory into the inference engine's
on one GPU with one launch of ``engine.cuda.copy_kernel.CopyKernel`` (a table of pieces, one program
each). Its data time is the round's floor, and the benchmark's bound is one ``copy_`` of the
same number of bytes (``bench/transfer_gpu.bound_seconds``). This times, on GPU 0, the kernel in the
shape the engine uses and in other shapes (words per step, steps per piece, warps, a bounded grid of
programs looping over the pieces), one flat copy of the model's bytes, and one ``copy_`` per tensor,
for each ``--models`` (separately allocated tensors, as a trainer's and an engine's are; random bf16).
``--pitched``: the pitched kernel (``PitchedKernel``: row-parallel TP slices cut from FSDP shards, the
rows of an M -> N round) in its shapes (words per row piece, rows per piece, warps), against one flat
copy of the same bytes and a ``cudaMemcpy2DAsync`` per tensor.
Each line: milliseconds (median of ``--rounds`` after a warm-up, the GPU idle between calls,
``transfer_gpu._timed``: launch to synchronize, as a round sees it) and the ratio to the flat copy.
Results: docs/results/copy_kernel_h200.jsonl, docs/results/copy_kernel_pitched_h100.jsonl (``--pitched``).

    python3 bench/diagnostics/copy_kernel.py [--models qwen2.5-0.5b,qwen2.5-7b] [--rounds 15] [--shapes 4096:8:16,2048:8:8:4] [--pitched] [--out FILE.jsonl]
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

from transfer_gpu import _timed, make_state  # noqa: E402

# (tile words, steps, warps, programs per SM or None): the engine's shape (``copy_kernel.TILE``, ...) first
SHAPES = [(4096, 8, 16, None), (2048, 8, 8, None), (2048, 8, 4, None), (1024, 16, 4, None), (4096, 4, 8, None),
          (2048, 16, 8, None), (1024, 8, 4, None), (2048, 8, 8, 4), (2048, 8, 8, 8), (4096, 4, 8, 8)]


def cases(model: str, rounds: int, shapes: list) -> list[dict]:
    from weightsync.engine.cuda.copy_kernel import CopyKernel

    src = make_state("cuda:0", model=model)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    copies = [(dst[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size()) for k, v in src.items()]
    nbytes = sum(c[2] for c in copies)
    stream = torch.cuda.current_stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flat = _flat_ms(nbytes, rounds)
    out = [{"way": "one flat copy_ (the bound)", "ms": flat},
           {"way": "copy_ per tensor", "ms": _ms(lambda: [dst[k].copy_(v) for k, v in src.items()], rounds)}]
    for tile, steps, warps, per_sm in shapes:
        kernel = CopyKernel(copies, 0, tile=tile, steps=steps, warps=warps,
                            programs=per_sm * sms if per_sm else None)
        for d in dst.values():
            d.zero_()
        took = _ms(lambda: kernel.launch(stream), rounds)
        exact = all(torch.equal(dst[k], v) for k, v in src.items())
        out.append({"way": f"CopyKernel tile={tile} steps={steps} warps={warps} "
                           f"programs={f'{per_sm}/SM' if per_sm else 'one per piece'}",
                    "ms": took, "pieces": kernel.pieces, "bit_exact": exact})
    return _lines(out, flat, model=model, tensors=len(copies), nbytes=nbytes)


def _ms(fn, rounds: int) -> float:
    """Milliseconds per call of ``fn``: the median of ``rounds`` (``transfer_gpu._timed``)."""
    return statistics.median(_timed(fn, rounds)) * 1e3


def _flat_ms(nbytes: int, rounds: int) -> float:
    """One ``copy_`` of ``nbytes`` on GPU 0 (the bound), in milliseconds; its buffers freed after."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    return _ms(lambda: b.copy_(a), rounds)


def _lines(out: list[dict], flat: float, **fields) -> list[dict]:
    """Each line with ``fields``, its ratio to the flat copy and the device."""
    for line in out:
        line.update(fields, ms=round(line["ms"], 4), over_flat=round(line["ms"] / flat, 4),
                    device=torch.cuda.get_device_name(0))
    return out


# (tile words, rows, warps, 16-byte vectors) of the pitched kernel: the engine's (``pitched_table.TILE``,
# ``ROWS``, ``WARPS``) first, without and with vectors (which it uses where the copies allow)
PITCHED = [(256, 16, 4, 0), (256, 16, 4, 1), (256, 16, 8, 1), (512, 8, 4, 1), (512, 16, 8, 1), (1024, 4, 8, 1),
           (1024, 8, 8, 1), (256, 32, 8, 1), (2048, 4, 16, 1), (512, 8, 4, 0), (1024, 8, 8, 0)]


def pitched_cases(model: str, rounds: int, shapes: list) -> list[dict]:
    """A row-parallel TP slice cut from an FSDP shard, into the same GPU: of every 2-D tensor, the first
    half of its rows (rank 0's shard), the first half of their columns (TP rank 0's slice), landing back
    to back (``PitchedKernel``), against one flat copy of the same bytes and a ``cudaMemcpy2DAsync`` each."""
    from weightsync.engine.cuda import cuda_rt
    from weightsync.engine.cuda.copy_kernel import PitchedKernel

    src = {k: v for k, v in make_state("cuda:0", model=model).items() if v.dim() == 2 and v.shape[1] % 2 == 0}
    dst = {k: torch.empty((v.shape[0] // 2, v.shape[1] // 2), dtype=v.dtype, device="cuda:0") for k, v in src.items()}
    copies = [(dst[k].data_ptr(), v.data_ptr(), v.shape[1] // 2 * v.element_size(), v.shape[0] // 2,
               v.shape[1] * v.element_size()) for k, v in src.items()]
    nbytes = sum(c[2] * c[3] for c in copies)
    want = {k: v[: v.shape[0] // 2, : v.shape[1] // 2] for k, v in src.items()}
    stream = torch.cuda.current_stream()
    flat = _flat_ms(nbytes, rounds)
    dma = cuda_rt.PitchedCopies(copies)
    out = [{"way": "one flat copy_ (the bound)", "ms": flat},
           {"way": "cudaMemcpy2DAsync per tensor", "ms": _ms(lambda: dma.launch(stream), rounds)}]
    for tile, rows, warps, vec in shapes:
        kernel = PitchedKernel(copies, 0, tile=tile, rows=rows, warps=warps, vec=bool(vec))
        for d in dst.values():
            d.zero_()
        took = _ms(lambda: kernel.launch(stream), rounds)
        exact = all(torch.equal(dst[k], w) for k, w in want.items())
        out.append({"way": f"PitchedKernel tile={tile} rows={rows} warps={warps} vec={bool(vec)}", "ms": took,
                    "pieces": kernel.pieces, "bit_exact": exact})
    return _lines(out, flat, model=model, pitched=True, tensors=len(copies), nbytes=nbytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-7b,qwen3-30b-a3b")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shapes", default="", help="TILE:STEPS:WARPS[:PROGRAMS_PER_SM],... (default: a fixed set)")
    ap.add_argument("--pitched", action="store_true", help="the pitched kernel (TP slices of FSDP shards) instead; "
                    "--shapes then TILE:ROWS:WARPS:VEC,...")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.pitched:
        shapes = [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")] if args.shapes else PITCHED
    else:
        shapes = [tuple([*map(int, s.split(":")), None][:4]) for s in args.shapes.split(",")] if args.shapes else SHAPES
    lines = []
    for model in args.models.split(","):
        for line in (pitched_cases if args.pitched else cases)(model, args.rounds, shapes):
            line["command"] = "bench/diagnostics/copy_kernel.py " + " ".join(sys.argv[1:])
            print(json.dumps(line), flush=True)
            lines.append(line)
        torch.cuda.empty_cache()
    if args.out:
        pathlib.Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
