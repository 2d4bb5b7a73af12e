"""FSDP2 (DTensor) sources: local shards in the manifest, full tensors gathered per round under a budget.

How this works. ``split_dtensors`` replaces each DTensor parameter by its local tensor and a
``ShardSpec`` (the rows of the full tensor it holds, from DTensor's own placement arithmetic); the
sender declares those shards ``gatherable``, so the planner may give it any part of the parameter.

``Gatherer`` materializes full tensors for a round, only on the ranks whose routing table names them.
Every rank of a mesh must take part in the same collectives in the same order, but each knows only its
own table. So the first round of a plan starts with one small all-gather per mesh (``_exchange``, in a
worker thread): each rank says, per DTensor parameter of the mesh, whether it needs the full tensor and
which rows it holds. Its answer holds for every round of that plan (``begin``'s ``key``: the table; a
new plan gives every rank a new table, so all ranks exchange again together), and so does the list of
parameters some rank needs. Then every rank walks those parameters in one fixed order (the model's):
a parameter nobody needs costs nothing; one every rank needs is ``full_tensor()`` (an all-gather);
otherwise each holder sends its rows to each rank that needs them and only those allocate the full
tensor (``_gather_to``, point-to-point). A mesh that is not 1-D with a dim-0 ``Shard`` falls back to ``full_tensor()`` on
every rank, dropped at once where not needed. A ``ByteBudget`` bounds the bytes of full tensors alive
on this rank: the gather task waits before exceeding it. The pipeline takes rows of gathered
parameters in gather order (``order``), and waits for the gather before it takes pipeline budget, so a
lane blocked on a later gather never holds what an earlier one needs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
from typing import Mapping, Optional, Sequence

import torch

from weightsync.wire import ShardSpec, Transfer

from ..datapath.aio import ByteBudget
from ..errors import ConfigError, StagingError


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
    """Full tensors of DTensor parameters for one round, gathered in a fixed order under ``budget_bytes``,
    only on the ranks that need them."""

    def __init__(self, dtensors: Mapping[str, torch.Tensor], budget_bytes: int,
                 shards: Mapping[str, ShardSpec] = {}) -> None:
        if budget_bytes <= 0:
            raise ConfigError("gather_budget_bytes", f"must be positive, got {budget_bytes}")
        self.dtensors = dict(dtensors)
        self.shards = dict(shards)  # name -> the rows this rank holds (from split_dtensors)
        self.order = {name: i for i, name in enumerate(self.dtensors)}
        self.budget = ByteBudget(budget_bytes)
        self.uses: collections.Counter = collections.Counter()
        self.ready: dict[str, asyncio.Future] = {}
        self.gathered = 0  # full tensors materialized on this rank
        self.sent = 0  # local shards sent to the ranks that needed them
        self.skipped = 0  # parameters no rank needed in a round
        self.peak_bytes = 0
        self.error: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None
        self.exchanges = 0  # needs exchanged (once per plan: see ``begin``)
        self._needs_key: object = None
        self._needs: Optional[concurrent.futures.Future] = None  # -> (needs, the names some rank needs)

    def __repr__(self) -> str:
        return (f"<Gatherer params={len(self.dtensors)} gathered={self.gathered} sent={self.sent} "
                f"skipped={self.skipped} {self.budget!r}>")

    def begin(self, transfers: Sequence[Transfer], key: object = None) -> None:
        """Start this round's gathers; ``transfers`` say which results this rank needs. ``key`` (the
        plan's table, the same object every round of a plan): the needs exchanged for it are reused;
        None exchanges every round."""
        self.cancel()
        self.error = None
        self.budget = ByteBudget(self.budget.limit)
        self.uses = collections.Counter(t.name for t in transfers if t.name in self.dtensors)
        loop = asyncio.get_running_loop()
        self.ready = {name: loop.create_future() for name in self.uses}
        self._task = asyncio.ensure_future(self._run(self._needs_for(key)))

    def _needs_for(self, key: object) -> concurrent.futures.Future:
        """This plan's needs: the exchange already made (or under way) for ``key``, else a new one. The
        exchange is a collective, so a round cancelled while it runs leaves it to finish in its thread
        and the next round takes its answer (every rank made the same call)."""
        cached = self._needs
        failed = cached is not None and cached.done() and (cached.cancelled() or cached.exception() is not None)
        if key is None or key is not self._needs_key or cached is None or failed:
            self.exchanges += 1
            self._needs_key = key
            self._needs = _EXCHANGES.submit(_exchange, self.dtensors, self.shards, set(self.uses))
        return self._needs

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

    async def _run(self, exchange: concurrent.futures.Future) -> None:
        try:
            needs, wanted = await asyncio.shield(asyncio.wrap_future(exchange))  # (a cancelled round leaves it be)
            self.skipped += len(self.dtensors) - len(wanted)
            for name in wanted:  # every rank of the mesh: same names, same order
                await self._gather_one(name, self.dtensors[name], needs[name])
        except BaseException as exc:
            self.error = exc
            for fut in self.ready.values():
                if not fut.done():
                    fut.set_exception(StagingError("<gather>", f"gathering sharded parameters failed: {exc!r}"))
            if not isinstance(exc, Exception):
                raise

    async def _gather_one(self, name: str, dt, need: Optional["_Need"]) -> None:
        everyone = need is None or len(need.ranks) == len(need.rows)  # an all-gather: full_tensor()
        materializes = everyone or name in self.uses
        nbytes = dt.numel() * dt.element_size()
        if materializes:
            await self.budget.acquire(nbytes)
            self.peak_bytes = max(self.peak_bytes, self.budget.in_use)
        if everyone:
            full = await asyncio.to_thread(_gather, dt)
        else:
            full = await asyncio.to_thread(_gather_to, dt, need, materializes)
            start, stop = need.rows[need.me]
            self.sent += len([r for r in need.ranks if r != need.me]) if stop > start else 0
        if not materializes:
            return
        self.gathered += 1
        fut = self.ready.get(name)
        if fut is None or fut.done():  # not ours to write (or the round is over): drop it now
            del full
            self.budget.release(nbytes)
            return
        fut.set_result(full)


@dataclasses.dataclass
class _Need:
    """Who needs one parameter's full tensor this round (ranks of its mesh's group) and which rows
    each rank holds; ``me`` is this rank in that group."""

    group: object
    me: int
    ranks: list[int]
    rows: list[tuple[int, int]]


_EXCHANGES = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-gather-needs")


def _exchange(dtensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec],
              needed: set) -> tuple[dict[str, Optional[_Need]], list[str]]:
    """One all-gather per 1-D dim-0-sharded mesh: per parameter, (needed here, first row, end row).
    Blocking (a worker thread). None for parameters of other meshes: every rank all-gathers those.
    Also returns the names some rank needs, in the model's order."""
    import torch.distributed as dist

    out: dict[str, Optional[_Need]] = {}
    by_group: dict[int, tuple[object, list[str]]] = {}
    groups: dict[int, object] = {}  # id(mesh) -> its group (asking a mesh is slow; a model has few)
    for name, dt in dtensors.items():
        group = _group_of(dt, shards.get(name), groups)
        if group is None:
            out[name] = None
        else:
            by_group.setdefault(id(group), (group, []))[1].append(name)
    for group, names in by_group.values():  # (the same order on every rank: the model's)
        device = dtensors[names[0]].to_local().device
        mine = torch.tensor([[int(n in needed), shards[n].start, shards[n].stop] for n in names],
                            dtype=torch.int64, device=device)
        world = dist.get_world_size(group)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        table = torch.stack(everyone).cpu().tolist()  # [rank][param] -> (needed, start, stop)
        me = dist.get_rank(group)
        for i, name in enumerate(names):
            out[name] = _Need(group, me, [r for r in range(world) if table[r][i][0]],
                              [(table[r][i][1], table[r][i][2]) for r in range(world)])
    return out, [n for n in dtensors if out[n] is None or out[n].ranks]


def _group_of(dt, shard: Optional[ShardSpec], groups: dict):
    """The process group of a DTensor sharded along dim 0 on a 1-D mesh, else None."""
    from torch.distributed.tensor import Shard

    mesh = dt.device_mesh
    if shard is None or mesh.ndim != 1 or tuple(dt.placements) != (Shard(0),):
        return None
    group = groups.get(id(mesh))
    if group is None:
        group = groups[id(mesh)] = mesh.get_group()
    return group


def _gather_to(dt, need: _Need, mine: bool) -> Optional[torch.Tensor]:
    """Point-to-point: every holder sends its rows to each rank that needs the full tensor; only those
    allocate it. Blocking (a worker thread)."""
    import torch.distributed as dist

    local = dt.to_local().detach().contiguous()
    full = torch.empty(tuple(dt.shape), dtype=dt.dtype, device=local.device) if mine else None
    works = []
    for r, (start, stop) in enumerate(need.rows):
        if not mine or stop <= start:
            continue
        if r == need.me:
            full.narrow(0, start, stop - start).copy_(local)
        else:
            works.append(dist.irecv(full.narrow(0, start, stop - start), src=dist.get_global_rank(need.group, r),
                                    group=need.group))
    if local.numel():
        for r in need.ranks:
            if r != need.me:
                works.append(dist.isend(local, dst=dist.get_global_rank(need.group, r), group=need.group))
    for work in works:
        work.wait()
    if local.device.type == "cuda":
        torch.cuda.current_stream(local.device).synchronize()  # in the worker thread, not on the loop
    return full.detach() if full is not None else None


def _gather(dt) -> torch.Tensor:
    full = dt.full_tensor()
    if full.device.type == "cuda":
        torch.cuda.current_stream(full.device).synchronize()  # in the worker thread, not on the loop
    return full.detach()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
