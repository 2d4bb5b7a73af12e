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
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parent)]

import torch  # noqa: E402

from weightsync.engine.dtypes import dtype_name  # noqa: E402
from weightsync.engine.transforms import within_fp8_bound  # noqa: E402
from weightsync.engine.transforms.layouts import ExpertParallel, FP8Policy, receiver_layout  # noqa: E402
from weightsync.roles import ControllerOptions  # noqa: E402

from harness import print_summary, push_rounds  # noqa: E402

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
    layouts = {f"ep{rank}/{RANKS}": receiver_layout(shapes, ep=ExpertParallel(rank, RANKS), fp8=FP8Policy())
               for rank in range(RANKS)}
    trainer = model.state_dict()  # (the same tensors as the model's: their values after the last step)

    def describe(label: str, state: dict) -> dict:
        rank = int(label[2:].split("/")[0])
        experts = [n for n, t in state.items() if ".experts." in n and t.dtype == torch.float8_e4m3fn]
        each = trainer[experts[0]].shape[0] // RANKS
        return {"expert_stacks": [list(state[n].shape) for n in experts[:2]],
                "experts_within_fp8_bound": all(
                    within_fp8_bound(trainer[n][rank * each:(rank + 1) * each], state[n], state[n + "_scale_inv"])
                    for n in experts)}

    return await push_rounds(model, layouts, ControllerOptions(checksum="crc32"), steps, describe)


def main() -> int:
    return print_summary(asyncio.run(run()), trainer_model())


if __name__ == "__main__":
    sys.exit(main())
