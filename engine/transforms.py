"""Transforms on the sender: the steps a routing-table row names, applied to a source slice.

How this works. A transform string (made by the planner, ``engine.plan.mapping``) is comma-separated
steps: ``t`` transposes a 2-D view (GPT-2 Conv1D -> Linear), ``cast:<dtype>`` converts, and
``fp8w:<B>`` / ``fp8s:<B>`` are the two outputs of B x B block FP8 quantization: the float8_e4m3fn weight
and its float32 scale-inverse (``weight ~= fp8 * scale_inv`` per block, DeepSeek-V3 / vLLM layout, the
grid anchored at the slice's origin; ragged edge blocks are padded with zeros for the max).

One quantization makes both outputs. ``TransformSet.begin`` counts, from the round's routing table, how
many rows ask for each (source, slice, steps) quantization; the first to run computes both, which wait
in a small cache until the last of those rows has asked, so every quantization runs once per round and
the cache is empty at the end of it. On CUDA the work is queued on a side stream that first waits for the
producer's stream, and ``run`` returns the output with an event at once: the pipeline's writer waits
for the event (polled from the loop) just before the write, while its stager queues the transforms of
the next parameters, so quantization of later parameters overlaps the copies of earlier ones. Users may add their own named
transforms (``custom``): a function from a source view to a tensor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from wire import Transfer

from .errors import StagingError
from .tensors import dtype_from_name

log = logging.getLogger("weightsync")

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale instead of a division by zero
THREAD_BYTES = 1 << 20  # CPU transforms above this run in a worker thread

Transform = Callable[[torch.Tensor], torch.Tensor]


def quantize_blocks(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` -> (float8_e4m3fn tensor of x's shape, float32 scale_inv [ceil(R/B), ceil(C/B)])."""
    if x.dim() != 2:
        raise ValueError(f"block quantization needs a 2-D tensor, got shape {list(x.shape)}")
    rows, cols = x.shape
    br, bc = -(-rows // block), -(-cols // block)
    if rows % block or cols % block:
        x = F.pad(x, (0, bc * block - cols, 0, br * block - rows))
    blocks = x.reshape(br, block, bc, block)
    lo, hi = torch.aminmax(blocks, dim=3)  # one pass, reducing the contiguous inner dim
    amax = torch.maximum(hi.amax(dim=1), lo.amin(dim=1).neg()).float().clamp_(min=MIN_AMAX)
    scale_inv = amax.div_(FP8_MAX)
    # one fused pass: multiply in float32, round to e4m3 on store; |x| * (448 / amax) <= 448 up to
    # float32 rounding, which the cast rounds back to 448, so no clamp pass is needed
    q = torch.empty((br * block, bc * block), dtype=torch.float8_e4m3fn, device=x.device)
    torch.mul(blocks, scale_inv.reciprocal()[:, None, :, None], out=q.view(br, block, bc, block))
    if q.shape != (rows, cols):
        q = q[:rows, :cols].contiguous()
    return q, scale_inv


class Quantizer:
    """``quantize_blocks`` for one device type: on CUDA compiled by ``torch.compile`` (Inductor fuses
    the block max and the scale-and-round: ~5x faster than eager on an H200, bench/fp8_quantize.py),
    falling back to eager, with a warning, if compiling fails here. ``warm`` compiles ahead of a round,
    for each shape the routing table will quantize, so the first round does not pay for it."""

    def __init__(self, compile_cuda: bool = True) -> None:
        self.compile_cuda = compile_cuda
        self._compiled = None
        self.fallback: Optional[str] = None

    def __call__(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if x.device.type != "cuda" or not self.compile_cuda or self.fallback is not None:
            return quantize_blocks(x, block)
        if self._compiled is None:
            self._compiled = torch.compile(quantize_blocks, dynamic=False)
        try:
            return self._compiled(x, block)
        except Exception as exc:  # an Inductor/Triton problem on this machine: eager is correct, only slower
            self.fallback = repr(exc)[:200]
            log.warning("block FP8: torch.compile failed (%s); quantizing eagerly", self.fallback)
            return quantize_blocks(x, block)

    def warm(self, shapes, device: torch.device, dtype: torch.dtype, block: int) -> None:
        """Compile for each 2-D shape now (blocking: run it in a worker thread)."""
        for shape in sorted(set(shapes)):
            self(torch.zeros(shape, dtype=dtype, device=device), block)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The reference inverse: float32 ``q * scale_inv`` with each scale spread over its block."""
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * full


def fp8_error_bound(x: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per element, the most ``|x - dequantize(quantize(x))|`` may be: half an e4m3 step.

    Normal range: 3 mantissa bits, so half a step is at most 2^-4 of |x|; below it the subnormal step
    is 2^-9 of the block scale, half of it 2^-10. Plus float32 rounding of the division (negligible)."""
    rows, cols = x.shape
    scale = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return x.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10 + 1e-30


def within_fp8_bound(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> bool:
    """Whether ``(q, scale_inv)`` dequantizes to within ``fp8_error_bound`` of ``x`` everywhere."""
    err = (dequantize_blocks(q, scale_inv, block) - x.float()).abs()
    return bool((err <= fp8_error_bound(x, scale_inv, block)).all())


@functools.lru_cache(maxsize=256)
def parse(transform: str) -> tuple[tuple[str, str], ...]:
    """``"t,fp8w:128"`` -> ``(("t", ""), ("fp8w", "128"))`` (a table has a handful of distinct strings)."""
    return tuple(step.partition(":")[::2] for step in transform.split(","))


class TransformSet:
    """Applies transform strings to source views; built-in steps plus the user's ``custom`` ones."""

    BUILTIN = frozenset({"t", "cast", "fp8w", "fp8s"})

    def __init__(self, custom: Mapping[str, Transform] = {}, compile_cuda: bool = True) -> None:
        self.custom = dict(custom)
        self.quantizer = Quantizer(compile_cuda)
        self.pending: Counter = Counter()  # quantization key -> rows of this round still to ask for it
        self.kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (weight, scale_inv) still wanted
        self.quantized = 0
        self._streams: dict[int, torch.cuda.Stream] = {}

    def __repr__(self) -> str:
        return f"<TransformSet quantized={self.quantized} kept={len(self.kept)} custom={sorted(self.custom)}>"

    def check(self, name: str, transform: str) -> None:
        """Raise ``StagingError`` for a transform this sender cannot run (before the round starts)."""
        if transform in self.custom:
            return
        for op, arg in parse(transform):
            if op not in self.BUILTIN:
                raise StagingError(name, f"unknown transform {transform!r} (step {op!r})")
            if op == "cast":
                dtype_from_name(arg)

    def begin(self, transfers) -> None:
        """A new round: count who will ask for each quantization; forget anything kept from before."""
        self.kept.clear()
        self.pending = Counter(_quant_key(t) for t in transfers if "fp8" in t.transform)
        first = {}  # each distinct transform once, named by its first row
        for t in transfers:
            if t.transform:
                first.setdefault(t.transform, t.name)
        for transform, name in first.items():
            self.check(name, transform)

    def warm(self, t: Transfer, view: torch.Tensor, shapes: dict) -> None:
        """Note the shape row ``t`` will quantize (for ``Quantizer.warm``)."""
        if "fp8" not in t.transform or view.device.type != "cuda" or view.dim() != 2:
            return
        shape = tuple(view.shape[::-1]) if t.transform.startswith("t,") else tuple(view.shape)
        block = int(t.transform.rpartition(":")[2])
        shapes.setdefault((view.device, view.dtype, block), set()).add(shape)

    async def run(self, t: Transfer, view: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """The transformed, contiguous tensor for row ``t`` (on the source's device), and for CUDA the
        event that marks it complete: the caller waits on it only where it needs the bytes, so the
        next transforms are launched while this one runs."""
        if view.device.type == "cuda":
            return self._launch(t, view, self._side_stream(view.device))
        if view.numel() * view.element_size() > THREAD_BYTES:
            return await asyncio.to_thread(self.apply, t, view), None
        return self.apply(t, view), None

    def _launch(self, t: Transfer, view: torch.Tensor, stream: torch.cuda.Stream):
        """Queue the work on the side stream, from the loop's thread (a worker thread would fight the
        loop for the GIL on every launch); launches return at once."""
        stream.wait_stream(torch.cuda.current_stream(view.device))  # after the producer's work
        with torch.cuda.stream(stream):
            out = self.apply(t, view)
            done = torch.cuda.Event()
            done.record(stream)
        return out, done

    def apply(self, t: Transfer, view: torch.Tensor) -> torch.Tensor:
        fn = self.custom.get(t.transform)
        if fn is not None:
            return fn(view).contiguous()
        x = view
        for op, arg in parse(t.transform):
            if op == "t":
                if x.dim() != 2:
                    raise StagingError(t.name, f"transpose needs a 2-D tensor, got {list(x.shape)}")
                x = x.t()
            elif op == "cast":
                x = x.to(dtype_from_name(arg))
            elif op in ("fp8w", "fp8s"):
                x = self._quantized(t, x, op, int(arg))
            else:
                raise StagingError(t.name, f"unknown transform step {op!r} in {t.transform!r}")
        return x.contiguous()

    def _quantized(self, t: Transfer, x: torch.Tensor, op: str, block: int) -> torch.Tensor:
        key = _quant_key(t)
        both = self.kept.get(key)
        if both is None:
            if x.dim() != 2:
                raise StagingError(t.name, f"block FP8 needs a 2-D weight, got {list(x.shape)}")
            both = self.quantizer(x, block)
            self.quantized += 1
        self.pending[key] -= 1
        if self.pending[key] > 0:  # more rows of this round want this quantization: keep it for them
            self.kept[key] = both
        else:
            self.kept.pop(key, None)
        return both[0] if op == "fp8w" else both[1]

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream


def _quant_key(t: Transfer) -> tuple:
    """Rows sharing a source region and the steps before quantization share one quantization."""
    head = t.transform.split("fp8")[0]
    block = t.transform.rpartition(":")[2]
    return (t.name, t.slice, head, block)
