"""FSDP2 (DTensor) sources: local shards in the manifest, full tensors gathered per round under a budget.

How this works. ``split_dtensors`` replaces each DTensor parameter by its local tensor and a
``ShardSpec`` (the rows of the full tensor it holds, from DTensor's own placement arithmetic); the
sender declares those shards ``gatherable``, so the planner may give it any part of the parameter.

``Gatherer`` materializes full tensors for a round. ``full_tensor()`` is a collective: every rank of
the parameter's mesh must call it, in the same order. So every gatherable sender walks its DTensor
parameters in one fixed order (its manifest's, the model's) and gathers each, in a worker thread,
once per round; ranks whose routing table names the parameter keep the result until their last row of
it has been written, the others drop it at once. A ``ByteBudget`` bounds the bytes of full tensors
alive on this rank: the gather task waits before exceeding it. The pipeline takes rows of gathered
parameters in gather order (``order``), and waits for the gather before it takes pipeline budget, so a
lane blocked on a later gather never holds what an earlier one needs.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Mapping, Optional, Sequence

import torch

from wire import ShardSpec, Transfer

from .aio import ByteBudget
from .errors import ConfigError, StagingError


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed: no DTensor can exist
        return None
    return DTensor


def split_dtensors(tensors: Mapping[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec], dict[str, torch.Tensor]]:
    """-> (name -> local tensor, name -> ShardSpec, name -> DTensor) for DTensor entries; others pass."""
    cls = _dtensor_class()
    local, shards, dtensors = dict(tensors), {}, {}
    if cls is None:
        return local, shards, dtensors
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, t in tensors.items():
        if not isinstance(t, cls):
            continue
        full = tuple(t.shape)
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if not full:
            raise ConfigError("params", f"{name}: a 0-d DTensor has no rows to shard")
        if any(offset[d] != 0 or shape[d] != full[d] for d in range(1, len(full))):
            raise ConfigError("params", f"{name}: placements {t.placements} cut dims other than 0; weightsync "
                                        f"takes FSDP2-style dim-0 shards")
        local[name] = t.to_local().detach()
        shards[name] = ShardSpec(full, 0, offset[0], offset[0] + shape[0])
        dtensors[name] = t
    return local, shards, dtensors


class Gatherer:
    """Full tensors of DTensor parameters for one round, gathered in a fixed order under ``budget_bytes``."""

    def __init__(self, dtensors: Mapping[str, torch.Tensor], budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ConfigError("gather_budget_bytes", f"must be positive, got {budget_bytes}")
        self.dtensors = dict(dtensors)
        self.order = {name: i for i, name in enumerate(self.dtensors)}
        self.budget = ByteBudget(budget_bytes)
        self.uses: collections.Counter = collections.Counter()
        self.ready: dict[str, asyncio.Future] = {}
        self.gathered = 0
        self.peak_bytes = 0
        self.error: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None

    def __repr__(self) -> str:
        return f"<Gatherer params={len(self.dtensors)} gathered={self.gathered} {self.budget!r}>"

    def begin(self, transfers: Sequence[Transfer]) -> None:
        """Start this round's gathers; ``transfers`` say which results this rank keeps."""
        self.cancel()
        self.error = None
        self.budget = ByteBudget(self.budget.limit)
        self.uses = collections.Counter(t.name for t in transfers if t.name in self.dtensors)
        loop = asyncio.get_running_loop()
        self.ready = {name: loop.create_future() for name in self.uses}
        self._task = asyncio.ensure_future(self._run())

    def sort_key(self, t: Transfer) -> int:
        return self.order.get(t.name, -1)

    async def full(self, name: str) -> torch.Tensor:
        fut = self.ready.get(name)
        if fut is None:
            raise StagingError(name, "not gathered this round (the routing table did not name it)")
        return await asyncio.shield(fut)

    def release(self, name: str) -> None:
        """One row of ``name`` is written: drop the full tensor after the last."""
        if name not in self.uses:
            return
        self.uses[name] -= 1
        if self.uses[name] == 0:
            fut = self.ready.pop(name)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.budget.release(_nbytes(fut.result()))
            del self.uses[name]

    async def finish(self) -> None:
        """Wait for the rest of the round's gathers (other ranks of the mesh take part in them)."""
        if self._task is not None:
            await self._task
        if self.error is not None:
            raise StagingError("<gather>", f"gathering sharded parameters failed: {self.error!r}")

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for fut in self.ready.values():
            if not fut.done():
                fut.cancel()

    async def _run(self) -> None:
        try:
            for name, dt in self.dtensors.items():  # every rank of the mesh: same names, same order
                nbytes = dt.numel() * dt.element_size()
                await self.budget.acquire(nbytes)
                self.peak_bytes = max(self.peak_bytes, self.budget.in_use)
                full = await asyncio.to_thread(_gather, dt)
                self.gathered += 1
                fut = self.ready.get(name)
                if fut is None or fut.done():  # not ours to write (or the round is over): drop it now
                    del full
                    self.budget.release(nbytes)
                    continue
                fut.set_result(full)
        except BaseException as exc:
            self.error = exc
            for fut in self.ready.values():
                if not fut.done():
                    fut.set_exception(StagingError("<gather>", f"gathering sharded parameters failed: {exc!r}"))
            if not isinstance(exc, Exception):
                raise


def _gather(dt) -> torch.Tensor:
    full = dt.full_tensor()
    if full.device.type == "cuda":
        torch.cuda.current_stream(full.device).synchronize()  # in the worker thread, not on the loop
    return full.detach()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
