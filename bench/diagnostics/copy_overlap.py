"""Do the colocated copy and the copy into another GPU run at once? Copy kernels' grids, measured.

Question it answers: a colocated sender copies its receiver's share on its own GPU and the other
receiver's share into the other GPU. Traces of ``bench/transfer_mn.py --colocated`` showed the two
copy kernels one after the other: a kernel of a program per piece (tens of thousands) fills every SM
until its last piece is dispatched, so the kernel of the other stream starts only then. This times, on
GPU 0, a same-GPU copy (dense, ``CopyKernel``) and a copy into GPU 1 (pitched rows cut from wider rows,
``PitchedKernel``, or the copy engines' ``cudaMemcpy2DAsync``), each alone and both at once on two
streams (either launched first; the copy engines' way beside the first grid), for grids of ``--grids`` programs per SM (``engine.cuda.copy_kernel.grid``;
0: a program per piece). One JSON line per setting: the times, ``together_over_slowest`` (1.0: fully
overlapped) and the same-GPU copy's GB/s alone. The sizes keep the 7B case's ratio (6.5 GB local to
1.1 GB across per sender) at half scale by default.

    python3 bench/diagnostics/copy_overlap.py [--local-gb 3.2] [--across-gb 0.56] [--grids 0:0,4:1,2:1]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def _time(launches, streams, repeat: int) -> float:
    """Median seconds from the first launch to the end of every stream's work."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(0)
        start, ends = torch.cuda.Event(enable_timing=True), []
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        for launch, s in zip(launches, streams):
            launch(s)
            end = torch.cuda.Event(enable_timing=True)
            end.record(s)
            ends.append(end)
        torch.cuda.synchronize(0)
        times.append(max(start.elapsed_time(e) for e in ends) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    from weightsync.engine.cuda import cuda_rt
    from weightsync.engine.cuda.copy_kernel import CopyKernel, PitchedKernel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local-gb", type=float, default=3.2)
    ap.add_argument("--across-gb", type=float, default=0.56)
    ap.add_argument("--grids", default="0:0,1:2,1:4,2:2,2:4,1:1,3:2", help="same:other programs per SM, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dma-each", action="store_true", help="time the copy engines' way beside every grid (default: the first)")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2 or not cuda_rt.enable_peer_access(0, 1):
        raise SystemExit("needs two GPUs with peer access")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_local = int(args.local_gb * 1e9) // 4 // 4096 * 4096
    src, dst = torch.empty(n_local, dtype=torch.int32, device="cuda:0"), torch.empty(n_local, dtype=torch.int32, device="cuda:0")
    pieces = 64  # local: 64 tensors (one copy each)
    step = n_local // pieces
    local = [(dst.data_ptr() + i * step * 4, src.data_ptr() + i * step * 4, step * 4) for i in range(pieces)]
    width, pitch = 9472, 18944  # (bf16 rows of 9472 columns, half of each taken: a row-parallel block)
    height = int(args.across_gb * 1e9) // width // 64
    wide = torch.empty(64 * height * pitch // 4, dtype=torch.int32, device="cuda:0")
    land = torch.empty(64 * height * width // 4, dtype=torch.int32, device="cuda:1")
    across = [(land.data_ptr() + i * height * width, wide.data_ptr() + i * height * pitch, width, height, pitch)
              for i in range(64)]
    streams = [torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)]
    dma = cuda_rt.PitchedCopies(across)
    for n, spec in enumerate(args.grids.split(",")):
        same, other = (float(x) for x in spec.split(":"))
        lk = CopyKernel(local, 0, programs=round(same * sms))
        pk = PitchedKernel(across, 0, programs=round(other * sms))
        ways = (("kernel", pk.launch), ("dma", dma.launch)) if n == 0 or args.dma_each else (("kernel", pk.launch),)
        for name, peer in ways:
            _time([lk.launch, peer], streams, 1)  # (compiles and warms)
            alone_local = _time([lk.launch], streams[:1], args.repeat)
            alone_peer = _time([peer], streams[1:], args.repeat)
            local_first = _time([lk.launch, peer], streams, args.repeat)
            peer_first = _time([peer, lk.launch], streams, args.repeat)
            together = max(local_first, peer_first)
            print(json.dumps({"grid_per_sm": [same, other], "sms": sms, "into_other_gpu": name,
                              "local_ms": round(alone_local * 1e3, 3), "across_ms": round(alone_peer * 1e3, 3),
                              "local_first_ms": round(local_first * 1e3, 3), "across_first_ms": round(peer_first * 1e3, 3),
                              "together_over_slowest": round(together / max(alone_local, alone_peer), 3),
                              "local_gbps": round(n_local * 4 / alone_local / 1e9, 1),
                              "across_gbps": round(64 * height * width / alone_peer / 1e9, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
