"""Trainer names and layout -> inference names and layout, on this machine (CPU, loopback TCP).

A Qwen2-style trainer (transformers names, bf16) pushes to three inference ranks shaped like vLLM's:
two tensor-parallel halves (fused ``qkv_proj`` / ``gate_up_proj``, column- and row-parallel shards)
and one full-model rank serving block FP8 (float8_e4m3fn weights + float32 ``weight_scale_inv``).
The controller is told the mapping; each receiver declares its own layout (``weightsync.engine.transforms.layouts``);
senders slice, fuse by addressing, transpose and quantize before writing.

    python examples/transforms_cpu.py
"""

from __future__ import annotations

import asyncio
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parent)]

import torch  # noqa: E402

from weightsync.engine.transforms.layouts import FP8Policy, TensorParallel, receiver_layout  # noqa: E402
from weightsync.engine.dtypes import dtype_name  # noqa: E402
from weightsync.roles import ControllerOptions  # noqa: E402

from harness import print_summary, push_rounds  # noqa: E402


def trainer_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


async def run(steps: int = 2) -> dict:
    model = trainer_model()
    shapes = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in model.state_dict().items()}
    layouts = {
        "tp0/2": receiver_layout(shapes, "qwen2", tp=TensorParallel(0, 2)),
        "tp1/2": receiver_layout(shapes, "qwen2", tp=TensorParallel(1, 2)),
        "fp8": receiver_layout(shapes, "qwen2", fp8=FP8Policy()),
    }
    options = ControllerOptions(checksum="crc32", mapping="qwen2")
    return await push_rounds(model, layouts, options, steps, lambda label, state: {})


def main() -> int:
    return print_summary(asyncio.run(run()), trainer_model())


if __name__ == "__main__":
    sys.exit(main())
