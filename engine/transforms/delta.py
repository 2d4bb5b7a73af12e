"""Lossless deltas of a row: which values changed since the base, and by how much, in ~2 bytes each.

An RL step moves a bf16 weight by about the learning rate, so most values keep their bits and most that
change move by one unit in the last place. A delta lists the changed positions and the difference of
the new and old bit patterns (as integers of the value's width, wrapping), both in one byte where they
fit:

- ``gaps`` (uint8, one per change): the distance from the previous changed position (the first from
  -1); 0 escapes to the next entry of ``far_gaps`` (uint32). Gaps are >= 1, so positions are strictly
  increasing: sorted and unique by construction.
- ``steps`` (int8, one per change): new bits - old bits, wrapped to the value's width; -128 escapes to
  the next entry of ``far_steps`` (a signed integer as wide as the value, 16 bits for 1-byte values).

At 1% of bf16 values changed by one unit, gaps average 100: about 8% escape, so a change costs
~2.3 bytes.

How this works: ``encode(base, new)`` compares the two rows' bit patterns (vectorised torch on the rows'
device), and returns a ``Delta`` or ``None`` when the delta would not be smaller than the row itself.
``pack`` / ``unpack`` give and read its bytes (a 24-byte header, then the four arrays), ``check``
refuses a delta that does not fit the row (a typed ``DeltaError`` naming the row, before any byte is
written) and ``apply(delta, row)`` adds the steps to the row's bit patterns in place: applied to the
base it gives the new row bit for bit. Pure functions of tensors: no I/O.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Optional

import torch

from ..errors import WeightSyncError

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # the bit pattern's integer view
_FAR_STEP = {1: torch.int16, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a wrapped step, whole
MAX_NUMEL = (1 << 32) - 1
_HEADER = struct.Struct("<IIIIII")  # magic, width, changes, far gaps, far steps, row numel
MAGIC = 0x57534431  # "WSD1"
HEADER_BYTES = _HEADER.size
ESCAPE_STEP = -128


def far_step_dtype(width: int):
    """The numpy dtype of a ``width``-byte value's escaped steps (``Delta.far_steps``)."""
    return torch.empty(0, dtype=_FAR_STEP[width]).numpy().dtype


class DeltaError(WeightSyncError):
    """A delta that cannot apply to its row (malformed, out of bounds, another width)."""

    def __init__(self, row: str, text: str, peer: str = "") -> None:
        super().__init__(f"{row}{f' from {peer}' if peer else ''}: {text}")
        self.row, self.text, self.peer = row, text, peer


@dataclasses.dataclass(frozen=True)
class Delta:
    width: int  # bytes per value
    numel: int  # values in the row
    gaps: torch.Tensor  # uint8 [changes]
    far_gaps: torch.Tensor  # uint32 [gaps == 0]
    steps: torch.Tensor  # int8 [changes]
    far_steps: torch.Tensor  # _FAR_STEP[width] [steps == -128]
    changed: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (encode's, never packed:
    #                             positions, old and new bit patterns as int64, for the encoder's own use)

    @property
    def changes(self) -> int:
        return self.gaps.numel()

    @property
    def nbytes(self) -> int:
        return (_HEADER.size + self.gaps.numel() + self.steps.numel() + 4 * self.far_gaps.numel()
                + self.far_steps.numel() * self.far_steps.element_size())


def bits(row: torch.Tensor) -> torch.Tensor:
    """A contiguous row's values as integers of the same width (a view, no copy)."""
    flat = row.reshape(-1)
    width = flat.element_size()
    if width not in _INT:
        raise DeltaError("row", f"values of {width} bytes have no integer view")
    return flat.view(_INT[width])


def _escaped(values: torch.Tensor, fits: torch.Tensor, escape: int, dtype: torch.dtype,
             far: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(one byte per value, escape where it does not fit; the values that did not fit, in order)."""
    small = torch.where(fits, values, torch.full_like(values, escape)).to(dtype)
    return small, values[~fits].to(far)


def encode(base: torch.Tensor, new: torch.Tensor, *, whole_if_larger: bool = True) -> Optional[Delta]:
    """The delta taking ``base`` to ``new`` (same shape and dtype), or None where sending ``new`` whole
    is no larger (unless ``whole_if_larger`` is False)."""
    old_bits, new_bits = bits(base), bits(new)
    if old_bits.shape != new_bits.shape or old_bits.dtype != new_bits.dtype:
        raise DeltaError("row", f"base {tuple(base.shape)} {base.dtype} and new {tuple(new.shape)} {new.dtype} differ")
    width = new.element_size()
    if new_bits.numel() > MAX_NUMEL:
        raise DeltaError("row", f"{new_bits.numel()} values: a delta covers rows of at most {MAX_NUMEL}")
    positions = torch.nonzero(old_bits != new_bits).reshape(-1)
    if whole_if_larger and (positions.numel() * 2 + _HEADER.size) >= new_bits.numel() * width:
        return None  # (at least two bytes per change: never smaller than the row)
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1]))
    before, after = old_bits[positions].to(torch.int64), new_bits[positions].to(torch.int64)
    diff = after - before
    if width < 8:  # the wrapping difference of the bit patterns, as a signed integer of the width
        span = 1 << (8 * width)
        diff = (diff + span // 2) % span - span // 2
    gap8, far_gaps = _escaped(gaps, gaps < 256, 0, torch.uint8, torch.uint32)
    step8, far_steps = _escaped(diff, (diff > ESCAPE_STEP) & (diff < 128), ESCAPE_STEP, torch.int8, _FAR_STEP[width])
    delta = Delta(width, new_bits.numel(), gap8, far_gaps, step8, far_steps, (positions, before, after))
    return delta if delta.nbytes < new_bits.numel() * width or not whole_if_larger else None


def _unescaped(small: torch.Tensor, far: torch.Tensor, escape: int, what: str, row: str) -> torch.Tensor:
    """The one-byte values with each escape replaced by the next far value, in int64."""
    values = small.to(torch.int64)
    escaped = values == escape
    if int(escaped.sum()) != far.numel():
        raise DeltaError(row, f"{int(escaped.sum())} escaped {what}, {far.numel()} given")
    values[escaped] = far.to(torch.int64)
    return values


def positions_of(delta: Delta, row: str = "row") -> torch.Tensor:
    if delta.far_gaps.numel() and int(delta.far_gaps.to(torch.int64).min()) < 1:  # (uint32 has no min)
        raise DeltaError(row, "a gap below 1: positions must be strictly increasing")
    positions = torch.cumsum(_unescaped(delta.gaps, delta.far_gaps, 0, "gaps", row), 0) - 1
    if positions.numel() and int(positions[-1]) >= delta.numel:
        raise DeltaError(row, f"position {int(positions[-1])} is outside the row's {delta.numel} values")
    return positions


def steps_of(delta: Delta, row: str = "row") -> torch.Tensor:
    return _unescaped(delta.steps, delta.far_steps, ESCAPE_STEP, "steps", row)


def check(delta: Delta, target: torch.Tensor, row: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, steps) of a delta that fits ``target``, else ``DeltaError`` naming ``row``; nothing
    is written."""
    check_shape(delta, target, row)
    return positions_of(delta, row), steps_of(delta, row)


def check_shape(delta: Delta, target: torch.Tensor, row: str = "row") -> None:
    """``DeltaError`` naming ``row`` unless the delta's width, length and array sizes fit ``target``."""
    check_fits(delta.width, delta.numel, target, row)
    if delta.steps.numel() != delta.gaps.numel():
        raise DeltaError(row, f"{delta.gaps.numel()} positions but {delta.steps.numel()} steps")


def apply(delta: Delta, target: torch.Tensor, row: str = "row", *, checked=None,
          undo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add the delta's steps to ``target``'s bit patterns in place (checked first: all or nothing);
    ``checked``: ``check``'s answer, when the caller has it; ``undo``: subtract them (``new`` -> ``base``).
    Returns (positions, bit patterns before, after), int64 on the target's device, for a fingerprint."""
    positions, steps = checked if checked is not None else check(delta, target, row)
    values = bits(target)
    if positions.device != values.device:
        positions, steps = positions.to(values.device), steps.to(values.device)
    before = values[positions].to(torch.int64)
    updated = before + (-steps if undo else steps)
    if delta.width < 8:  # wrap into the width, then read as its signed (or, for bytes, unsigned) integer
        span = 1 << (8 * delta.width)
        updated = updated % span
        if values.dtype != torch.uint8:
            updated = torch.where(updated >= span // 2, updated - span, updated)
    values[positions] = updated.to(values.dtype)
    return positions, before, updated


def check_fits(width: int, numel: int, target: torch.Tensor, row: str = "row") -> None:
    """``DeltaError`` naming ``row`` unless a delta of ``numel`` values of ``width`` bytes fits ``target``."""
    if width != target.element_size() or numel != target.numel():
        raise DeltaError(row, f"a delta of {numel} x {width}-byte values for a row of "
                              f"{target.numel()} x {target.element_size()}")


def check_header(fields: tuple[int, ...], nbytes: int, row: str = "row") -> torch.dtype:
    """``DeltaError`` naming ``row`` unless a header's fields (magic, width, changes, far gaps, far steps,
    values) describe a delta of ``nbytes`` bytes; the dtype of its far steps."""
    magic, width, changes, far_gaps, far_steps, numel = fields
    if magic != MAGIC or width not in _INT:
        raise DeltaError(row, f"not a delta (magic {magic & 0xFFFFFFFF:#x}, width {width})")
    far_step = _FAR_STEP[width]
    want = _HEADER.size + 2 * changes + 4 * far_gaps + far_step.itemsize * far_steps
    if min(changes, far_gaps, far_steps, numel) < 0 or nbytes != want:
        raise DeltaError(row, f"{nbytes} bytes, the header says {want}")
    return far_step


def header(width: int, changes: int, far_gaps: int, far_steps: int, numel: int) -> bytes:
    """A packed delta's first ``HEADER_BYTES``."""
    return _HEADER.pack(MAGIC, width, changes, far_gaps, far_steps, numel)


def pack(delta: Delta) -> bytes:
    head = header(delta.width, delta.changes, delta.far_gaps.numel(), delta.far_steps.numel(), delta.numel)
    arrays = (delta.gaps, delta.steps, delta.far_gaps, delta.far_steps)
    return head + b"".join(a.contiguous().cpu().numpy().tobytes() for a in arrays)


def pack_tensor(delta: Delta) -> torch.Tensor:
    """``pack``'s bytes as a uint8 tensor on the delta's device (no round trip through the host)."""
    head = header(delta.width, delta.changes, delta.far_gaps.numel(), delta.far_steps.numel(), delta.numel)
    device = delta.gaps.device
    arrays = [torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)]
    arrays += [a.contiguous().reshape(-1).view(torch.uint8) for a in (delta.gaps, delta.steps, delta.far_gaps,
                                                                       delta.far_steps) if a.numel()]
    return torch.cat(arrays)


def unpack_tensor(data: torch.Tensor, row: str = "row") -> Delta:
    """A delta from ``pack_tensor``'s bytes (a uint8 tensor on any device; only the header is read on the
    host); lengths that do not add up are a ``DeltaError`` naming ``row``."""
    if data.numel() < _HEADER.size:
        raise DeltaError(row, f"{data.numel()} bytes is shorter than a delta's header")
    fields = _HEADER.unpack(bytes(data[:_HEADER.size].cpu().numpy()))
    far_step = check_header(fields, data.numel(), row)
    _, width, changes, far_gaps, far_steps, numel = fields
    at = _HEADER.size

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal at
        size = n * torch.empty(0, dtype=dtype).element_size()
        part = data[at:at + size]
        at += size
        return part.view(dtype) if dtype.itemsize == 1 else part.clone().view(dtype)  # (aligned copies)

    gaps, steps = take(changes, torch.uint8), take(changes, torch.int8)
    return Delta(width, numel, gaps, take(far_gaps, torch.uint32), steps, take(far_steps, far_step))


def unpack(data: bytes, row: str = "row") -> Delta:
    """A delta from ``pack``'s bytes; lengths that do not add up are a ``DeltaError`` naming ``row``."""
    if len(data) < _HEADER.size:
        raise DeltaError(row, f"{len(data)} bytes is shorter than a delta's header")
    fields = _HEADER.unpack_from(data)
    far_step = check_header(fields, len(data), row)
    _, width, changes, far_gaps, far_steps, numel = fields
    buf, at = bytearray(data), _HEADER.size

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal at
        out = torch.frombuffer(buf, dtype=dtype, count=n, offset=at) if n else torch.empty(0, dtype=dtype)
        at += n * out.element_size()
        return out

    gaps, steps = take(changes, torch.uint8), take(changes, torch.int8)
    return Delta(width, numel, gaps, take(far_gaps, torch.uint32), steps, take(far_steps, far_step))


class Encoded:
    """One row's outcome: ``packed`` (its delta's bytes) or None to go whole; the values it changed and
    its ``fp64`` change (mod 2**64; 0 for a row that goes whole)."""

    __slots__ = ("packed", "changes", "change")

    def __init__(self, packed: Optional[torch.Tensor], changes: int, change: int) -> None:
        self.packed, self.changes, self.change = packed, changes, change


def verdict(head: tuple[int, ...], escaped_gaps: int, escaped_steps: int, total: int, least: int) -> Optional[str]:
    """Why a delta does not fit its row, from its header and what a batched walk of it found (the escaped
    gaps and steps, the sum of its gaps, its least far gap; None: it fits)."""
    _, _, c, fg, fs, numel = head
    if escaped_gaps != fg:
        return f"{escaped_gaps} escaped gaps, {fg} given"
    if fg and least < 1:
        return "a gap below 1: positions must be strictly increasing"
    if c and total - 1 >= numel:
        return f"position {total - 1} is outside the row's {numel} values"
    if escaped_steps != fs:
        return f"{escaped_steps} escaped steps, {fs} given"
    return None
