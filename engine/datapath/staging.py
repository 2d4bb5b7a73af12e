"""Sender-side source preparation: a routing-table row -> a contiguous tensor whose bytes can be written.

How this works: ``SourceSet`` holds the sender's named tensors (and shard specs, if it holds shards).
``stage`` slices the source, runs the row's transform (``weightsync.engine.transforms``: transposes, casts, block
FP8, on a side stream for CUDA sources), and writes the result in place when it is a contiguous tensor
on a device the connection reads, else copies it into a staging buffer (non-contiguous views, a slice
along another dim, a CUDA source over a host-only transport); large copies run in a worker thread so
the event loop keeps serving other connections. Staging buffers come from a ``StagingPool`` and go back after the write.
A row whose quantization writes straight into the receiver (``TransformSet.writes_directly``) stages to
a ``Staged`` that is already ``written``: no tensor, only the launch's event and its device.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import torch

from weightsync.wire import ShardSpec, Slice, Transfer

from ..errors import StagingError
from ..transforms.core import Transform, TransformSet
from ..transforms.steps import GROUP_BYTES
from ..transforms.gather import Gatherer
from .checksums import checksum

THREAD_THRESHOLD = 1 << 20  # copies / checksums above this many bytes run off the event loop
LATER = ("fp64",)  # checksums of unpooled rows taken for many rows in one pass (``Pipeline._stager``:
#                   one launch on GPUs instead of a dozen torch operations and host waits per row)


@dataclasses.dataclass
class Staged:
    """A ready-to-write source: ``tensor`` is contiguous; ``buffer`` is the pool's, to give back after."""

    tensor: Optional[torch.Tensor]  # None when ``written``
    buffer: Optional[torch.Tensor] = None
    checksum: Optional[int] = None
    charge: int = 0  # bytes of the pipeline's budget this holds until written
    event: Optional[torch.cuda.Event] = None  # on CUDA: the tensor is complete once this has happened
    written: Optional[torch.device] = None  # the bytes are in the receiver already, put there from this device
    target: Optional[tuple[int, int]] = None  # (region, offset) it goes to instead of its row's: a delta
    delta: tuple[int, int] = (0, 0)  # a delta's fp64 fingerprint change and values changed (``datapath.deltas``)
    unprinted: Optional[torch.Tensor] = None  # bytes whose ``fp64`` the lane takes with its others' (``LATER``)

    async def wait(self) -> None:
        """Until the bytes exist (a transform queued on a side stream may still be running)."""
        if self.event is not None:
            from ..cuda import cuda_rt

            await cuda_rt.wait_event(self.event)
            self.event = None

    @property
    def pooled(self) -> bool:
        return self.buffer is not None


class StagingPool:
    """Reusable CPU (optionally pinned) byte buffers, by size class, bounded by the byte budget."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0
        self.reused = 0

    def __repr__(self) -> str:
        return f"<StagingPool allocated={self.allocated} reused={self.reused}>"

    def take(self, nbytes: int) -> torch.Tensor:
        """A whole buffer of at least ``nbytes`` (a power of two); slice it, give the whole one back."""
        size = 1 << max(nbytes - 1, 0).bit_length()
        bucket = self.free.get(size)
        if bucket:
            self.reused += 1
            return bucket.pop()
        self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self.free.setdefault(buf.numel(), []).append(buf)


class SourceSet:
    """The tensors a sender can read, by name; ``shards`` for names it holds only a slice of."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec] = {},
                 transforms: Mapping[str, Transform] = {}, gatherer: Optional[Gatherer] = None,
                 group_bytes: int = GROUP_BYTES, quantize_on: Optional[torch.device] = None) -> None:
        self.tensors = {name: t.detach() for name, t in tensors.items()}  # same storage, no autograd
        self.shards = dict(shards)
        self.transforms = TransformSet(transforms, group_bytes=group_bytes, quantize_on=quantize_on)
        self.gatherer = gatherer
        self._table: object = None  # the last plan's table (a tuple, the same every round) ...
        self._views: dict[int, torch.Tensor] = {}  # ... and id(row) -> its source view, made once ...
        self._gathered: dict[int, bool] = {}  # ... whether each row reads a gathered full tensor ...
        self._order: Optional[list[Transfer]] = None  # ... and the staging order (rows gathered: gather order)
        self._gathered_rows: list[Transfer] = []  # ... and the rows that read a gathered tensor

    def begin(self, transfers: Sequence[Transfer],
              resolve: Optional[Callable[[Transfer, torch.device], Optional[int]]] = None,
              token: object = None) -> list[Transfer]:
        """A round over ``transfers`` starts: check transforms, plan shared (and grouped) quantizations,
        start gathers. Returns the transfers in the order to stage them (rows of gathered parameters in
        gather order). ``resolve``/``token``: where rows may be written in place (``TransformSet.begin``)."""
        if transfers is not self._table:
            self._plan_views(transfers)
        self.transforms.begin(transfers, self.known_view, resolve, token)
        if self.gatherer is None:
            return list(transfers)
        if transfers is not self._table:  # (not a plan's table: nothing is cached, needs are exchanged)
            self.gatherer.begin([t for t in transfers if self.gathered(t)])  # rows in our own shard need none
            return _gather_order(transfers, self.gatherer, self.gathered)
        if self._order is None:
            self._order = _gather_order(transfers, self.gatherer, self.gathered)
            self._gathered_rows = [t for t in transfers if self._gathered[id(t)]]
        self.gatherer.begin(self._gathered_rows, key=transfers)  # (needs exchanged once per table)
        return self._order  # (the same list every round of the table: callers only read it)

    def prepare(self, transfers: Sequence[Transfer]) -> None:
        """Once per plan, blocking (run it in a thread): compile the GPU quantization kernel for what
        the table quantizes, so that rounds do not pay for it on the event loop."""
        self.transforms.warm(transfers, self.known_view)

    def _plan_views(self, transfers: Sequence[Transfer]) -> None:
        """Slice every row of a plan's table once (sources are fixed views; a bad slice is left for
        the round to raise); other sequences are not cached (their rows' ids may be reused)."""
        self._table, self._views, self._gathered, self._order = None, {}, {}, None
        if not isinstance(transfers, tuple):
            return
        for t in transfers:
            gathered = self._gathered[id(t)] = self.gathered(t)
            if not gathered:
                try:
                    self._views[id(t)] = self._slice(t)
                except StagingError:
                    pass
        self._table = transfers  # (kept alive here, so the ids above stay its rows')

    def known_view(self, t: Transfer) -> Optional[torch.Tensor]:
        """``t``'s source view where it exists before staging (not a gathered one, not a bad slice)."""
        if self.gathered(t):
            return None
        try:
            return self.view(t)
        except StagingError:
            return None  # raised again, to the round, when the row is staged

    def gathered(self, t: Transfer) -> bool:
        """Whether ``t`` reads a full tensor gathered this round: a sharded parameter's rows outside
        this rank's own shard (rows inside it are read from the shard, shard-to-shard)."""
        if self.gatherer is None:
            return False
        known = self._gathered.get(id(t))  # (a row of the current table: decided once)
        if known is not None:
            return known
        return t.name in self.gatherer.dtensors and not self._in_shard(t)

    def _in_shard(self, t: Transfer) -> bool:
        shard = self.shards.get(t.name)
        return shard is not None and shard.covers(t.slice)

    async def ready(self, t: Transfer) -> None:
        """Wait until ``t``'s source exists (its full tensor gathered, for a sharded parameter)."""
        if self.gathered(t):
            await self.gatherer.full(t.name)

    def release(self, t: Transfer) -> None:
        """``t`` is written (or dropped): a gathered source may go once its last row is."""
        if self.gathered(t):
            self.gatherer.release(t.name)

    async def finish(self) -> None:
        """The round's rows are written: let the gathers still due (for the mesh's sake) complete."""
        if self.gatherer is not None:
            await self.gatherer.finish()

    def abort(self) -> None:
        if self.gatherer is not None:
            self.gatherer.cancel()

    def view(self, t: Transfer) -> torch.Tensor:
        """The source region of ``t`` as a (possibly non-contiguous) view, in local coordinates."""
        if self.gathered(t):
            fut = self.gatherer.ready.get(t.name)
            if fut is None or not fut.done():
                raise StagingError(t.name, "staged before its full tensor was gathered")
            return _narrow(fut.result(), t.slice, 0, 0)
        view = self._views.get(id(t))
        return view if view is not None else self._slice(t)

    def _slice(self, t: Transfer) -> torch.Tensor:
        try:
            src = self.tensors[t.name]
        except KeyError:
            raise StagingError(t.name, "the routing table names a tensor this sender does not hold") from None
        sl = t.slice
        if sl is None:
            return src
        shard = self.shards.get(t.name)
        base = shard.start if shard is not None and shard.dim == sl.dim else 0
        base0 = shard.start if shard is not None and shard.dim == 0 else 0
        if (sl.dim >= src.dim() or sl.start < base or sl.stop - base > src.shape[sl.dim]
                or (sl.block and (sl.dim0_start < base0 or sl.dim0_stop - base0 > src.shape[0]))):
            raise StagingError(t.name, f"slice {sl} is outside the rows this sender holds")
        return _narrow(src, sl, base, base0)

    def makes_copy(self, t: Transfer, view: torch.Tensor, readable: frozenset) -> bool:
        """Whether staging ``t`` (source ``view``) allocates (a transform output or a staging copy)."""
        if t.transform:
            return not self.transforms.writes_directly(t)
        return not view.is_contiguous() or view.device.type not in readable

    def moved_bytes(self, t: Transfer, view: torch.Tensor) -> int:
        """Bytes of the host-to-device copy that staging ``t`` makes (``TransformSet.quantize_on``): the
        source slice, for the row that launches its quantization; 0 for every other row."""
        if not t.transform or not self.transforms.moves_to_device(t, view) or self.transforms.fresh_bytes(t) == 0:
            return 0
        return view.numel() * view.element_size()

    def upfront_bytes(self, t: Transfer, charge: int) -> int:
        """What staging ``t`` allocates now, of a pipeline that charges ``charge`` bytes for it until it
        is written: the whole launch for the row that quantizes a group, nothing for the group's other
        rows (their outputs exist already), ``charge`` otherwise. Summed over a round, the same."""
        if not charge or not t.transform:
            return charge
        fresh = self.transforms.fresh_bytes(t)
        return charge if fresh is None else fresh

    async def stage(self, t: Transfer, pool: StagingPool, algo: str = "",
                    readable: frozenset = frozenset({"cpu"}), view: Optional[torch.Tensor] = None) -> Staged:
        """Slice (unless the caller passes ``view``), transform (a fresh tensor on the source's device),
        then copy only if the connection cannot read it where it is or it is not dense."""
        view = self.view(t) if view is None else view
        event = None
        if t.transform:
            device = view.device
            view, event = await self.transforms.run(t, view)
            if view is None:  # written into the receiver by the launch (with a checksum only in compiled lanes: Pipeline)
                return Staged(None, event=event, written=device)
        nbytes = view.numel() * view.element_size()
        if nbytes != t.nbytes:
            raise StagingError(t.name, f"source gives {nbytes} bytes, the table says {t.nbytes}")
        if view.is_contiguous() and view.device.type in readable:
            staged = Staged(view, event=event)
        else:
            if event is not None:  # the copies below run on other streams: the transform must be done
                from ..cuda import cuda_rt

                await cuda_rt.wait_event(event)
            staged = await _dense_copy(t, view, nbytes, pool, readable)
        if algo:
            await staged.wait()
            if algo in LATER and not staged.pooled:  # (its bytes stay put until the lane's pass: not a pool buffer)
                staged.unprinted = staged.tensor
                return staged
            big = nbytes > THREAD_THRESHOLD and staged.tensor.device.type == "cpu"
            staged.checksum = await asyncio.to_thread(checksum, staged.tensor, algo) if big else checksum(staged.tensor, algo)
        return staged


async def _dense_copy(t: Transfer, view: torch.Tensor, nbytes: int, pool: StagingPool,
                      readable: frozenset) -> Staged:
    """A contiguous copy the connection can read: on the same GPU, or in pinned host memory."""
    if not nbytes:  # nothing to copy (and a 0-byte pool buffer has no shape to take)
        return Staged(torch.empty(view.shape, dtype=view.dtype))
    if view.device.type == "cuda" and "cuda" in readable:
        return Staged(await _gpu_dense(view))  # a dense copy on the same GPU, not through the host
    if view.device.type not in readable and "cpu" not in readable:
        raise StagingError(t.name, f"the connection reads {sorted(readable)} memory, the source is on {view.device}")
    buf = pool.take(nbytes)
    dst = buf[:nbytes].view(view.dtype).view(view.shape)
    if view.device.type == "cuda":
        from ..cuda import cuda_rt

        dst.copy_(view, non_blocking=True)  # into pinned host memory
        await cuda_rt.stream_done(view.device)
    elif nbytes > THREAD_THRESHOLD:
        await asyncio.to_thread(dst.copy_, view)
    else:
        dst.copy_(view)
    return Staged(dst, buf)


def _gather_order(transfers: Sequence[Transfer], gatherer: Gatherer, gathered) -> list[Transfer]:
    """Keep the table's order, except that rows of gathered parameters follow the gather order."""
    out = list(transfers)
    slots = [i for i, t in enumerate(out) if gathered(t)]
    rows = sorted((out[i] for i in slots), key=gatherer.sort_key)
    for i, t in zip(slots, rows):
        out[i] = t
    return out


async def _gpu_dense(view: torch.Tensor) -> torch.Tensor:
    from ..cuda import cuda_rt

    out = view.contiguous()
    await cuda_rt.stream_done(view.device)
    return out


def _narrow(src: torch.Tensor, sl: Optional[Slice], base: int, base0: int) -> torch.Tensor:
    """Slice ``sl`` (full-tensor coordinates) of ``src``, which starts at row ``base`` of ``sl``'s dim and
    row ``base0`` of dim 0; a block keeps its dim-0 rows too (a strided view: staged contiguous, or copied
    as it lies where the connection takes pitched rows)."""
    if sl is None:
        return src
    if sl.block:
        src = src.narrow(0, sl.dim0_start - base0, sl.dim0_stop - sl.dim0_start)
    return src.narrow(sl.dim, sl.start - base, sl.stop - sl.start)
