"""A trainer rank with an FSDP2-sharded model (gloo, CPU), for the FSDP source tests (spawned child)."""

from __future__ import annotations

import asyncio
import traceback

import torch

BUDGET = 1 << 20  # bytes of gathered full tensors alive at once: below the largest parameter (2 MB)


def qwen2_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def trained(state: dict, version: int) -> dict:
    """What the trainer holds at ``version``: the initial weights scaled, deterministically."""
    return {k: v * (1 + version) for k, v in state.items()}


def fsdp_sender_main(addr: str, rank: int, world: int, out, port: int, versions: list[int]) -> None:
    try:
        asyncio.run(_fsdp_sender(addr, rank, world, out, port, versions))
    except BaseException:
        out.send(("error", "sender", rank, traceback.format_exc()))


async def _fsdp_sender(addr, rank, world, out, port, versions) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.roles import SenderOptions, WeightSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = qwen2_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        options = SenderOptions(gather_budget_bytes=BUDGET)
        async with WeightSender(addr, model, rank=rank, options=options) as sender:
            out.send(("joined", "sender", rank, None))
            for v in versions:
                with torch.no_grad():
                    for p in model.parameters():  # a "training step": every rank scales its own shard
                        p.to_local().mul_((1 + v) / v if v > 1 else 1 + v)
                handle = await sender.push(v)
                await handle
                g = sender.sources.gatherer
                out.send(("committed", "sender", rank, (v, g.gathered, g.peak_bytes, handle.report.nbytes, g.exchanges)))
    finally:
        dist.destroy_process_group()


def gather_child_main(rank: int, world: int, port: int, out) -> None:
    """Two ranks, three sharded parameters: "a" needed by rank 0 only, "b" by both, "c" by none.
    Reports what each rank materialized and sent, and whether the full tensors it got are right."""
    try:
        asyncio.run(_gather_child(rank, world, port, out))
    except BaseException:
        out.send(("error", "gatherer", rank, traceback.format_exc()))


async def _gather_child(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.engine.transforms.gather import Gatherer, split_dtensors
    from weightsync.wire import Transfer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = {n: torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + k * 1000
                for k, (n, rows) in enumerate((("a", 5), ("b", 6), ("c", 7)))}  # 5 and 7 rows: uneven shards
        dtensors = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        _, shards, dts = split_dtensors(dtensors)
        gatherer = Gatherer(dts, 1 << 20, shards)
        wanted = ["a", "b"] if rank == 0 else ["b"]
        table = tuple(Transfer(i, n, None, 0, n, 0, 0, full[n].numel() * 4, "") for i, n in enumerate(wanted))
        right = await _rounds(gatherer, table, (table, table, list(table)), full)  # (one plan's table, another)
        out.send(("gathered", "gatherer", rank, (right, gatherer.gathered, gatherer.sent, gatherer.skipped,
                                                  gatherer.budget.in_use, gatherer.exchanges)))
    finally:
        dist.destroy_process_group()


# (name, rows, the ranks whose tables need its full tensor): rows of 64 float32s (256 bytes a row);
# "shared" is needed by two ranks, "all" by every rank (an all-gather), "none" by no rank
MANY = [("p0", 8, (0,)), ("p1", 9, (1,)), ("p2", 10, (2,)), ("p3", 11, (0,)), ("p4", 12, (1,)),
        ("p5", 13, (2,)), ("shared", 14, (0, 2)), ("all", 15, (0, 1, 2)), ("none", 16, ()),
        ("big0", 40, (0,)), ("big1", 41, (1,))]
MANY_BUDGET = 6 << 10  # bytes: a window takes half, one of the small ones a rank; a big one (10 KiB) alone


def gather_many_child_main(rank: int, world: int, port: int, out) -> None:
    """``world`` ranks, the parameters of ``MANY`` each needed by the ranks it names, under a budget
    that holds a few at once: each rank takes its full tensors in gather order and releases each as
    it checks it (as the pipeline does). Reports what it got and how it was gathered."""
    try:
        asyncio.run(_gather_many_child(rank, world, port, out))
    except BaseException:
        out.send(("error", "gatherer", rank, traceback.format_exc()))


async def _gather_many_child(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.engine.transforms import gather
    from weightsync.engine.transforms.gather import Gatherer, split_dtensors
    from weightsync.wire import Transfer

    gather.PACKED_BYTES = 2048  # both ways: the small ones' rows packed, each big one's by its own operation
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = {n: torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64) + k * 10_000
                for k, (n, rows, _) in enumerate(MANY)}
        dtensors = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        _, shards, dts = split_dtensors(dtensors)
        gatherer = Gatherer(dts, MANY_BUDGET, shards)
        wanted = sorted((n for n, _, ranks in MANY if rank in ranks), key=gatherer.order.__getitem__)
        table = tuple(Transfer(i, n, None, 0, n, 0, 0, full[n].numel() * 4, "") for i, n in enumerate(wanted))
        right = await _rounds(gatherer, table, (table, table), full)
        out.send(("gathered", "gatherer", rank, (right, gatherer.gathered, gatherer.windows, gatherer.peak_bytes,
                                                  gatherer.budget.in_use, gatherer.skipped)))
    finally:
        dist.destroy_process_group()


async def _rounds(gatherer, table: tuple, keys, full: dict) -> bool:
    """One round per key (``Gatherer.begin``'s): the full tensors of ``table``'s names taken in its order
    and released as each is checked against ``full``, as the pipeline takes them. Whether all were right."""
    right = True
    for key in keys:
        gatherer.begin(table, key=key)
        for t in table:
            right &= torch.equal(await gatherer.full(t.name), full[t.name])
            gatherer.release(t.name)
        await gatherer.finish()
    return right
