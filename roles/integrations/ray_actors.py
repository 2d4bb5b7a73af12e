"""Ray: the controller as an actor, and mixins that make your trainer and inference actors weightsync peers.

Use (``pip install 'weightsync[ray]'``)::

    controller = ray.remote(ControllerActor).remote(senders=2, receivers=4)
    address = ray.get(controller.start.remote())

    @ray.remote
    class Trainer(RaySender):            # your actor: it holds the model and trains it
        def __init__(self):
            self.model = build_model()
        def weightsync_params(self):     # what it pushes (default: self.model)
            return self.model

    trainers = [Trainer.remote() for _ in range(2)]
    ray.get([t.weightsync_start.remote(address, rank) for rank, t in enumerate(trainers)])
    ray.get([t.weightsync_push.remote(1) for t in trainers])   # every sender pushes each version

How this works. Each method is ``async``, so Ray runs the actor as an async actor: its event loop is the
one the controller, sender or receiver lives on, and other calls on the actor (a training step, a
generation) interleave with the transfer. Ranks are given by the caller (Ray has no rank of its own);
addresses travel as plain strings through Ray; the controller binds loopback unless given a
``bind_addr`` (on a multi-node cluster: the node's IP, with an ``auth_key`` that you hand to every peer).
Receivers are shadow-mode by default, so inference on the actor reads one whole version at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from weightsync.engine.datapath.tensors import Params

from ..controller import Controller, ControllerOptions
from ..receiver import ReceiverOptions, WeightReceiver
from ..sender import SenderOptions, WeightSender


def _report(report: Any) -> dict:
    return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}


class ControllerActor:
    """The controller in an actor of its own (``ray.remote(ControllerActor)``)."""

    def __init__(self, *, senders: int, receivers: int, bind_addr: str = "tcp://127.0.0.1:0",
                 options: ControllerOptions = ControllerOptions()) -> None:
        self.controller = Controller(bind_addr, senders=senders, receivers=receivers, options=options)

    async def start(self) -> str:
        await self.controller.start()
        return self.controller.address

    async def wait_round(self, version: int) -> dict:
        return _report(await self.controller.wait_round(version))

    def status(self) -> dict:
        return {"address": self.controller.address, "committed": self.controller.committed,
                "peers": sorted(p.name for p in self.controller.peers.values()),
                "rounds": len(self.controller.reports)}

    async def close(self) -> None:
        await self.controller.close()


class RaySender:
    """Mixin for a trainer actor: ``weightsync_start``, ``weightsync_push``, ``weightsync_close``."""

    _weightsync_sender: Optional[WeightSender] = None

    def weightsync_params(self) -> Params:
        return self.model  # type: ignore[attr-defined]

    async def weightsync_start(self, controller: str, rank: int, options: SenderOptions = SenderOptions(),
                               auth_key: Optional[bytes] = None) -> None:
        if auth_key is not None:
            options = dataclasses.replace(options, auth_key=auth_key)
        self._weightsync_sender = WeightSender(controller, self.weightsync_params(), rank=rank, options=options)
        await self._weightsync_sender.start()

    async def weightsync_push(self, version: int) -> dict:
        """Push this rank's part of ``version`` and wait for the global commit; returns what it sent."""
        handle = await self._weightsync_sender.push(version)
        report = handle.released.result()
        await handle
        return {"version": version, "bytes": report.nbytes, "seconds": report.seconds}

    async def weightsync_close(self) -> None:
        if self._weightsync_sender is not None:
            await self._weightsync_sender.close()


class RayReceiver:
    """Mixin for an inference actor: ``weightsync_start``, ``weightsync_wait``, ``weightsync_status``,
    ``weightsync_close``; ``weightsync_params`` (default ``self.model``) is what it receives into."""

    _weightsync_receiver: Optional[WeightReceiver] = None

    def weightsync_params(self) -> Params:
        return self.model  # type: ignore[attr-defined]

    async def weightsync_start(self, controller: str, rank: int, options: ReceiverOptions = ReceiverOptions(),
                               auth_key: Optional[bytes] = None, **receiver_kwargs: Any) -> None:
        if auth_key is not None:
            options = dataclasses.replace(options, auth_key=auth_key)
        self._weightsync_receiver = WeightReceiver(controller, self.weightsync_params(), rank=rank,
                                                   options=options, **receiver_kwargs)
        await self._weightsync_receiver.start()

    async def weightsync_wait(self, version: int) -> int:
        return await self._weightsync_receiver.wait_for(version)

    def weightsync_status(self) -> dict:
        r = self._weightsync_receiver
        return {"rank": r.rank, "version": r.version, "committed": r.rounds_committed,
                "aborted": r.rounds_aborted, "dirty": r.dirty, "mode": r.mode}

    async def weightsync_close(self) -> None:
        if self._weightsync_receiver is not None:
            await self._weightsync_receiver.close()
