"""FSDP2 sources: two gloo trainer processes with DTensor parameters -> TP-fused and FP8 receivers."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from children import Children, free_port
from weightsync.engine.dtypes import dtype_name
from weightsync.engine.transforms.layouts import FP8_EXCLUDE, FP8Policy, TensorParallel, allocate, receiver_layout
from fsdp_helpers import BUDGET, fsdp_sender_main, qwen2_model, trained
from layout_oracle import check_fp8_receiver, expected_qwen2
from weightsync.roles import Controller, ControllerOptions, WeightReceiver

WATCHDOG = 120


async def test_fsdp2_trainers_to_tp_and_fp8_receivers():
    initial = {k: v.detach().clone() for k, v in qwen2_model().state_dict().items()}
    shapes = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in initial.items()}
    tp = TensorParallel(1, 2)
    layouts = [receiver_layout(shapes, "qwen2", tp=tp),
               receiver_layout(shapes, "qwen2", fp8=FP8Policy()),
               receiver_layout(shapes, "qwen2", tp=tp, fp8=FP8Policy(exclude=FP8_EXCLUDE + (r".*qkv_proj.*",)))]
    # (TP 2 leaves this model's k/v 64 rows a rank: too few to keep fused FP8 blocks apart, so qkv stays bf16)
    options = ControllerOptions(heartbeat_s=0.1, timeout_s=20.0, checksum="crc32", mapping="qwen2", delta="always")
    children = Children()
    try:
        async with contextlib.AsyncExitStack() as stack:
            ctl = await stack.enter_async_context(Controller(senders=2, receivers=3, options=options))
            receivers = []
            for r, layout in enumerate(layouts):
                tensors, shards = allocate(layout)
                receivers.append(await stack.enter_async_context(
                    WeightReceiver(ctl.address, tensors, rank=r, shards=shards)))
            port = free_port()
            for rank in range(2):
                children.start("sender", rank, fsdp_sender_main, ctl.address, rank, 2, port, [1, 2])
            for v in (1, 2):
                done = await children.expect("committed", 2)
                for r in receivers:
                    await asyncio.wait_for(r.wait_for(v), WATCHDOG)
                want = trained(initial, v)
                _check_receivers(receivers, tp, want)
                largest = max(t.numel() * t.element_size() for t in initial.values())
                if v == 1:  # (asked in the first round: the children leave after the last)
                    needs = _gathers_per_round(ctl)
                    # the TP receivers (row-parallel slices as blocks, FP8 ones too) need no gather;
                    assert _rows_outside_shards(ctl, receiver=0) == []  # the whole-tensor FP8 one only where a
                    assert _rows_outside_shards(ctl, receiver=2) == []  # 128-row block spans both ranks' rows
                    outside = _rows_outside_shards(ctl, receiver=1)  # (k/v: 128 rows, 64 a rank)
                    assert outside and all(".k_proj." in n or ".v_proj." in n for n in outside), outside
                # rows inside a rank's own shard go shard-to-shard; the rest is gathered
                assert sum(needs.values()) < len(done) * len(initial)
                for _, _, rank, (version, gathered, peak, nbytes, exchanges) in done:
                    assert version == v and gathered == v * needs[rank]  # what its table needs, once a round
                    assert exchanges == 1  # who needs what is exchanged once per plan, not every round
                    assert peak <= max(BUDGET, largest)  # the budget held: never two big tensors at once
                    assert nbytes > 0  # both FSDP ranks write their share
                held = sum(t.numel() * t.element_size() for r in receivers for t in r.state_dict().values())
                moved = sum(d[3][3] for d in done)
                if v == 1:
                    assert moved == held  # only what the receivers hold moved
                else:  # the receivers hold v1: their changes, as deltas (of the FP8 bytes for FP8 rows), checked
                    assert moved < held  # by crc32 against the senders' bytes
    finally:
        children.close()


def _gathers_per_round(ctl) -> dict[int, int]:
    """Per sender: the parameters its table reads outside its own FSDP shard (each gathered once a round)."""
    from weightsync.wire import Role

    out = {}
    for peer in ctl.peers.values():
        if peer.hello.role is not Role.SENDER:
            continue
        shards = {t.name: t.shard for t in peer.hello.manifest.tensors}
        rank = peer.hello.rank
        outside = {t.name for t in ctl.plan.senders[rank].transfers
                   if shards[t.name] is None or not shards[t.name].covers(t.slice)}
        out[rank] = len(outside)
    return out


def _rows_outside_shards(ctl, receiver: int) -> list[str]:
    """The names of rows bound for ``receiver`` that a sender reads outside its own FSDP shard."""
    from weightsync.wire import Role

    out = []
    for peer in ctl.peers.values():
        if peer.hello.role is Role.SENDER:
            shards = {t.name: t.shard for t in peer.hello.manifest.tensors}
            out += [t.name for t in ctl.plan.senders[peer.hello.rank].transfers
                    if t.dst_rank == receiver and (shards[t.name] is None or not shards[t.name].covers(t.slice))]
    return out


def _check_receivers(receivers, tp, want) -> None:
    for name, got in receivers[0].state_dict().items():
        assert torch.equal(got, expected_qwen2(want, name, tp)), name
    quantized = check_fp8_receiver(receivers[1].state_dict(), lambda n: expected_qwen2(want, n))
    assert quantized and not any("norm" in n or "embed" in n or "lm_head" in n for n in quantized)
    quantized = check_fp8_receiver(receivers[2].state_dict(), lambda n: expected_qwen2(want, n, tp))
    assert any("o_proj" in n for n in quantized) and any("down_proj" in n for n in quantized)


async def test_full_tensors_exist_only_on_the_ranks_whose_table_names_them():
    from fsdp_helpers import gather_child_main

    reports = await _gatherers(gather_child_main, 2)
    # over three rounds: (right, materialized, shards sent, skipped, budget left in use, needs exchanged)
    assert reports[0] == (True, 6, 0, 3, 0, 2)  # "a" gathered point-to-point, "b" all-gathered, "c" by nobody
    assert reports[1] == (True, 3, 3, 3, 0, 2)  # only "b" materialized here; its rows of "a" sent to rank 0
    # (needs are exchanged once for the first table's two rounds, again for the second table)


async def test_ranks_gather_different_parameters_at_once_within_their_budgets():
    from fsdp_helpers import MANY, gather_many_child_main

    reports = await _gatherers(gather_many_child_main, 3)
    assert len(MANY) == 11
    # over two rounds: (right, materialized, windows, budget left in use, skipped). Smallest first, at
    # most half of each rank's 6 KiB a window (the next one posted while it is taken), the windows are
    # (p0 p1 p2), (p3 p4 p5), (shared), (all: an all-gather), (big0 big1: each over the budget, alone on
    # its rank, both at once): 5 a round for 9 parameters, where one parameter at a time took 9
    assert {r: d[:3] + d[4:] for r, d in reports.items()} == {
        0: (True, 10, 10, 0, 2),  # p0 p3 shared all big0
        1: (True, 8, 10, 0, 2),  # p1 p4 all big1
        2: (True, 8, 10, 0, 2),  # p2 p5 shared all
    }
    peak = {r: d[3] for r, d in reports.items()}
    assert peak[0] == 10240 and peak[1] == 10496  # a big one alone: nothing else while it is alive
    assert 3840 <= peak[2] <= 6 << 10  # within its budget ("all", 3840 bytes, at least)


async def _gatherers(main, world: int) -> dict:
    """``world`` gloo processes running ``main(rank, world, port, out)``: each one's report, by rank."""
    children = Children()
    try:
        port = free_port()
        for rank in range(world):
            children.start("gatherer", rank, main, rank, world, port)
        return {rank: data for _, _, rank, data in await children.expect("gathered", world)}
    finally:
        children.close()
