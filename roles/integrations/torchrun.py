"""torchrun (torch.distributed): senders that find their rank, device and controller by themselves.

Use it inside a training script started by ``torchrun`` (after ``dist.init_process_group``)::

    async with TorchrunSender(model, receivers=2) as sync:     # rank 0 also runs the controller
        print(sync.controller_address)                          # what inference processes join
        ...
        handle = await sync.push(step)                          # every rank, after its optimizer step

How this works. Every trainer rank is a ``WeightSender`` whose rank is its torch.distributed rank; the
world size is the number of senders. Unless ``controller_address`` is given, rank 0 starts the
``Controller`` and hands its address (and, with ``auth``, a fresh key) to the other ranks with one
``broadcast_object_list`` over the training job's own process group: nothing is set by hand, and the
key travels only over the channel the job already trusts. Data-parallel replicas each hold the whole
model; the planner splits the tensors among them so every rank sends a part. Closing waits at a
barrier until every rank's sender has left, then rank 0 closes the controller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
from typing import Any, Optional

import torch
import torch.distributed as dist

from weightsync.engine.datapath.tensors import Params
from weightsync.engine.errors import ConfigError

from ..controller import Controller, ControllerOptions
from ..sender import PushHandle, SenderOptions, WeightSender


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process sits in the job: from torch.distributed when initialised, else torchrun's env."""
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @classmethod
    def current(cls) -> "Placement":
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            try:
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            except KeyError as exc:
                raise ConfigError("RANK", "not under torchrun: torch.distributed is not initialised and "
                                          f"${exc.args[0]} is not set") from None
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank, world, local, device)


class TorchrunSender:
    """An async context manager: this rank's ``WeightSender`` (and, on rank 0, the ``Controller``)."""

    def __init__(self, params: Params, *, receivers: int, controller_address: Optional[str] = None,
                 controller_bind: str = "tcp://127.0.0.1:0", auth: bool = False,
                 controller_options: ControllerOptions = ControllerOptions(),
                 sender_options: SenderOptions = SenderOptions(), **sender_kwargs: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("torch.distributed", "call dist.init_process_group() before TorchrunSender")
        self.placement = Placement.current()
        self.params, self.receivers = params, receivers
        self.controller_address, self.controller_bind, self.auth = controller_address, controller_bind, auth
        self.controller_options, self.sender_options, self.sender_kwargs = controller_options, sender_options, sender_kwargs
        self.controller: Optional[Controller] = None
        self.sender: Optional[WeightSender] = None
        self.auth_key: Optional[bytes] = sender_options.auth_key

    def __repr__(self) -> str:
        p = self.placement
        return f"<TorchrunSender rank {p.rank}/{p.world} {p.device} controller={self.controller_address} {self.sender!r}>"

    async def __aenter__(self) -> "TorchrunSender":
        try:
            if self.controller_address is None:
                await self._rendezvous()
            options = dataclasses.replace(self.sender_options, auth_key=self.auth_key)
            self.sender = WeightSender(self.controller_address, self.params, rank=self.placement.rank,
                                       options=options, **self.sender_kwargs)
            await self.sender.start()
        except BaseException:
            await self._close_controller()
            raise
        return self

    async def _rendezvous(self) -> None:
        """Rank 0 starts the controller; every rank learns its address (and key) from rank 0."""
        box: list[Any] = [None, None]
        if self.placement.rank == 0:
            key = (self.controller_options.auth_key or secrets.token_bytes(32)) if self.auth else None
            options = dataclasses.replace(self.controller_options, auth_key=key)
            self.controller = Controller(self.controller_bind, senders=self.placement.world,
                                         receivers=self.receivers, options=options)
            await self.controller.start()
            box = [self.controller.address, key]
        await asyncio.to_thread(dist.broadcast_object_list, box, 0)
        self.controller_address, self.auth_key = box[0], box[1]

    async def push(self, version: int) -> PushHandle:
        """This rank's part of ``version`` (every rank pushes the same version; see ``WeightSender.push``)."""
        return await self.sender.push(version)

    def push_nowait(self, version: int) -> PushHandle:
        """Start this rank's part of ``version``; await ``handle.released`` before the weights change."""
        return self.sender.push_nowait(version)

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if self.sender is not None:
                await self.sender.close()
            if exc_type is None:  # (a failing rank does not wait: torchrun ends the job)
                await asyncio.to_thread(dist.barrier)  # every rank has left before the controller goes
        finally:
            await self._close_controller()

    async def _close_controller(self) -> None:
        if self.controller is not None:
            await asyncio.shield(self.controller.close())
            self.controller = None
