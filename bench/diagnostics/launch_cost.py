"""What one launch costs the host: the copy kernel of a compiled lane, the fingerprint pass, and references.

How this works: a round on a GPU replays each lane's compiled table with one ``CopyKernel.launch``,
records events and, in a checked round, launches the ``fp64`` pass (docs/TRANSPORTS.md). This times,
on one GPU, ``--n`` back-to-back launches of each (host time from the first call to the last return,
per launch; then one synchronize, not counted): the copy kernel of a one-row table as rounds launch it
(``engine.cuda.launches.Launch``: the compiled kernel's own launcher, arguments bound once) and through
Triton's launcher (``direct=False``: binding and specialization each call), with whether each copied
right; one ``cudaMemcpyAsync`` of the same bytes, a torch ``copy_``, an event record, and
``Fingerprints.launch`` of one row, and that launch waited for and its sums read (``fp64_read_us``).
Prints one JSON line.

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
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "n": args.n}
    import triton

    out["triton"] = triton.__version__
    for name, direct in (("copy_kernel_launch_us", False), ("copy_kernel_direct_us", None)):
        kernel = copy_kernel.CopyKernel([(dst.data_ptr(), src.data_ptr(), 128)], 0, direct=direct)
        out[name] = per_call_us(lambda: kernel.launch(stream), args.n)
        dst.zero_()
        kernel.launch(stream)
        torch.cuda.synchronize()
        out[name.replace("_us", "_correct")] = bool(torch.equal(dst[:32], src[:32]) and not dst[32:].any())
    out["copy_kernel_direct"] = kernel.launcher.direct  # (False: this Triton failed the check, ``launches``)
    out["memcpy_async_us"] = per_call_us(lambda: cuda_rt.memcpy_async(dst.data_ptr(), src.data_ptr(), 128, stream), args.n)
    a, b = src[:32], dst[:32]
    with torch.cuda.stream(stream):
        out["torch_copy_us"] = per_call_us(lambda: b.copy_(a), args.n)
    event = torch.cuda.Event()
    out["event_record_us"] = per_call_us(lambda: event.record(stream), args.n)
    prints = Fingerprints([(src.data_ptr(), 4096, 4096, 4096)], device)
    out["fp64_launch_us"] = per_call_us(lambda: prints.launch(stream), max(1, args.n // 10))

    def fp64_read() -> None:  # (what a checked round waits for: the launch, its event, the sums read)
        host, event = prints.launch(stream)
        event.synchronize()
        prints.values(host)
    out["fp64_read_us"] = per_call_us(fp64_read, max(1, args.n // 10))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
