"""Block FP8 (e4m3fn, B x B block scales) on tensors: the reference quantizer, its inverse and error bound,
and ``Quantizer``, which quantizes lists of tensors (one Triton launch on CUDA, eager elsewhere).

How this works: ``quantize_blocks`` is the eager reference (any device; on CPUs strip by strip in float32,
``_quantize_strip``, the same bytes several times faster): per B x B block, the scale is
the block's absolute max over 448 and the weight is rounded to e4m3 after dividing by it; ragged edge
blocks are padded with zeros for the max; a 3-D stack of matrices (fused MoE experts) is quantized
matrix by matrix as its 2-D view (``as_matrix``). ``Quantizer.many`` runs the same for many tensors at once
through ``weightsync.engine.transforms.fp8_kernel`` where Triton can run, keeps prepared launches under a caller's ``reuse``
key, and can write its outputs to given addresses instead of returning them (``dests``: a receiver's
memory); where the kernel cannot run it warns once and quantizes eagerly (then copies to the
addresses). ``weightsync.engine.transforms`` decides what is quantized, grouped and written where.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("weightsync")

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale instead of a division by zero
STRIP_VALUES = 1 << 18  # on CPUs quantize_blocks works through a matrix about this many values at a time


def as_matrix(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``x`` as the 2-D tensor its block grid is that of: a matrix as it is; a stack of matrices [E, R, C]
    (fused MoE experts, each on its own grid: DeepSeek-V3 / vLLM) as its [E * R, C] view, whose grid is
    the matrices' when R is whole blocks (a ``ValueError`` otherwise: a block would span two matrices)."""
    if x.dim() == 3:
        if x.shape[1] % block:
            raise ValueError(f"a stack of matrices {list(x.shape)} is quantized per matrix: its {x.shape[1]} "
                             f"rows (dim 1) must be whole {block}-row blocks")
        return x.reshape(-1, x.shape[2])
    if x.dim() != 2:
        raise ValueError(f"block quantization needs a 2-D tensor or a 3-D stack of them, got shape {list(x.shape)}")
    return x


def quantize_blocks(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` -> (float8_e4m3fn tensor of x's shape, float32 scale_inv [ceil(R/B), ceil(C/B)]); a 3-D
    stack [E, R, C] -> each matrix quantized on its own grid, scale_inv [E, R/B, ceil(C/B)] (``as_matrix``)."""
    if x.dim() == 3:
        q, scale_inv = quantize_blocks(as_matrix(x, block), block)
        return q.view(x.shape), scale_inv.view(x.shape[0], x.shape[1] // block, -1)
    x = as_matrix(x, block)
    if x.device.type != "cpu":
        return _quantize_whole(x, block)
    rows, cols = x.shape
    br, bc = -(-rows // block), -(-cols // block)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((br, bc), dtype=torch.float32)
    step = max(1, STRIP_VALUES // (block * block * bc))
    for b0 in range(0, br, step):
        _quantize_strip(x, q, scale_inv, b0, min(br, b0 + step), block)
    return q, scale_inv


def _quantize_whole(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` in a few passes over the whole matrix, with no copy of it in float32 (devices)."""
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


def _quantize_strip(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, b0: int, b1: int,
                    block: int) -> None:
    """Block rows ``b0:b1`` of 2-D ``x`` into ``q`` and ``scale_inv``, as ``_quantize_whole`` computes them
    (on CPUs 5-6x faster: ``bench/diagnostics/fp8_quantize.py --device cpu``; the transforms tests check
    that both give the same bytes). The strip is copied once into the dtype the multiplication computes
    in (float32; float64 for float64 sources), zero-padded to whole blocks; each block's absolute max is
    taken from that copy, the copy is scaled in place and rounded to e4m3 into ``q``. A strip's temporaries (``STRIP_VALUES``) stay
    small enough for the allocator to reuse: a large matrix's whole would be fresh pages every call, and
    faulting them in cost more than the arithmetic. The reduction takes the inner, contiguous dim first:
    over dims (1, 3) at once it is several times slower, as is ``aminmax`` on bfloat16."""
    rows, cols = x.shape
    r0, r1 = b0 * block, min(rows, b1 * block)
    n, bc = b1 - b0, scale_inv.shape[1]
    work = torch.empty((n * block, bc * block), dtype=torch.promote_types(x.dtype, torch.float32))
    if r1 - r0 < n * block or cols < bc * block:
        work[r1 - r0:].zero_()
        work[:, cols:].zero_()
    work[:r1 - r0, :cols].copy_(x[r0:r1])
    blocks = work.view(n, block, bc, block)
    amax = blocks.abs().amax(dim=3).amax(dim=1).float().clamp_(min=MIN_AMAX)
    strip = scale_inv[b0:b1]
    torch.div(amax, FP8_MAX, out=strip)
    blocks.mul_(strip.reciprocal()[:, None, :, None])
    q[r0:r1].copy_(work[:r1 - r0, :cols])


class Quantizer:
    """``quantize_blocks`` for a list of tensors: on CUDA one Triton launch per list
    (``weightsync.engine.transforms.fp8_kernel``; the per-tensor launches and Python of the eager path were what FP8 rounds
    waited on), elsewhere eager, tensor by tensor. If the kernel cannot run here (no Triton, a compile
    error) it warns once and quantizes eagerly: correct, only slower."""

    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel
        self.fallback: Optional[str] = None
        self.launches = 0
        self._batches: dict = {}  # reuse key -> fp8_kernel.Batch (its layout and launch tables, made once)

    def __repr__(self) -> str:
        mode = "eager" if not self.use_kernel or self.fallback else "kernel"
        return f"<Quantizer {mode} launches={self.launches}>"

    def many(self, xs: list[torch.Tensor], block: int, reuse=None,
             dests: Optional[list[tuple[int, int]]] = None, fingerprint: bool = False):
        """(fp8, scale_inv) for each 2-D tensor of ``xs`` (one dtype, one device). ``reuse``: a key under
        which the same list comes back (every round): its launch is prepared once and kept. ``dests``:
        per tensor, the addresses (reachable from its device) where its FP8 weight and scales are to be
        written instead; then nothing is returned, or with ``fingerprint`` their ``Prints``."""
        if xs and self._kernel_for(xs[0].device):
            try:
                from . import fp8_kernel

                key = reuse if dests is None or reuse is None else (reuse, tuple(dests), fingerprint)
                batch = self._batches.get(key) if key is not None else None
                if batch is None or batch.block != block or not batch.matches(xs):
                    batch = fp8_kernel.Batch(xs, block, dests, fingerprint=fingerprint and dests is not None)
                    if key is not None:
                        self._batches[key] = batch
                out = batch.run()
                self.launches += 1
                return Prints(batch.prints) if fingerprint and dests is not None else out
            except Exception as exc:  # no Triton or a Triton problem on this machine: eager is correct
                self._give_up(exc)
        self.launches += len(xs)
        out = [quantize_blocks(x, block) for x in xs]
        if dests is None:
            return out
        for (q, s), (q_at, s_at) in zip(out, dests):
            _copy_to_address(q, q_at)
            _copy_to_address(s, s_at)
        return Prints(outputs=out) if fingerprint else []

    def writes_to(self, device: torch.device) -> bool:
        """Whether ``many`` can write outputs to addresses for sources on ``device``."""
        return device.type == "cpu" or self._kernel_for(device)

    def warm(self, device: torch.device, dtype: torch.dtype, block: int) -> None:
        """Compile the kernel for ``dtype`` now (blocking: run it in a worker thread)."""
        if self._kernel_for(device):
            try:
                from . import fp8_kernel

                fp8_kernel.warm(device, dtype, block)
            except Exception as exc:
                self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        self.fallback = repr(exc)[:200]
        log.warning("block FP8: the Triton kernel cannot run here (%s); quantizing eagerly", self.fallback)

    def forget(self) -> None:
        """Drop the prepared launches (a new plan)."""
        self._batches.clear()

    def _kernel_for(self, device: torch.device) -> bool:
        return self.use_kernel and self.fallback is None and device.type == "cuda"


class Prints:
    """The ``fp64`` fingerprints of quantizations written in place, per tensor (its FP8 weight row, its
    scales row): the kernel's are folded on the GPU by its launch and read by ``values`` once that launch
    is done (``fp8_kernel.fingerprints``); the eager path keeps its outputs, which ``values`` fingerprints
    with the caller's ``fp64`` (a row's bytes -> int: the data path's, which transforms do not import)."""

    def __init__(self, halves: Optional[torch.Tensor] = None,
                 outputs: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
        self.halves, self.outputs = halves, outputs

    def __repr__(self) -> str:
        return f"<Prints {'on the device' if self.halves is not None else 'eager'}>"

    def values(self, fp64: Callable[[torch.Tensor], int]) -> list[tuple[int, int]]:
        if self.halves is not None:
            from . import fp8_kernel

            return fp8_kernel.fingerprints(self.halves)
        return [(fp64(_row_bytes(q)), fp64(_row_bytes(s))) for q, s in self.outputs or ()]


def _row_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _copy_to_address(x: torch.Tensor, address: int) -> None:
    """The bytes of contiguous ``x`` to ``address`` (host memory for a CPU tensor, else memory reachable
    from ``x``'s device, queued on its current stream)."""
    nbytes = x.numel() * x.element_size()
    if x.device.type == "cpu":
        ctypes.memmove(address, x.data_ptr(), nbytes)
    else:
        from ..cuda import cuda_rt

        cuda_rt.memcpy_async(address, x.data_ptr(), nbytes, torch.cuda.current_stream(x.device))


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The reference inverse: float32 ``q * scale_inv`` with each scale spread over its block (a 3-D
    stack, matrix by matrix)."""
    flat = as_matrix(q, block)
    return (flat.float() * _spread(scale_inv, flat, block)).view(q.shape)


def fp8_error_bound(x: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per element, the most ``|x - dequantize(quantize(x))|`` may be: half an e4m3 step.

    Normal range: 3 mantissa bits, so half a step is at most 2^-4 of |x|; below it the subnormal step
    is 2^-9 of the block scale, half of it 2^-10. Plus float32 rounding of the division (negligible)."""
    flat = as_matrix(x, block)
    return (flat.float().abs() * 2.0 ** -4 + _spread(scale_inv, flat, block) * 2.0 ** -10 + 1e-30).view(x.shape)


def _spread(scale_inv: torch.Tensor, flat: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's scale over its elements, in the shape of ``flat`` (``as_matrix``'s 2-D view)."""
    rows, cols = flat.shape
    scales = scale_inv.reshape(-1, scale_inv.shape[-1])
    return scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]


def within_fp8_bound(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> bool:
    """Whether ``(q, scale_inv)`` dequantizes to within ``fp8_error_bound`` of ``x`` everywhere."""
    err = (dequantize_blocks(q, scale_inv, block) - x.float()).abs()
    return bool((err <= fp8_error_bound(x, scale_inv, block)).all())
