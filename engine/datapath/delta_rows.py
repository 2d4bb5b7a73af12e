"""Which code encodes, checks and applies a delta row, by where it lies: one place for the choice.

CPU rows take the compiled one-pass kernels (``engine.transforms.delta_cpu``, numba); GPU rows of 1, 2
and 4-byte values the batched Triton kernels (``engine.cuda.delta_kernel``: many rows in a few
launches, ``batched``; once one fails here, rows go one by one from then on: ``kernel_failed``); any
other row the vectorised torch codec (``engine.transforms.delta``). ``advance`` (the sender's, one
row), ``check_row`` and ``apply_row`` pick among them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from ..transforms import delta as codec
from ..transforms import delta_cpu
from .checksums import fp64_change

log = logging.getLogger("weightsync")

WIDTHS = (1, 2, 4)  # bytes per value the batched GPU kernels take
GPU_BATCH_BYTES = 1 << 30  # GPU rows of a lane encoded as one batch, up to this many bytes
CPU_BATCH_BYTES = 4 << 20  # CPU rows of a lane encoded as one batch, up to this many bytes

KERNEL_ON_CPU = False  # tests: CPU rows take the batched kernels too (Triton's interpreter, TRITON_INTERPRET=1)
KERNEL_FAILED: list[str] = []  # why the batched kernels could not run here (then rows go one by one)


@functools.cache
def gpu_kernels():
    """``engine.cuda.delta_kernel``, or None where Triton does not import (then rows go one by one)."""
    try:
        from ..cuda import delta_kernel
    except Exception as exc:  # no Triton here
        KERNEL_FAILED.append(repr(exc)[:200])
        return None
    return delta_kernel


def kernel_failed(exc: BaseException) -> None:
    """The batched kernels failed here: every later row goes one by one (logged once)."""
    if not KERNEL_FAILED:
        log.warning("weightsync: the batched delta kernels cannot run here (%r); rows go one by one", exc)
    KERNEL_FAILED.append(repr(exc)[:200])


def batched(row: torch.Tensor) -> bool:
    """Whether rows like ``row`` take the batched kernels (``batch_kernels``): contiguous rows, CUDA rows
    of 1, 2 or 4-byte values where Triton imports (``KERNEL_ON_CPU``: CPU rows too), CPU rows where
    numba does; none once a batched kernel failed here."""
    if not row.is_contiguous() or row.numel() > codec.MAX_NUMEL or KERNEL_FAILED:
        return False
    if row.device.type == "cpu" and not KERNEL_ON_CPU:
        return delta_cpu.usable(row)
    return ((row.device.type == "cuda" or KERNEL_ON_CPU) and row.element_size() in WIDTHS
            and gpu_kernels() is not None)


def batch_kernels(row: torch.Tensor):
    """The module whose ``encode_many``, ``headers`` and ``Applier`` take rows like ``row`` (``batched``):
    ``engine.transforms.delta_cpu`` for CPU rows, ``engine.cuda.delta_kernel`` for GPU rows (with
    ``KERNEL_ON_CPU``, CPU rows too)."""
    if row.device.type == "cpu" and not KERNEL_ON_CPU:
        return delta_cpu
    return gpu_kernels()


def batch_bytes(row: torch.Tensor) -> int:
    """Bytes of rows like ``row`` a lane gathers into one batch: GPU rows up to ``GPU_BATCH_BYTES`` (a few
    launches and waits a batch), CPU rows up to ``CPU_BATCH_BYTES`` (each batch one call on a worker
    thread, while the event loop writes what is encoded already)."""
    return CPU_BATCH_BYTES if row.device.type == "cpu" else GPU_BATCH_BYTES


def advance(base: torch.Tensor, new: torch.Tensor) -> tuple[Optional[codec.Delta], int, bool]:
    """(the delta taking ``base`` to ``new`` or None, its fingerprint change, whether ``base`` now holds
    ``new`` already): one compiled pass for CPU rows, else the torch encoder and ``_take``."""
    if delta_cpu.usable(base, new):
        delta, change = delta_cpu.advance(base, new)
        return delta, change, True
    delta = codec.encode(base.to(new.device, non_blocking=True), new)
    if delta is None:
        return None, 0, False
    change = _take(delta, base)
    return dataclasses.replace(delta, changed=None), change, True  # (the arrays: kept for an undo only)


def check_row(delta: codec.Delta, row: torch.Tensor, name: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``delta`` fits ``row`` (else ``DeltaError`` naming ``name``): the torch check's positions and
    steps, or None where the compiled kernels will apply it."""
    if delta_cpu.usable(row):
        delta_cpu.check(delta, row, name)
        return None
    return codec.check(delta, row, name)


def apply_row(delta: codec.Delta, row: torch.Tensor, name: str, checked, *, undo: bool = False) -> int:
    """Apply a delta in place (``undo``: take it back); the row's fp64 fingerprint change. ``checked``:
    the torch check's answer, or None for a delta checked by the compiled walk or the sender's own."""
    if delta_cpu.usable(row):
        return delta_cpu.apply(delta, row, name, undo=undo, checked=checked is None)
    return fp64_change(*codec.apply(delta, row, name, checked=checked, undo=undo), delta.width)


def _take(delta: codec.Delta, base: torch.Tensor) -> int:
    """The encoder's own base takes the changed values it found (no decoding); their fingerprint change."""
    positions, before, after = delta.changed
    bits = codec.bits(base)
    bits[positions.to(bits.device)] = after.to(bits.device, bits.dtype)
    return fp64_change(positions, before, after, delta.width)
