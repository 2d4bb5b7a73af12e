"""What the layout examples share: one in-process trainer pushing to receivers of given layouts.

``push_rounds`` starts a controller, a sender of ``model`` and a receiver per layout (loopback TCP),
runs ``steps`` rounds (each halving the weights, standing in for an optimizer step), and describes
each receiver once it holds the last version; ``print_summary`` prints what it returns.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from weightsync.engine.transforms.layouts import allocate
from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender


async def push_rounds(model: torch.nn.Module, layouts: dict[str, list], options: ControllerOptions, steps: int,
                      describe: Callable[[str, dict], dict]) -> dict:
    """Per step its round (ms, bytes); per layout label, ``describe(label, state)`` with the tensor and
    FP8 counts, bytes and version of that receiver."""
    summary: dict = {}
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
            await (await sender.push(step))
            report = await ctl.wait_round(step)
            summary[step] = {"ms": round(report.seconds * 1e3, 1), "bytes": report.nbytes}
        for label, r in receivers.items():
            await r.wait_for(steps)
            state = r.state_dict()
            summary[label] = {"tensors": len(state), "fp8": sum(t.dtype == torch.float8_e4m3fn for t in state.values()),
                              "version": r.version, **describe(label, state),
                              "bytes": sum(t.numel() * t.element_size() for t in state.values())}
    return summary


def print_summary(summary: dict, trainer: torch.nn.Module) -> int:
    trainer_bytes = sum(v.numel() * v.element_size() for v in trainer.state_dict().values())
    print(f"trainer: {trainer_bytes / 1e6:.1f} MB of bf16 under transformers names")
    for key, row in summary.items():
        print(f"  {key}: {row}")
    return 0
