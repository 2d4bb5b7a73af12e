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
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from weightsync.engine.transforms.layouts import FP8Policy, TensorParallel, allocate, receiver_layout  # noqa: E402
from weightsync.engine.datapath.tensors import dtype_name  # noqa: E402
from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender  # noqa: E402


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
    summary = {}
    async with contextlib.AsyncExitStack() as stack:
        ctl = await stack.enter_async_context(Controller(senders=1, receivers=len(layouts), options=options))
        sender = await stack.enter_async_context(WeightSender(ctl.address, model, rank=0))
        receivers = {}
        for rank, (label, layout) in enumerate(layouts.items()):
            tensors, shards = allocate(layout)
            receivers[label] = await stack.enter_async_context(
                WeightReceiver(ctl.address, tensors, rank=rank, shards=shards))
        for step in range(1, steps + 1):
            with torch.no_grad():  # stands in for an optimizer step
                for p in model.parameters():
                    p.mul_(0.5)
            handle = await sender.push(step)
            await handle
            report = await ctl.wait_round(step)
            summary[step] = {"ms": round(report.seconds * 1e3, 1), "bytes": report.nbytes}
        for label, r in receivers.items():
            state = r.state_dict()
            fp8 = sum(1 for t in state.values() if t.dtype == torch.float8_e4m3fn)
            summary[label] = {"tensors": len(state), "fp8": fp8, "version": r.version,
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
