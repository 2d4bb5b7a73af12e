"""What one launch costs the host: the copy kernel of a compiled lane, the fingerprint pass, and references.

How this works: a round on a GPU replays each lane's compiled table with one ``CopyKernel.launch`` (a
Triton launch), records events and, in a checked round, launches the ``fp64`` pass; an empty round's
sender spends 0.3-0.4 ms between its lanes being found and its seal (docs/TRANSPORTS.md). This times,
on one GPU, ``--n`` back-to-back launches of each (host time from the first call to the last return,
per launch; then one synchronize, not counted): the copy kernel of a one-row table through
``CopyKernel.launch`` (Triton's launcher: argument binding and specialization each call) and through
the compiled kernel's own ``run`` (the handle Triton returns, launched with the same arguments), one
``cudaMemcpyAsync`` of the same bytes, a torch ``copy_``, an event record, and ``Fingerprints.launch``
of one row. Prints one JSON line.

    python3 bench/diagnostics/launch_cost.py [--n 2000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(20):  # (warm: first launches compile or load)
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(1e6 * host / n, 2)


def direct_launcher(kernel):
    """``kernel``'s launch (a ``CopyKernel``) through the handle Triton compiled for its arguments
    (``JITFunction.warmup``: the same specialization as an ordinary launch), called as ``JITFunction.run``
    calls it, without the binder and specialization each call. A prototype: Triton's handle is internal."""
    from weightsync.engine.cuda.copy_kernel import _copy_pieces_kernel, grid
    from weightsync.engine.transforms.fp8_kernel import DeviceAddress

    device = torch.device("cuda", kernel.device)
    args = (kernel.table, DeviceAddress(kernel.src_base, torch.int32, device),
            DeviceAddress(kernel.dst_base, torch.int32, device), kernel.pieces, kernel.tile, kernel.steps)
    programs = grid(kernel.pieces, kernel.programs)
    with torch.cuda.device(kernel.device):
        compiled = _copy_pieces_kernel.warmup(*args[:4], TILE=kernel.tile, STEPS=kernel.steps, num_warps=kernel.warps,
                                              grid=(programs,))
    run = compiled.run  # (loads the module: sets ``function``)

    def launch(stream: torch.cuda.Stream) -> None:
        run(programs, 1, 1, stream.cuda_stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
    return launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args(argv)
    from weightsync.engine.cuda import copy_kernel, cuda_rt
    from weightsync.engine.cuda.fp64_kernel import Fingerprints

    device = torch.device("cuda", 0)
    src = torch.arange(1 << 20, dtype=torch.int32, device=device)
    dst = torch.zeros_like(src)
    stream = torch.cuda.Stream(device)
    kernel = copy_kernel.CopyKernel([(dst.data_ptr(), src.data_ptr(), 128)], 0)
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "n": args.n}
    import triton

    out["triton"] = triton.__version__
    out["copy_kernel_launch_us"] = per_call_us(lambda: kernel.launch(stream), args.n)
    out["memcpy_async_us"] = per_call_us(lambda: cuda_rt.memcpy_async(dst.data_ptr(), src.data_ptr(), 128, stream), args.n)
    a, b = src[:32], dst[:32]
    with torch.cuda.stream(stream):
        out["torch_copy_us"] = per_call_us(lambda: b.copy_(a), args.n)
    event = torch.cuda.Event()
    out["event_record_us"] = per_call_us(lambda: event.record(stream), args.n)
    prints = Fingerprints([(src.data_ptr(), 4096, 4096, 4096)], device)
    out["fp64_launch_us"] = per_call_us(lambda: prints.launch(stream), max(1, args.n // 10))
    try:  # the compiled kernel launched by its own handle: what the launch costs without the binder
        direct = direct_launcher(kernel)
        out["copy_kernel_direct_us"] = per_call_us(lambda: direct(stream), args.n)
        dst.zero_()
        direct(stream)
        torch.cuda.synchronize()
        out["copy_kernel_direct_correct"] = bool(torch.equal(dst[:32], src[:32]) and not dst[32:].any())
    except Exception as exc:  # (a Triton whose handle differs)
        out["copy_kernel_direct_error"] = repr(exc)[:300]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
