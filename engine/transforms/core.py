"""Transforms on the sender: the steps a routing-table row names, applied to a source slice.

How this works. A transform string (made by the planner, ``weightsync.engine.plan.mapping``) is comma-separated
steps: ``t`` transposes a 2-D view (GPT-2 Conv1D -> Linear), ``cast:<dtype>`` converts,
``share:<k>.<i>.<w>`` takes, of every matrix of a stack whose rows hold k fused components (an expert's
gate and up), the i-th w-th of each component (a TP rank's share of every expert: vLLM's w13), and
``fp8w:<B>`` / ``fp8s:<B>`` are the two outputs of B x B block FP8 quantization: the float8_e4m3fn weight
and its float32 scale-inverse (``weight ~= fp8 * scale_inv`` per block, DeepSeek-V3 / vLLM layout, the
grid anchored at the slice's origin; ragged edge blocks are padded with zeros for the max).

One quantization makes both outputs. ``TransformSet.begin`` counts, from the round's routing table, how
many rows ask for each (source, slice, steps) quantization; the first to run computes both, which wait
in a small cache until the last of those rows has asked, so every quantization runs once per round and
the cache is empty at the end of it. On CUDA, consecutive quantizations are also *grouped*
(``plan_quant_groups``: up to ``GROUP_SIZE`` tensors, ``GROUP_BYTES`` of output): the first row of a
group quantizes the whole group in one Triton launch (``weightsync.engine.transforms.fp8_kernel``) and the others find their
outputs in the cache. The work is queued on a side stream that first waits for the producer's stream,
and ``run`` returns the output with an event at once: the transport orders the write after that event
on the device (or waits for it on the host), while the stager queues the transforms of the next
parameters, so quantization of later parameters overlaps the copies of earlier ones. Users may add their
own named transforms (``custom``): a function from a source view to a tensor.

Writing in place (``in_place.InPlace``, a part of ``TransformSet``): where the pipeline can name the
receiver's memory for a row, a quantization stores its outputs there instead of into a buffer.

Host sources. With ``quantize_on`` (a CUDA device), a quantization of a CPU-held source (CPU offload)
first copies the source slice to that device (in a worker thread; the side stream waits for the copy's
event) and quantizes it there with the kernel, instead of eagerly on the CPU; the pipeline charges the
copy to its budget (``SourceSet.moved_bytes``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Callable, Mapping, Optional

import torch

from weightsync.wire import Transfer

from ..dtypes import dtype_from_name
from ..errors import StagingError
from .fp8 import FP8_MAX, MIN_AMAX, Quantizer, dequantize_blocks, fp8_error_bound, quantize_blocks
from .fp8 import within_fp8_bound
from .in_place import InPlace
from .steps import GROUP_BYTES, parse, plan_quant_groups, quant_key, quant_matrix, share, share_arg

__all__ = ["FP8_MAX", "MIN_AMAX", "Quantizer", "TransformSet", "dequantize_blocks", "fp8_error_bound",
           "quantize_blocks", "within_fp8_bound"]  # (the FP8 primitives live in engine.transforms.fp8; they
# are re-exported here, where callers have always found them)


THREAD_BYTES = 1 << 20  # CPU transforms above this run in a worker thread
Transform = Callable[[torch.Tensor], torch.Tensor]


def _copy_to_device(view: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A CPU tensor copied to ``device`` (blocking this thread), and an event after the copy."""
    with torch.cuda.device(device):
        moved = view.to(device)
        copied = torch.cuda.Event()
        copied.record()
    return moved, copied


class TransformSet(InPlace):
    """Applies transform strings to source views; built-in steps plus the user's ``custom`` ones."""

    BUILTIN = frozenset({"t", "cast", "share", "fp8w", "fp8s"})

    def __init__(self, custom: Mapping[str, Transform] = {}, use_kernel: bool = True,
                 group_devices: frozenset = frozenset({"cuda"}), group_bytes: int = GROUP_BYTES,
                 quantize_on: Optional[torch.device] = None) -> None:
        self.custom = dict(custom)
        self.quantize_on = quantize_on  # where CPU-held sources are quantized (None: on the CPU)
        self.group_devices = group_devices  # where quantizations are batched (one launch per group)
        self.group_bytes = group_bytes  # FP8 output bytes of one group (``group_bytes_for`` a budget)
        self.quantizer = Quantizer(use_kernel)
        self.pending: Counter = Counter()  # quantization key -> rows of this round still to ask for it
        self.kept: dict[tuple, tuple] = {}  # key -> (weight, scale_inv, CUDA event or None) still wanted
        self.groups: dict[tuple, list[tuple[Transfer, torch.Tensor]]] = {}  # key -> its group's (row, source view)
        self._written_by_token: dict = {}  # token -> (rows, batches, keys): ``InPlace.write_all``'s, prepared
        # (kept and dropped with ``_dests_by_token``: made from that token's destinations)
        self.quantized = 0
        self.rounds = 0
        self._table: object = None  # the routing table planned below (the same object every round of a plan)
        self._key_of: dict[int, int] = {}  # id(row) -> its quantization's number, for the rows of ``_table``
        self._wanted: Counter = Counter()  # quantization key -> rows of ``_table`` asking for it
        self._cost: dict[int, int] = {}  # quantization key -> output bytes its launch makes (its whole group's)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._ordered: dict[int, int] = {}  # side stream's device -> the round it was last ordered after the producer
        self._rows_of: dict[int, list[Transfer]] = {}  # quantization key -> the rows of ``_table`` asking for it
        self._view_of: Callable[[Transfer], Optional[torch.Tensor]] = lambda t: None
        self._resolve: Optional[Callable[[Transfer, torch.device], Optional[int]]] = None
        self._token: object = None  # what the resolver's answers depend on (landing slots, connections)
        self._dests: dict[int, Optional[tuple[int, int]]] = {}  # key -> where its launch writes (None: a buffer)
        self._dests_by_token: dict[object, dict] = {}  # ``_dests`` of each token seen with this table
        self.written = 0  # rows whose bytes a launch wrote straight into the receiver
        self.batchings = 0  # times ``InPlace.write_all`` worked out its launches (once per landing slot and plan)
        self.fingerprint = False  # launches writing in place also fingerprint what they write (``fp64``)
        self.prints: list[tuple[object, list[tuple[int, int]]]] = []  # this round's: (fp8.Prints, per tensor its
        #                                                               weight row's and scales row's table index)

    def __repr__(self) -> str:
        return (f"<TransformSet quantized={self.quantized} written={self.written} batchings={self.batchings} kept={len(self.kept)} "
                f"groups={len(self.groups)} {self.quantizer!r} custom={sorted(self.custom)}>")

    def check(self, name: str, transform: str) -> None:
        """Raise ``StagingError`` for a transform this sender cannot run (before the round starts)."""
        if transform in self.custom:
            return
        steps = parse(transform)
        for i, (op, arg) in enumerate(steps):
            if op not in self.BUILTIN:
                raise StagingError(name, f"unknown transform {transform!r} (step {op!r})")
            if op == "cast":
                dtype_from_name(arg)
            if op == "share":
                share_arg(name, arg)
            if op in ("fp8w", "fp8s") and i != len(steps) - 1:
                raise StagingError(name, f"transform {transform!r}: a quantization must be the last step")

    def begin(self, transfers, view_of: Callable[[Transfer], Optional[torch.Tensor]] = lambda t: None,
              resolve: Optional[Callable[[Transfer, torch.device], Optional[int]]] = None,
              token: object = None) -> None:
        """A new round: count who will ask for each quantization, group the quantizations of CUDA sources
        (``view_of``: a row's source view, None where it is not known yet); forget what was kept.
        ``resolve``: a row's destination address, reachable from a device, or None (see the header);
        its answers are kept while ``token`` stays the same."""
        self.kept.clear()
        self.prints = []
        self.rounds += 1
        if transfers is not self._table or not isinstance(transfers, tuple):  # a new table (a plan's is
            self._plan_table(transfers, view_of)  # one tuple, every round): check it, plan its quantizations
        if resolve is None:
            self._dests = {}
        elif token != self._token:  # (kept per token: a shadow receiver's two landing slots alternate)
            if token not in self._dests_by_token and len(self._dests_by_token) >= 8:
                self._dests_by_token.clear()
                self._written_by_token.clear()
            self._dests = self._dests_by_token.setdefault(token, {})
        self._view_of, self._resolve, self._token = view_of, resolve, token
        self.pending = self._wanted.copy()

    def _plan_table(self, transfers, view_of: Callable[[Transfer], Optional[torch.Tensor]]) -> None:
        self._table = None
        first = {}  # each distinct transform once, named by its first row
        for t in transfers:
            if t.transform:
                first.setdefault(t.transform, t.name)
        for transform, name in first.items():
            self.check(name, transform)
        numbers: dict[tuple, int] = {}  # a quantization's key -> a small number (cheaper to hash)
        self._key_of = {id(t): numbers.setdefault(quant_key(t), len(numbers))
                        for t in transfers if "fp8" in t.transform}
        self._wanted = Counter(self._key_of.values())
        self._rows_of = {}
        for t in transfers:
            if "fp8" in t.transform:
                self._rows_of.setdefault(self._key_of[id(t)], []).append(t)
        self._dests, self._dests_by_token, self._written_by_token = {}, {}, {}
        groups = plan_quant_groups(transfers, view_of, frozenset(self.custom), self.group_devices, self.group_bytes)
        self.groups = {numbers[key]: group for key, group in groups.items()}
        rows_bytes: Counter = Counter()  # key -> bytes of all its rows (weight and scales)
        for t in transfers:
            if "fp8" in t.transform:
                rows_bytes[self._key_of[id(t)]] += t.nbytes
        self._cost = {k: sum(rows_bytes[self._key_of[id(row)]] for row, _ in self.groups[k]) if k in self.groups
                      else rows_bytes[k] for k in self._wanted}
        self.quantizer.forget()
        self._table = transfers  # (kept alive here, so the ids above stay its rows')

    def _key(self, t: Transfer):
        """The number of ``t``'s quantization (its key for a row outside the planned table)."""
        key = self._key_of.get(id(t))
        return key if key is not None else quant_key(t)

    def warm(self, transfers, view_of: Callable[[Transfer], Optional[torch.Tensor]]) -> None:
        """Compile the GPU kernel for each (device, dtype, block) the table quantizes (blocking)."""
        kinds = set()
        for t in transfers:
            view = view_of(t) if "fp8" in t.transform else None
            device = None if view is None else self.quantize_on if self.moves_to_device(t, view) else view.device
            if device is not None and device.type == "cuda":  # (the input dtype: a cast's, else the source's)
                casts = [arg for op, arg in parse(t.transform) if op == "cast"]
                dtype = dtype_from_name(casts[-1]) if casts else view.dtype
                kinds.add((device, dtype, int(t.transform.rpartition(":")[2])))
        for device, dtype, block in sorted(kinds, key=str):
            self.quantizer.warm(device, dtype, block)

    def fresh_bytes(self, t: Transfer) -> Optional[int]:
        """Bytes of new outputs that staging row ``t`` makes now: for the row that launches a
        quantization, every output of the launch (its group's rows, weights and scales); 0 for a row
        whose output a launch already made; ``None`` where unknown (a row outside the planned table)."""
        if "fp8" not in t.transform or t.transform in self.custom:
            return t.nbytes
        key = self._key(t)
        if key in self.kept or self._direct(key) is not None:
            return 0
        return self._cost.get(key)

    def _group_keys(self, key) -> list:
        """The keys of the quantizations one launch makes with ``key``'s: its group's, or its own."""
        group = self.groups.get(key)
        return [self._key(row) for row, _ in group] if group is not None else [key]

    async def run(self, t: Transfer, view: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """The transformed, contiguous tensor for row ``t`` (on the source's device), and for CUDA the
        event that marks it complete: the caller waits on it only where it needs the bytes, so the
        next transforms are launched while this one runs."""
        cached = self._cached(t)
        if cached is not None:  # a quantization that already ran this round (the other output of a pair,
            return cached       # or a member of a group): no new work, its launch's event
        if self.moves_to_device(t, view):
            view = await self._to_device(view)
        if view.device.type == "cuda":
            return self._launch(t, view, self._side_stream(view.device))
        if view.numel() * view.element_size() > THREAD_BYTES:
            return await asyncio.to_thread(self.apply, t, view), None
        return self.apply(t, view), None

    def moves_to_device(self, t: Transfer, view: torch.Tensor) -> bool:
        """Whether row ``t``'s quantization copies its CPU source to ``quantize_on`` first."""
        return (self.quantize_on is not None and view.device.type == "cpu" and "fp8" in t.transform
                and t.transform not in self.custom)

    async def _to_device(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` on ``quantize_on``: copied in a worker thread (a pageable source blocks the copying
        thread), then ordered before the side stream's work by the copy's event."""
        side = self._side_stream(self.quantize_on)
        moved, copied = await asyncio.to_thread(_copy_to_device, view, self.quantize_on)
        side.wait_event(copied)
        moved.record_stream(side)  # (allocated on the copying thread's stream, used on the side stream)
        return moved

    def _after_producer(self, stream: torch.cuda.Stream, device: torch.device) -> None:
        """The side stream waits for the producer's stream once per round: the weights are final then."""
        if self._ordered.get(stream.device.index) != self.rounds:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._ordered[stream.device.index] = self.rounds

    def _launch(self, t: Transfer, view: torch.Tensor, stream: torch.cuda.Stream):
        """Queue the work on the side stream, from the loop's thread (a worker thread would fight the
        loop for the GIL on every launch); launches return at once."""
        self._after_producer(stream, view.device)
        with torch.cuda.stream(stream):
            out = self.apply(t, view)
            done = torch.cuda.Event()
            done.record(stream)
        return out, done

    def _cached(self, t: Transfer) -> Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]]:
        """Row ``t``'s output, if it is one of a quantization this round has made already."""
        if "fp8" not in t.transform or t.transform in self.custom:
            return None
        both = self.kept.get(self._key(t))
        if both is None:
            return None
        op, arg = parse(t.transform)[-1]
        return self._quantized(t, None, op, int(arg)), both[2]

    def apply(self, t: Transfer, view: torch.Tensor) -> torch.Tensor:
        fn = self.custom.get(t.transform)
        if fn is not None:
            return fn(view).contiguous()
        x = self._head(t, view)
        for op, arg in parse(t.transform):
            if op in ("fp8w", "fp8s"):
                x = self._quantized(t, x, op, int(arg))
        return None if x is None else x.contiguous()  # (None: written into the receiver already)

    def _head(self, t: Transfer, view: torch.Tensor) -> torch.Tensor:
        """``view`` after the row's steps that come before a quantization (all of them if none)."""
        x = view
        for op, arg in parse(t.transform):
            if op == "t":
                if x.dim() != 2:
                    raise StagingError(t.name, f"transpose needs a 2-D tensor, got {list(x.shape)}")
                x = x.t()
            elif op == "cast":
                x = x.to(dtype_from_name(arg))
            elif op == "share":
                x = share(t.name, x, *share_arg(t.name, arg))
            elif op in ("fp8w", "fp8s"):
                break
            else:
                raise StagingError(t.name, f"unknown transform step {op!r} in {t.transform!r}")
        return x

    def _quantized(self, t: Transfer, x: torch.Tensor, op: str, block: int) -> torch.Tensor:
        key = self._key(t)
        both = self.kept.get(key)
        if both is None:
            both = self._quantize_group(key, quant_matrix(t, x, block), block)
        self.pending[key] -= 1
        if self.pending[key] > 0:  # more rows of this round want this quantization: keep it for them
            self.kept[key] = both
        else:
            self.kept.pop(key, None)
        return both[0] if op == "fp8w" else both[1]

    def _quantize_group(self, key, x: torch.Tensor, block: int) -> tuple:
        """Quantize ``x`` and, in the same launch, the rest of its group (kept for their rows, with the
        launch's event on CUDA): ``(weight, scale_inv, event)`` of ``x``. A group is fixed for a plan
        (sources of one kind, transposes at most before the quantization), so its launch is reused."""
        group = self.groups.get(key)
        keys = self._group_keys(key)
        dests = [self._dests[k] for k in keys] if self._direct(key) is not None else None
        # (a row written in place is staged only outside compiled lanes, which rounds with checksums never
        #  write in place: ``Pipeline._resolver``; fingerprints are ``write_all``'s alone)
        if group is None:  # alone: its launch is still kept for the next rounds when the plan has it
            results = self.quantizer.many([x], block, reuse=("alone", key) if isinstance(key, int) else None,
                                          dests=dests)
        else:
            results = self.quantizer.many([self._head(row, view) for row, view in group], block,
                                          reuse=id(group), dests=dests)
        if dests is not None:
            results = [(None, None)] * len(keys)  # in the receiver's memory: nothing to hand to the rows
            self.written += 2 * len(keys)
        self.quantized += len(results)
        done = None
        if x.device.type == "cuda":  # (we are on the side stream: ``_launch``)
            done = torch.cuda.Event()
            done.record()
        mine = None
        for k, (q, s) in zip(keys, results):
            if k == key:
                mine = (q, s, done)
            elif self.pending[k] > 0:
                self.kept[k] = (q, s, done)
        return mine

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        from ..cuda import cuda_rt

        index = cuda_rt.device_index(device)
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream
