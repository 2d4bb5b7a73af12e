"""FSDP gathers: full tensors made on the trainer ranks that need them, beside the ways others make them.

Question it answers: how long a trainer's FSDP2 ranks take to give each rank the full tensors its
routing table reads outside its own shard (a designated gatherer's parameters, ``engine.plan``), and
how far that is from what the links allow. ``world`` processes hold every parameter of a model as a
DTensor (dim-0 ``Shard`` on a 1-D mesh; NCCL on GPUs, one per GPU, or gloo on the CPU); each
parameter is needed by one rank, the ranks taking the largest first to the least loaded (as the
planner spreads gathers by bytes).

Arms, in one run, on the same DTensors, taking turns round by round (median of the rounds after a
warm-up round of each):
- **windows**: ``engine.transforms.gather.Gatherer`` as a sender runs it (its default budget,
  ``SenderOptions.gather_budget_bytes``): parameters smallest first in windows (``gather_windows``),
  a window's point-to-point operations posted as one batch (small parameters' rows packed, one
  operation per peer), the next window posted while the last is taken.
  Each rank takes its full tensors in gather order and drops each at once (the pipeline, free).
- **one at a time**: the same point-to-point gathers, one parameter after the other, every rank
  waiting for each (a gatherer that walks the parameters).
- **full_tensor**: ``DTensor.full_tensor()`` of every parameter on every rank, one after the other,
  dropped where not needed: what a trainer that gathers before it sends does.
- **bound**: the busiest rank's pulled bytes (full tensors less its own shard) over the bandwidth of
  one direction of a link with both directions busy, measured here (1 GiB each way between ranks 0
  and 1, at once): every rank pulls over its own link, so no schedule can be faster.
Every full tensor of the first rounds is checked against the values the ranks filled in.

    python3 bench/gather_fsdp.py --model qwen3-30b-a3b            (2 GPUs: NCCL over NVLink)
    .venv/bin/python bench/gather_fsdp.py --device cpu --model tiny-moe --world 3 --rounds 3

Prints one JSON object per model (``--json``: only those), then a table (rich).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from mn_setup import free_port, model_shapes  # noqa: E402

LINK_BYTES = 1 << 30
WATCHDOG_S = 900.0


def shapes_of(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter: a bench model (``mn_setup.model_shapes``), or ``small``: 8,192
    tensors of 32 KiB (where per-operation costs, not bytes, decide)."""
    if model == "small":
        return [(f"small.{i}.weight", (64, 256)) for i in range(8192)]
    return [(p.name, tuple(p.shape)) for p in model_shapes(model)]


def designated(shapes: list[tuple[str, tuple[int, ...]]], world: int) -> dict[str, int]:
    """Each parameter's gatherer: the largest first, each to the rank with the fewest bytes so far."""
    load = [0] * world
    out = {}
    for name, shape in sorted(shapes, key=lambda s: (-_numel(s[1]), s[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += _numel(shape)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rank_main(rank: int, world: int, port: int, device: str, model: str, rounds: int, eager: bool, conn) -> None:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    try:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank) if eager and device == "cuda" else None)
        try:
            conn.send(("done", asyncio.run(_rank(rank, world, device, model, rounds))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))


async def _rank(rank: int, world: int, device: str, model: str, rounds: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.engine.transforms.gather import Gatherer, split_dtensors
    from weightsync.roles import SenderOptions
    from weightsync.wire import Transfer

    from weightsync.engine.transforms.gather import _exchange, _post, _wait

    mesh = init_device_mesh(device, (world,))
    shapes = shapes_of(model)
    index = {name: i for i, (name, _) in enumerate(shapes)}
    dts = _filled(shapes, mesh)
    _, shards, dts = split_dtensors(dts)
    owner = designated(shapes, world)
    budget = SenderOptions().gather_budget_bytes
    gatherer = Gatherer(dts, budget, shards)
    mine = sorted((n for n, r in owner.items() if r == rank), key=gatherer.order.__getitem__)
    table = tuple(Transfer(i, n, None, 0, n, 0, 0, _bytes(dts[n]), "") for i, n in enumerate(mine))
    pulled = sum(_bytes(dts[n]) - _bytes(dts[n].to_local()) for n in mine)
    needs = await asyncio.to_thread(_exchange, dts, shards, set(mine), budget)  # (as the Gatherer's own)
    local = next(iter(dts.values())).to_local().device
    wrong: list[str] = []

    def check_(full: torch.Tensor, n: str) -> None:
        want = (torch.arange(full.shape[0], device=full.device) + index[n]) % 251
        flat = full.reshape(full.shape[0], -1).float()
        if not torch.equal(flat, want.float().view(-1, 1).expand(flat.shape)):
            wrong.append(f"{arm_now}: {n}")

    async def windows(check: bool) -> None:
        gatherer.begin(table, key=table)
        for n in mine:
            full = await gatherer.full(n)
            if check:
                check_(full, n)
            gatherer.release(n)
        await gatherer.finish()

    async def one_at_a_time(check: bool) -> None:  # the Gatherer's own operations, in windows of one
        for n in gatherer.order:
            if needs[n] is None or not needs[n].ranks:
                continue
            take = {n} if owner[n] == rank else set()
            fulls, works, staged, _ = await asyncio.to_thread(_post, gatherer, needs, (n,), frozenset(take))
            await asyncio.to_thread(_wait, works, staged, local)
            if check and take:
                check_(fulls[n], n)

    async def full_tensor(check: bool) -> None:
        for n in gatherer.order:  # (the same order on every rank)
            full = dts[n].full_tensor()
            if check and owner[n] == rank:
                check_(full, n)
            del full
        _sync(device)

    arm_now = ""
    arms = {"windows": windows, "one at a time": one_at_a_time, "full_tensor": full_tensor}
    times: dict[str, list[float]] = {a: [] for a in arms}
    link = _link_bw(rank, world, device)
    for i in range(rounds + 1):
        for name, arm in arms.items():
            arm_now = name
            dist.barrier()
            _sync(device)
            t = time.perf_counter()
            await arm(check=i < 2)
            _sync(device)
            took = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # (a round ends when its last rank is done)
            if i:
                times[name].append(took.item())
    return {"rank": rank, "pulled": pulled, "link_Bps": link, "times": times, "wrong": wrong[:5],
            "windows": gatherer.windows, "peak": gatherer.peak_bytes, "budget": budget,
            "tensors": len(shapes), "bytes": sum(_bytes(t) for t in dts.values())}


def _filled(shapes, mesh) -> dict:
    """Every parameter as a DTensor of bf16, each row of it holding (parameter index + row) mod 251
    (exact in bf16), each rank filling only its own rows."""
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, (name, shape) in enumerate(shapes):
        dt = dtensor.empty(*shape, dtype=torch.bfloat16, device_mesh=mesh, placements=[Shard(0)])
        local = dt.to_local()
        shape_here, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        rows, start = shape_here[0], offset[0]
        if local.numel():
            value = (torch.arange(start, start + rows, device=local.device) + i) % 251
            local.copy_(value.view(-1, *([1] * (len(shape) - 1))).expand(local.shape))
        out[name] = dt
    return out


def _link_bw(rank: int, world: int, device: str) -> float:
    """Bytes/s of one direction between ranks 0 and 1 with both directions busy (1 GiB each way)."""
    import torch.distributed as dist

    if world < 2:
        return float("inf")
    nbytes = LINK_BYTES if device == "cuda" else 64 << 20
    out = torch.ones(nbytes, dtype=torch.uint8, device=device)
    into = torch.empty_like(out)
    took = []
    for _ in range(4):
        dist.barrier()
        _sync(device)
        t = time.perf_counter()
        if rank < 2:
            peer = 1 - rank
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]):
                w.wait()
        _sync(device)
        took.append(time.perf_counter() - t)
    del out, into
    if device == "cuda":
        torch.cuda.empty_cache()
    return nbytes / statistics.median(took[1:])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def run(model: str, world: int, device: str, rounds: int, eager: bool = False) -> dict:
    reports = _spawned(world, device, model, rounds, eager)
    reports.sort(key=lambda r: r["rank"])
    link = min(r["link_Bps"] for r in reports)
    busiest = max(r["pulled"] for r in reports)
    med = {a: statistics.median(t) for a, t in reports[0]["times"].items()}  # (every rank has the max)
    bound = busiest / link
    return {
        "model": model, "device": _device_name(device), "world": world, "nccl_eager": eager, "tensors": reports[0]["tensors"],
        "GB": round(reports[0]["bytes"] / 1e9, 3), "busiest_pull_GB": round(busiest / 1e9, 3),
        "link_GBps": round(link / 1e9, 1), "bound_s": round(bound, 4),
        **{f"{a.replace(' ', '_')}_s": round(t, 4) for a, t in med.items()},
        "windows_over_bound": round(med["windows"] / bound, 3),
        "one_at_a_time_over_windows": round(med["one at a time"] / med["windows"], 3),
        "full_tensor_over_windows": round(med["full_tensor"] / med["windows"], 3),
        "windows_per_round": reports[0]["windows"] // (rounds + 1),
        "peak_GB": round(max(r["peak"] for r in reports) / 1e9, 3), "budget_GB": round(reports[0]["budget"] / 1e9, 3),
        "rounds": rounds, "right": not any(r["wrong"] for r in reports), "wrong": [w for r in reports for w in r["wrong"]],
    }


def _spawned(world: int, device: str, model: str, rounds: int, eager: bool) -> list[dict]:
    """One process per rank, each reporting once; a rank's error (or death, or silence) raises."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx, port = mp.get_context("spawn"), free_port()
    procs, pipes, out = [], [], []
    try:
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=rank_main, args=(rank, world, port, device, model, rounds, eager, writer),
                                     daemon=True))
            procs[-1].start()
            writer.close()
            pipes.append(reader)
        pending, deadline = list(pipes), time.monotonic() + WATCHDOG_S
        while pending:
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(pending)} of {world} ranks did not report within {WATCHDOG_S:.0f} s")
            for conn in ready:
                pending.remove(conn)
                try:
                    kind, data = conn.recv()
                except EOFError:
                    raise RuntimeError("a rank died without reporting") from None
                if kind == "error":
                    raise RuntimeError(f"a rank failed:\n{data}")
                out.append(data)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        for c in pipes:
            c.close()
    return out


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every GPU, or 2 on the CPU)")
    ap.add_argument("--model", action="append", help="qwen2.5-7b, qwen3-30b-a3b, small, tiny-dense, tiny-moe")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="only the JSON lines")
    ap.add_argument("--eager", action="store_true",
                    help="NCCL initialized eagerly (device_id): every point-to-point operation on the one communicator")
    args = ap.parse_args(argv)
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    rows = []
    for model in args.model or (["qwen2.5-7b", "qwen3-30b-a3b", "small"] if args.device == "cuda"
                                else ["tiny-dense", "tiny-moe", "small"]):
        rows.append(run(model, world, args.device, args.rounds, args.eager))
        print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        cols = ["model", "world", "tensors", "GB", "busiest_pull_GB", "bound_s", "windows_s", "one_at_a_time_s",
                "full_tensor_s", "windows_over_bound", "one_at_a_time_over_windows", "full_tensor_over_windows", "right"]
        table = Table(*cols)
        for row in rows:
            table.add_row(*(str(row[c]) for c in cols))
        Console().print(table)
    return 0 if all(r["right"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
