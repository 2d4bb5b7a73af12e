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
- Many rows a call, for a lane's batches (``delta_rows.batched``), with the interface of the GPU
  kernels (``engine.cuda.delta_kernel.encode_many``, ``delta_apply.headers`` and ``Applier``):
  ``encode_many`` packs every row's delta (``pack_tensor``'s bytes) into one buffer, rows given by
  address in one table; ``Applier`` walks a round's packed deltas in one call and applies them in one
  call per thread. No Python runs per row inside them: on a model of thousands of small tensors that
  per-row work was most of a round.

``usable(t)`` says where they run: CPU tensors, with numba importable (it is a dependency on the
CPU; where it is missing, e.g. a GPU host's minimal install, the torch code serves). The fingerprint
arithmetic mirrors ``checksums.fp64_change`` (int64, wrapping: equal mod 2**64); tests compare both
paths bit for bit.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Optional, Sequence

import numpy as np
import torch

from . import delta as codec

_MASK = (1 << 64) - 1


@functools.cache
def _kernels():
    """The compiled kernels (the ``delta_kernels`` module), or None without numba (or on a big-endian
    host: they find a word's changed values by their place in little-endian words)."""
    if sys.byteorder != "little":
        return None
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


def _pair(base: torch.Tensor, new: torch.Tensor) -> None:
    """``DeltaError`` unless ``base`` and ``new`` hold as many values of one dtype, at most ``MAX_NUMEL``."""
    if base.numel() != new.numel() or base.dtype != new.dtype:
        raise codec.DeltaError("row", f"base {tuple(base.shape)} {base.dtype} and new {tuple(new.shape)} {new.dtype} differ")
    if new.numel() > codec.MAX_NUMEL:
        raise codec.DeltaError("row", f"{new.numel()} values: a delta covers rows of at most {codec.MAX_NUMEL}")


def advance(base: torch.Tensor, new: torch.Tensor) -> tuple[Optional[codec.Delta], int]:
    """Bring ``base`` (1-D, contiguous) to ``new`` (same values, dtype): (the delta that does it, or None
    where sending ``new`` whole is no larger; the change of the row's fp64 fingerprint, mod 2**64)."""
    _pair(base, new)
    b, n = _np(base), _np(new.reshape(-1))
    width, numel = n.itemsize, n.size
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


SLOT_ALIGN = 16  # each row's packed delta starts on a multiple of this in a batch's buffer


def encode_many(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> list[codec.Encoded]:
    """``advance`` of many rows in one compiled call (``delta_kernels.encode_rows``): each ``(base, new)``
    1-D, contiguous, on the CPU, of one dtype and length. Each row's packed delta (``pack_tensor``'s bytes,
    a view of one buffer of the batch) or None to go whole; every base ends equal to its new bytes.
    (``wait``: the GPU encoder's; CPU work is done when this returns.)"""
    if not rows:
        return []
    table, at, limit, far, values = [], 0, 1, 8, 0
    for base, new in rows:
        _pair(base, new)
        if not (base.is_contiguous() and new.is_contiguous()):
            raise codec.DeltaError("row", f"base {tuple(base.stride())} or new {tuple(new.stride())} is not contiguous")
        width = new.element_size()
        codec.bits(new)  # (values of a width with no integer view: its DeltaError)
        nbytes = new.numel() * width
        table.append((base.data_ptr(), new.data_ptr(), new.numel(), width, at))
        at += -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
        row_limit = max(0, (nbytes - codec.HEADER_BYTES - 1) // 2) + 1
        limit, far = max(limit, row_limit), max(far, row_limit * codec.far_step_dtype(width).itemsize)
        values = max(values, new.numel())
    out = np.empty(at, np.uint8)  # (pages are touched only where deltas are written: ~2 bytes a change)
    results = np.empty((len(rows), 3), np.int64)
    _kernels().encode_rows(np.array(table, np.int64), out, np.empty(limit, np.uint8),
                           np.empty(values // 256 + 2, np.uint32), np.empty(limit, np.int8), np.empty(far, np.uint8),
                           results)
    packed = torch.from_numpy(out)
    return [codec.Encoded(packed[start:start + size] if size >= 0 else None, changes, change & _MASK)
            for (*_, start), (size, changes, change) in zip(table, results.tolist())]


def headers(region: torch.Tensor, starts: Sequence[int]) -> list[tuple[int, ...]]:
    """The header fields of the deltas packed at ``starts`` of ``region`` (uint8, on the CPU)."""
    if not starts:
        return []
    raw = region.numpy()[np.asarray(starts, np.int64)[:, None] + np.arange(codec.HEADER_BYTES)]
    return [tuple(r) for r in raw.view(np.int32).reshape(-1, 6).tolist()]


class Applier:
    """Deltas checked, then applied, many in one compiled call each (``engine.cuda.delta_apply.Applier``'s
    CPU twin): each ``(packed, row, header)``, ``packed`` a uint8 view of a delta's bytes whose header
    fields ``header`` gives (as ``headers`` reads them, sizes already checked against its bytes), ``row``
    the 1-D contiguous values it applies to, of the header's width and count. ``apply`` splits the rows
    among up to ``threads`` threads of ``pool`` (the kernels let go of the GIL)."""

    def __init__(self, deltas: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]], pool=None,
                 threads: int = 1) -> None:
        self.deltas, self.pool, self.threads = list(deltas), pool, threads
        self.checked: Optional[list] = None

    def __repr__(self) -> str:
        return f"<Applier {len(self.deltas)} deltas checked={self.checked is not None}>"

    def check(self) -> list[Optional[str]]:
        """Per delta, why it does not fit its row (None: it does); nothing written."""
        table = np.array([(packed.data_ptr(), head[2], head[3], head[4]) for packed, _, head in self.deltas],
                         np.int64).reshape(-1, 4)
        found = np.empty((len(self.deltas), 4), np.int64)
        _kernels().walk_rows(table, found)
        self.checked = [codec.verdict(head, *f) for (_, _, head), f in zip(self.deltas, found.tolist())]
        return self.checked

    def apply(self, undo: bool = False) -> list[int]:
        """Apply every delta (after ``check`` found them all good; ``undo``: take them back); each row's
        ``fp64`` change, mod 2**64."""
        if self.checked is None or any(self.checked):
            raise codec.DeltaError("row", "apply before a check that every delta passed")
        table = np.array([(packed.data_ptr(), row.data_ptr(), head[5], head[1], head[2], head[3], head[4])
                          for packed, row, head in self.deltas], np.int64).reshape(-1, 7)
        changes = np.empty(len(self.deltas), np.int64)
        sign = -1 if undo else 1
        parts = self._parts(table)
        if len(parts) > 1 and self.pool is not None:
            for f in [self.pool.submit(_kernels().apply_rows, table[a:b], sign, changes[a:b]) for a, b in parts]:
                f.result()
        else:
            _kernels().apply_rows(table, sign, changes)
        return [c & _MASK for c in changes.tolist()]

    def _parts(self, table: np.ndarray) -> list[tuple[int, int]]:
        """Runs of rows with about equal changes, one per thread."""
        if self.threads <= 1 or len(table) < 2:
            return [(0, len(table))]
        ends = np.cumsum(table[:, 4] + 1)
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, self.threads) / self.threads)
        bounds = sorted({0, len(table), *(int(c) for c in cuts)})
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@functools.cache
def warm_soon() -> threading.Thread:
    """``warm`` on a daemon thread, once per process (a member starts it as it joins)."""
    def run() -> None:
        try:
            warm()
        except Exception as exc:  # (the rounds take their fallbacks and say so)
            logging.getLogger("weightsync").info("weightsync: CPU delta kernels not loaded ahead: %r", exc)

    thread = threading.Thread(target=run, name="weightsync-warm-deltas", daemon=True)
    thread.start()
    return thread


def warmed(timeout: Optional[float] = None) -> bool:
    """Wait (blocking: call it off the loop) for this process's ``warm_soon`` load, if one was started;
    -> whether none is running any more. Until it ends it holds the GIL for most of its time, so a
    member's event loop waits for it up to a switch interval (5 ms) at a time: rounds run in the first
    ~0.5 s after a CPU member joins (numba's cache loaded; ~10 s where it is compiled, once per checkout:
    ``make venv`` does it) are slower. A benchmark of steady rounds waits for it first."""
    if not warm_soon.cache_info().currsize:
        return True
    thread = warm_soon()
    thread.join(timeout)
    return not thread.is_alive()


def warm() -> None:
    """Load (or compile, once per machine) the batched kernels and run each once on a few values, so no
    round pays numba's import and cache load (~0.6 s on the 2-core CPU). Blocking: call it off the loop."""
    if _kernels() is None:
        return
    new = torch.arange(4096, dtype=torch.int16)
    base = new.clone()
    base[::97] += 1
    packed = encode_many([(base, new)])[0].packed
    applier = Applier([(packed, base.clone(), headers(packed, [0])[0])])
    if applier.check() == [None]:
        applier.apply()
