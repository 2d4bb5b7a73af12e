"""Deltas of CPU rows in one compiled pass (numba): encode, check and apply without temporaries.

``engine.transforms.delta`` says what a delta is and does it with vectorised torch, a dozen passes over
the row and its changes. On the CPU those passes are the round: comparing two rows value by value,
gathering the changed ones and scattering them again moves several times the row's bytes and costs
~50-130 ns per changed value. The kernels here do the same work in one pass each, compiled with
numba (``cache=True``: compiled once per machine, then loaded):

- ``advance(base, new)``: compare the rows 8 bytes at a time (values only where a word differs),
  write the delta's four arrays, copy each changed value into ``base`` and add up the change of the
  row's ``fp64`` fingerprint (``engine.datapath.checksums``), all in the same loop. The delta is the one
  ``delta.encode`` gives, bit for bit, or None where it would not be smaller than the row (``base``
  then equals ``new`` all the same).
- ``check(delta, row)``: walk the positions without writing (escape counts, gaps >= 1, inside the
  row); a delta that fails gets ``delta.check``'s typed error, naming the row.
- ``apply(delta, row, undo=)``: check, then add (subtract) the steps in place; the fingerprint change.

``usable(t)`` says where they run: CPU tensors, with numba importable (it is a dependency on the
CPU; where it is missing, e.g. a GPU host's minimal install, the torch code serves). The fingerprint
arithmetic mirrors ``checksums.fp64_change`` (int64, wrapping: equal mod 2**64); tests compare both
paths bit for bit.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from . import delta as codec

_MASK = (1 << 64) - 1


@functools.cache
def _kernels():
    """The compiled kernels (the ``delta_kernels`` module), or None without numba."""
    try:
        from . import delta_kernels
    except ImportError:
        return None
    return delta_kernels


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels serve these tensors (all on the CPU, numba importable)."""
    return all(t.device.type == "cpu" for t in tensors) and _kernels() is not None


def _np(t: torch.Tensor) -> np.ndarray:
    return codec.bits(t).numpy()


def advance(base: torch.Tensor, new: torch.Tensor) -> tuple[Optional[codec.Delta], int]:
    """Bring ``base`` (1-D, contiguous) to ``new`` (same values, dtype): (the delta that does it, or None
    where sending ``new`` whole is no larger; the change of the row's fp64 fingerprint, mod 2**64)."""
    b, n = _np(base), _np(new.reshape(-1))
    if b.shape != n.shape or b.dtype != n.dtype:
        raise codec.DeltaError("row", f"base {tuple(base.shape)} {base.dtype} and new {tuple(new.shape)} {new.dtype} differ")
    width, numel = n.itemsize, n.size
    if numel > codec.MAX_NUMEL:
        raise codec.DeltaError("row", f"{numel} values: a delta covers rows of at most {codec.MAX_NUMEL}")
    limit = max(0, (numel * width - codec.HEADER_BYTES - 1) // 2)  # (2 bytes a change at least)
    gaps, steps = np.empty(limit, np.uint8), np.empty(limit, np.int8)
    far_gaps = np.empty(limit, np.uint32)
    far_steps = np.empty(limit, codec.far_step_dtype(width))
    aligned = numel * width // 8 * 8 // width if b.ctypes.data % 8 == 0 and n.ctypes.data % 8 == 0 else 0
    c, fg, fs, fp = _kernels().encode(b, n, b[:aligned].view(np.uint64), n[:aligned].view(np.uint64), gaps, far_gaps,
                           steps, far_steps, width, limit)
    if c < 0:
        base.copy_(new.reshape(-1))
        return None, 0
    delta = codec.Delta(width, numel, torch.from_numpy(gaps[:c].copy()), torch.from_numpy(far_gaps[:fg].copy()),
                        torch.from_numpy(steps[:c].copy()), torch.from_numpy(far_steps[:fs].copy()))
    return (delta if delta.nbytes < numel * width else None), int(fp) & _MASK


def _arrays(delta: codec.Delta) -> tuple[np.ndarray, ...]:
    return tuple(a.contiguous().numpy() for a in (delta.gaps, delta.far_gaps, delta.steps, delta.far_steps))


def check(delta: codec.Delta, row: torch.Tensor, name: str = "row") -> None:
    """Nothing written: a ``DeltaError`` naming ``name`` unless ``delta`` fits ``row``."""
    codec.check_shape(delta, row, name)
    k = _kernels()
    if k.walk(*_arrays(delta), delta.numel) != k.OK:
        codec.check(delta, row, name)  # (the torch walk says what is wrong)
        raise codec.DeltaError(name, "malformed positions")


def apply(delta: codec.Delta, row: torch.Tensor, name: str = "row", *, undo: bool = False,
          checked: bool = False) -> int:
    """Add ``delta``'s steps to ``row``'s bit patterns in place (subtract: ``undo``), checked first
    unless ``checked``; the change of the row's fp64 fingerprint, mod 2**64."""
    if not checked:
        check(delta, row, name)
    return int(_kernels().apply(_np(row), *_arrays(delta), delta.width, -1 if undo else 1)) & _MASK
