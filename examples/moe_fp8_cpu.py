"""An MoE trainer -> expert-parallel inference ranks serving block FP8, on this machine (CPU, loopback TCP).

A Qwen3-MoE-style trainer (transformers names, bf16, its experts fused into stacks [E, R, C]) pushes to
two expert-parallel inference ranks: each holds half of every layer's experts and serves the linear
weights and its experts in block FP8 (float8_e4m3fn + float32 ``*_scale_inv``, each expert matrix on
its own 128 x 128 grid, as DeepSeek-V3 / Kimi-K2 FP8 checkpoints and vLLM hold them); attention,
router and norms are whole on both. The sender quantizes what each rank holds, nothing more.

    python examples/moe_fp8_cpu.py
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from weightsync.engine.datapath.tensors import dtype_name  # noqa: E402
from weightsync.engine.transforms import within_fp8_bound  # noqa: E402
from weightsync.engine.transforms.layouts import ExpertParallel, FP8Policy, allocate, receiver_layout  # noqa: E402
from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender  # noqa: E402

RANKS = 2


def trainer_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, vocab_size=1000, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


async def run(steps: int = 2) -> dict:
    model = trainer_model()
    shapes = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in model.state_dict().items()}
    layouts = [receiver_layout(shapes, ep=ExpertParallel(rank, RANKS), fp8=FP8Policy()) for rank in range(RANKS)]
    summary: dict = {}
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(
            Controller(senders=1, receivers=RANKS, options=ControllerOptions(checksum="crc32")))
        sender = await stack.enter_async_context(WeightSender(ctl.address, model, rank=0))
        receivers = []
        for rank, layout in enumerate(layouts):
            tensors, shards = allocate(layout)
            receivers.append(await stack.enter_async_context(WeightReceiver(ctl.address, tensors, rank=rank, shards=shards)))
        for step in range(1, steps + 1):
            with torch.no_grad():  # stands in for an optimizer step
                for p in model.parameters():
                    p.mul_(0.5)
            await (await sender.push(step))
            report = await ctl.wait_round(step)
            summary[step] = {"ms": round(report.seconds * 1e3, 1), "bytes": report.nbytes}
        trainer = model.state_dict()
        for rank, r in enumerate(receivers):
            await r.wait_for(steps)
            state = r.state_dict()
            experts = [n for n, t in state.items() if ".experts." in n and t.dtype == torch.float8_e4m3fn]
            half = {n: trainer[n][rank * 4:(rank + 1) * 4] for n in experts}  # 8 experts, 4 a rank
            summary[f"ep{rank}/{RANKS}"] = {
                "version": r.version, "tensors": len(state),
                "fp8": sum(t.dtype == torch.float8_e4m3fn for t in state.values()),
                "expert_stacks": [list(state[n].shape) for n in experts[:2]],
                "experts_within_fp8_bound": all(within_fp8_bound(half[n], state[n], state[n + "_scale_inv"])
                                                for n in experts),
                "bytes": sum(t.numel() * t.element_size() for t in state.values())}
    return summary


def main() -> int:
    summary = asyncio.run(run())
    trainer_bytes = sum(v.numel() * v.element_size() for v in trainer_model().state_dict().values())
    print(f"trainer: {trainer_bytes / 1e6:.1f} MB of bf16 under transformers names")
    for key, row in summary.items():
        print(f"  {key}: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
