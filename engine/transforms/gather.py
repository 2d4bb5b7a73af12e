"""FSDP2 (DTensor) sources: local shards in the manifest, full tensors gathered per round under a budget.

How this works. ``split_dtensors`` replaces each DTensor parameter by its local tensor and a
``ShardSpec`` (the rows of the full tensor it holds, from DTensor's own placement arithmetic); the
sender declares those shards ``gatherable``, so the planner may give it any part of the parameter.

``Gatherer`` materializes full tensors for a round, only on the ranks whose routing table names them.
Every rank of a mesh must take part in the same collectives in the same order, but each knows only its
own table. So the first round of a plan starts with one small all-gather per mesh (``_exchange``, in a
worker thread): each rank says, per DTensor parameter of the mesh, whether it needs the full tensor and
which rows it holds (and its budget). Its answer holds for every round of that plan (``begin``'s
``key``: the table; a new plan gives every rank a new table, so all ranks exchange again together).

Then every rank walks the parameters some rank needs in one order, the smallest first (``order``), cut
into the same windows (``gather_windows``: pure, on the exchanged answers): consecutive parameters of
one mesh and one size class (at most twice the window's smallest), as many as fit half the budget of
every rank that needs some of them. A window is gathered at
once: each holder sends its rows to each rank that needs the full tensor, only those allocate it, and a
rank posts all its operations of the window as one batch (``batch_isend_irecv``: one NCCL group), the
rows of small parameters packed into one operation per peer (``PACKED_BYTES``). The windows are cut
once per plan (``_windows``: its rounds reuse them), and rows move as bytes, the shards' byte views made
once (``local_bytes``): a round's host work per parameter is its allocation and a few views.
So different ranks pull different parameters at the same time, each over its own link, as the
planner's model has them, not one parameter after the other. One thread posts the windows in order
(``_POSTS``), so every pair of ranks matches its operations; the next window is posted while the last
completes, as soon as this rank's budget has room. A parameter every rank needs is ``full_tensor()``
(an all-gather), alone in its window; one nobody needs costs nothing; a mesh that is not 1-D with a
dim-0 ``Shard`` falls back to ``full_tensor()`` on every rank, dropped at once where not needed.
A ``ByteBudget`` bounds the bytes of full tensors alive on this rank: a window waits before exceeding
it. The pipeline takes rows of gathered parameters in gather order, and waits for the gather before
it takes pipeline budget, so a lane blocked on a later gather never holds what an earlier one needs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Mapping, Optional, Sequence

import torch

from weightsync.wire import ShardSpec, Transfer

from ..aio import ByteBudget
from ..plan.windows import Need, gather_windows
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
        self.locals = {name: dt.to_local().detach() for name, dt in self.dtensors.items()}  # (views: live)
        self.local_bytes = {name: _as_bytes(t) for name, t in self.locals.items() if t.is_contiguous()}  # (the same)
        self.sizes = {name: _nbytes(dt) for name, dt in self.dtensors.items()}
        # the gather order, the same on every rank of a mesh: the smallest first (the planner's
        # tables assume a rank's shortest gathers first), the model's order at a tie
        ranked = sorted(enumerate(self.dtensors), key=lambda e: (self.sizes[e[1]], e[0]))
        self.order = {name: i for i, (_, name) in enumerate(ranked)}
        self.budget = ByteBudget(budget_bytes)
        self.uses: collections.Counter = collections.Counter()
        self.ready: dict[str, asyncio.Future] = {}
        self.gathered = 0  # full tensors materialized on this rank
        self.sent = 0  # local shards sent to the ranks that needed them
        self.skipped = 0  # parameters no rank needed in a round
        self.windows = 0  # windows gathered (each at once: ``gather_windows``)
        self.peak_bytes = 0
        self.error: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None
        self.exchanges = 0  # needs exchanged (once per plan: see ``begin``)
        self._needs_key: object = None
        self._needs: Optional[concurrent.futures.Future] = None  # -> each parameter's ``Need``
        self._program: tuple = (None, [], 0)  # (needs, [(window, mine, its bytes)], parameters no rank needs)

    def __repr__(self) -> str:
        return (f"<Gatherer params={len(self.dtensors)} gathered={self.gathered} sent={self.sent} "
                f"skipped={self.skipped} windows={self.windows} {self.budget!r}>")

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
            self._needs = _EXCHANGES.submit(_exchange, self.dtensors, self.shards, set(self.uses), self.budget.limit)
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
        posted: asyncio.Queue = asyncio.Queue()  # (window, its post): bounded by the budget, not by length
        waiter = asyncio.ensure_future(self._complete(posted))
        try:
            needs = await asyncio.shield(asyncio.wrap_future(exchange))  # (a cancelled round leaves it be)
            windows, skipped = self._windows(needs)
            self.skipped += skipped
            loop = asyncio.get_running_loop()
            for window, mine, nbytes in windows:  # every rank of the mesh: the same windows
                if mine:
                    await self.budget.acquire(nbytes)
                    self.peak_bytes = max(self.peak_bytes, self.budget.in_use)
                post = loop.run_in_executor(_POSTS, _post, self, needs, window, mine)
                posted.put_nowait((window, mine, post))  # (posts keep their order: one thread takes them)
            posted.put_nowait(None)
            await asyncio.shield(waiter)
        except BaseException as exc:
            self._fail(exc)
            waiter.cancel()
            if not isinstance(exc, Exception):
                raise

    def _windows(self, needs: Mapping[str, Optional[Need]]) -> tuple[list[tuple[tuple[str, ...], frozenset, int]], int]:
        """This plan's windows (``gather_windows``), each with the parameters this rank materializes and
        their bytes; and how many parameters no rank needs. Made once per exchange (its rounds reuse it)."""
        if self._program[0] is not needs:
            wanted = sorted((n for n, need in needs.items() if need is None or need.ranks), key=self.order.__getitem__)
            windows = []
            for window in gather_windows(wanted, self.sizes, needs):
                mine = frozenset(n for n in window if needs[n] is None or needs[n].me in needs[n].ranks)
                windows.append((window, mine, sum(self.sizes[n] for n in mine)))
            self._program = (needs, windows, len(self.dtensors) - len(wanted))
        return self._program[1], self._program[2]

    async def _complete(self, posted: asyncio.Queue) -> None:
        """Each window's gathers, in order, as they complete: its full tensors to the rows waiting."""
        try:
            while (item := await posted.get()) is not None:
                window, mine, post = item
                fulls, works, staged, sent = await asyncio.wrap_future(post)
                await asyncio.to_thread(_wait, works, staged, self.locals[window[0]].device)
                self.sent += sent
                self.gathered += len(mine)
                self.windows += 1
                for name in mine:
                    fut = self.ready.get(name)
                    if fut is None or fut.done():  # not ours to write (or the round is over): drop it now
                        self.budget.release(_nbytes(fulls.pop(name)))
                    else:
                        fut.set_result(fulls.pop(name))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        self.error = self.error or exc
        for fut in self.ready.values():
            if not fut.done():
                fut.set_exception(StagingError("<gather>", f"gathering sharded parameters failed: {exc!r}"))


_EXCHANGES = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-gather-needs")
_POSTS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-gather-posts")  # (one: in order)


def _exchange(dtensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec],
              needed: set, budget: int) -> dict[str, Optional[Need]]:
    """One all-gather per 1-D dim-0-sharded mesh: per parameter, (needed here, first row, end row,
    this rank's budget). Blocking (a worker thread). None for parameters of other meshes: every rank
    all-gathers those."""
    import torch.distributed as dist

    out: dict[str, Optional[Need]] = {}
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
        mine = torch.tensor([[int(n in needed), shards[n].start, shards[n].stop, budget] for n in names],
                            dtype=torch.int64, device=device)
        world = dist.get_world_size(group)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        table = torch.stack(everyone).cpu().tolist()  # [rank][param] -> (needed, start, stop, budget)
        me = dist.get_rank(group)
        budgets = [table[r][0][3] for r in range(world)]
        for i, name in enumerate(names):
            out[name] = Need(group, me, [r for r in range(world) if table[r][i][0]],
                              [(table[r][i][1], table[r][i][2]) for r in range(world)], budgets)
    return out


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


def _post(gatherer: Gatherer, needs: Mapping[str, Optional[Need]], window: tuple[str, ...], mine: frozenset) -> tuple:
    """Start one window's gathers (the ``_POSTS`` thread, in window order): a collective is made here,
    whole (``full_tensor()``); otherwise every holder's rows go to each rank that needs the full
    tensor, only those allocate it, and every operation of the window is posted as one batch (NCCL: one
    group, run at once). Rows of at most ``PACKED_BYTES`` go packed, one operation per peer and
    window (their bytes back to back, in window order on both ends), so that many small parameters
    cost a few operations, not one each. Rows move as bytes (``Gatherer.local_bytes``: the shards'
    views, made once). Returns (name -> full tensor, for ``mine``; the operations; the packed
    receptions as (buffer, destinations); shards sent)."""
    import torch.distributed as dist

    need = needs[window[0]]
    if need is None or len(need.ranks) == len(need.rows):
        full = gatherer.dtensors[window[0]].full_tensor().detach()
        return ({window[0]: full} if mine else {}), [], [], 0
    fulls, ops, sent, group = {}, [], 0, need.group
    own: tuple[list, list] = ([], [])
    packed_out: dict[int, list[torch.Tensor]] = {}  # peer -> my rows for it, as bytes, in window order
    packed_in: dict[int, list[torch.Tensor]] = {}  # peer -> where its rows go, as bytes, in window order
    for name in window:
        need, local = needs[name], gatherer.locals[name]
        mine_bytes = gatherer.local_bytes.get(name)
        if mine_bytes is None:
            mine_bytes = _as_bytes(local)
        if name in mine:
            full = fulls[name] = torch.empty(tuple(gatherer.dtensors[name].shape), dtype=local.dtype, device=local.device)
            into, row = full.view(-1).view(torch.uint8), gatherer.sizes[name] // max(full.shape[0], 1)
            for r, (start, stop) in enumerate(need.rows):
                if stop <= start:
                    continue
                rows = into[start * row:stop * row]
                if r == need.me:
                    own[0].append(rows)
                    own[1].append(mine_bytes)
                elif rows.numel() <= PACKED_BYTES:
                    packed_in.setdefault(r, []).append(rows)
                else:
                    ops.append(dist.P2POp(dist.irecv, rows, group=group, group_peer=r))
        if mine_bytes.numel():
            for r in need.ranks:
                if r != need.me:
                    sent += 1
                    if mine_bytes.numel() <= PACKED_BYTES:
                        packed_out.setdefault(r, []).append(mine_bytes)
                    else:
                        ops.append(dist.P2POp(dist.isend, mine_bytes, group=group, group_peer=r))
    for r, parts in packed_out.items():
        ops.append(dist.P2POp(dist.isend, torch.cat(parts), group=group, group_peer=r))
    staged = []
    for r, into_parts in packed_in.items():
        buf = torch.empty(sum(t.numel() for t in into_parts), dtype=torch.uint8, device=into_parts[0].device)
        ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=r))
        staged.append((buf, into_parts))
    if own[0]:
        torch._foreach_copy_(*own)
    return fulls, (dist.batch_isend_irecv(ops) if ops else []), staged, sent


# a parameter's rows up to this go packed with others (``_post``): an NCCL operation costs the host more
# than a device copy of this many bytes (MoE experts of 1-3 MB a rank); packing stages at most a window's
# rows, briefly (sent: a copy of this rank's shards; received: a buffer copied out into the full tensors)
PACKED_BYTES = 16 << 20


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().reshape(-1).view(torch.uint8)


def _wait(works: list, staged: list, device: torch.device) -> None:
    """Blocking (a worker thread, not the loop): until a window's operations are done (its full tensors
    hold their rows, packed ones copied out of their buffers; its shards are sent)."""
    for work in works:
        work.wait()
    for buf, into in staged:
        torch._foreach_copy_(into, list(buf.split([t.numel() for t in into])))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
