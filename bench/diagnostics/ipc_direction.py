"""Why is a push into CUDA-IPC-mapped memory 10x slower than a pull? Measure the variants side by side.

Two processes on one host: the owner holds a buffer on GPU 1, the peer holds the source on GPU 0.
Variants (each: one big copy, and the Qwen2.5-7B tensor sizes one copy per tensor):
  push_torch     peer opens the owner's handle through torch (the mapping is a cuda:1 tensor in the
                 peer process) and does dst.copy_(src): torch issues the copy from cuda:1's context
  push_cudart    peer opens the handle in cuda:0's context with peer access, and queues
                 cudaMemcpyAsync on a cuda:0 stream: GPU 0's copy engine pushes over NVLink
  pull_torch     the owner opens the peer's handle (a cuda:0 tensor in the owner) and copies into
                 its own memory on a cuda:1 stream: GPU 1's copy engine pulls
  local_peer     one process, both GPUs, torch copy (the bound)
Prints a table and writes JSON (--out).

    python3 bench/diagnostics/ipc_direction.py --gib 4 --out ipc_direction.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def _sizes(limit: int) -> list[int]:
    from weightsync.engine.models.shapes import state_dict_shapes

    out, total = [], 0
    for p in state_dict_shapes("qwen2.5-7b"):
        n = 2
        for d in p.shape:
            n *= d
        if total + n > limit:
            break
        out.append(n)
        total += n
    return out


def _time(fn, sync_devices, repeat=3) -> float:
    fn()
    for d in sync_devices:
        torch.cuda.synchronize(d)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        for d in sync_devices:
            torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t0)
    return best


def _owner(nbytes: int, conn) -> None:
    """Holds the destination on GPU 1; runs pull_torch itself, serves push variants to the peer."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    conn.send(dst.untyped_storage()._share_cuda_())
    peer_share, sizes = conn.recv()
    src = torch.UntypedStorage._new_shared_cuda(*peer_share)
    src_t = torch.empty(0, dtype=torch.uint8, device="cuda:0").set_(src)
    results = {}
    with torch.cuda.device(1):
        results["pull_torch_one"] = _time(lambda: dst.copy_(src_t[:nbytes]), [0, 1])
        results["pull_torch_tensors"] = _time(lambda: _per_tensor(dst, src_t, sizes), [0, 1])
    conn.send(results)
    conn.recv()  # wait until the peer is done with our memory


def _per_tensor(dst, src, sizes) -> None:
    at = 0
    for n in sizes:
        dst[at:at + n].copy_(src[at:at + n], non_blocking=True)
        at += n


def _peer(nbytes: int, conn, report) -> None:
    from weightsync.engine.cuda import cuda_rt

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    owner_share = conn.recv()
    sizes = _sizes(nbytes)
    conn.send((src.untyped_storage()._share_cuda_(), sizes))
    pull = conn.recv()
    results = dict(pull)
    # push_torch: the mapping opened by torch is a cuda:1 tensor in this process
    dst_storage = torch.UntypedStorage._new_shared_cuda(*owner_share)
    dst_t = torch.empty(0, dtype=torch.uint8, device="cuda:1").set_(dst_storage)
    results["push_torch_one"] = _time(lambda: dst_t[:nbytes].copy_(src), [0, 1])
    results["push_torch_tensors"] = _time(lambda: _per_tensor(dst_t, src, sizes), [0, 1])
    # push_cudart: open the same handle in cuda:0's context, copy on a cuda:0 stream
    cuda_rt.enable_peer_access(0, 1)
    base = cuda_rt.open_ipc_handle(cuda_rt.raw_ipc_handle(bytes(owner_share[1])), 0) + owner_share[3]
    streams = [torch.cuda.Stream(device=0) for _ in range(4)]

    def push_one():
        cuda_rt.memcpy_async(base, src.data_ptr(), nbytes, streams[0])

    def push_tensors(nstreams):
        at = 0
        for i, n in enumerate(sizes):
            cuda_rt.memcpy_async(base + at, src.data_ptr() + at, n, streams[i % nstreams])
            at += n

    results["push_cudart_one"] = _time(push_one, [0, 1])
    results["push_cudart_tensors_1stream"] = _time(lambda: push_tensors(1), [0, 1])
    results["push_cudart_tensors_4streams"] = _time(lambda: push_tensors(4), [0, 1])
    report.send(results)
    conn.send("done")


def _bound(nbytes: int):
    """One peer copy GPU 0 -> GPU 1 in this process (the buffers die with this frame)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    return _time(lambda: b.copy_(a), [0, 1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs two GPUs")
        return 0
    nbytes = int(args.gib * (1 << 30))
    bound = _bound(nbytes)
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    owner_end, peer_end = ctx.Pipe()  # owner <-> peer, directly
    results_in, results_out = ctx.Pipe(duplex=False)  # peer -> us
    owner = ctx.Process(target=_owner, args=(nbytes, owner_end))
    peer = ctx.Process(target=_peer, args=(nbytes, peer_end, results_out))
    owner.start()
    peer.start()
    results = results_in.recv()
    owner.join(60)
    peer.join(60)
    gb = nbytes / 1e9
    rows = {"local_peer_one (bound)": bound, **results}
    print(f"{gb:.2f} GB GPU0 -> GPU1 (best of 3)")
    for name, s in rows.items():
        print(f"  {name:<34} {s * 1e3:9.2f} ms {gb / s:8.1f} GB/s  {s / bound:6.2f}x bound")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"bytes": nbytes, "seconds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
