"""Started by ``torchrun`` in tests/integrations/test_torchrun.py: every rank is a sender, rank 0 runs the
controller and prints its address; each rank prints what it sent per version as JSON lines."""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import torch.distributed as dist

from weightsync.roles.integrations.torchrun import TorchrunSender

SHAPES = {f"layer{i}.weight": (64 + 32 * i, 48) for i in range(8)}


def expected(version: int) -> dict[str, torch.Tensor]:
    """The weights every rank holds after ``version`` optimizer steps (data parallel: identical)."""
    return {name: torch.full(shape, float(version * 100 + i)) for i, (name, shape) in enumerate(SHAPES.items())}


def say(record: dict) -> None:
    """One JSON line in one write (both ranks share the pipe)."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def main(steps: int, receivers: int) -> None:
    dist.init_process_group("gloo")
    tensors = expected(0)
    async with TorchrunSender(tensors, receivers=receivers, auth=True) as sync:
        rank = sync.placement.rank
        if rank == 0:
            say({"controller": sync.controller_address, "key": sync.auth_key.hex()})
        for version in range(1, steps + 1):
            for name, value in expected(version).items():
                tensors[name].copy_(value)
            handle = await sync.push(version)
            sent = handle.released.result().nbytes
            await handle
            say({"rank": rank, "version": version, "sent": sent})
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
