"""Deltas of many GPU rows in a few launches (Triton): the sender's encoder.

``engine.transforms.delta`` defines the format (one byte per changed value for the gap from the
previous change, 0 escaping to a uint32; one byte for the wrapped step of its bit pattern, -128
escaping to a wider integer; a 24-byte header). Its torch code takes a dozen launches and several host
synchronisations per row; here a whole batch of rows takes a fixed number of each.

Encode (``encode_many``): each program takes ``BLOCK`` values of one row (a table of row addresses
and sizes, so rows anywhere on the device go in one launch per value width).

1. ``_count``: per block, its changes, first and last changed position, the gaps >= 256 between its
   own changes, the steps that escape and its share of the row's ``fp64`` change.
2. torch on the device: each block's previous change (the last change of the nonempty blocks before
   it in its row: a scatter and a gather, ``_last_before``), hence whether its first gap escapes; where each block's changes, far gaps
   and far steps start (running sums per row); per row, the totals. One copy of the totals to the host
   (the only wait): the host sizes each row's delta, keeps those smaller than the row, lays them out in
   one buffer.
3. ``_write``: per block, the changed values into the base (every row: a row that goes whole leaves its
   base equal to the new bytes all the same) and, for rows that go as deltas, the gaps, steps, escapes
   and the header at their places, in the packed format ``delta.unpack_tensor`` reads.

The receiver's check and apply are ``engine.cuda.delta_apply``.

Far gaps and steps lie unaligned after the one-byte arrays, so they are stored and read byte by byte
(they are rare). Values of 1, 2 and 4 bytes; others take the torch code. Addresses travel as int64 in
the tables, so the kernels need no tensor of their own per row. The module imports Triton at import
time: import it only where it is.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from ..transforms import delta as codec

BLOCK = 1024  # values (encode) or changes (apply) per program
WARPS = 8  # per program: 4 values a thread, few registers
_INT = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_FAR = {1: 2, 2: 2, 4: 4}  # bytes of an escaped step
_MASK = (1 << 64) - 1


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _wrap(v, W: tl.constexpr):
    """``v`` (int64) wrapped to a signed integer of ``W`` bytes."""
    half: tl.constexpr = 1 << (8 * W - 1)
    return ((v + half) & (2 * half - 1)) - half


@triton.jit
def _share(p, b, a, W: tl.constexpr):
    """What value ``p`` going from bit pattern ``b`` to ``a`` (int64: sign-extended for 2 and 4 bytes,
    unsigned for 1) adds to its row's ``fp64`` (``checksums.fp64_change``)."""
    if W == 4:
        return (a - b) * (p % 65521 + 1)
    elif W == 2:
        low = (p & 1) == 0  # a word's low half counts unsigned
        b = tl.where(low & (b < 0), b + 65536, b)
        a = tl.where(low & (a < 0), a + 65536, a)
        return (a - b) * tl.where(low, 1, 65536) * ((p >> 1) % 65521 + 1)
    else:
        slot = p & 3  # a word's top byte counts signed
        b = tl.where((slot == 3) & (b >= 128), b - 256, b)
        a = tl.where((slot == 3) & (a >= 128), a - 256, a)
        return (a - b) * (1 << (slot * 8)) * ((p >> 2) % 65521 + 1)


@triton.jit
def _previous(changed, local):
    """Per value, the index in the block of the block's last change before it (-1: none); int32."""
    last = tl.associative_scan(tl.where(changed, local, -1), 0, _max)
    return tl.where(local == 0, -1, tl.gather(last, tl.maximum(local - 1, 0), 0))


@triton.jit
def _step(a, b, W: tl.constexpr):
    """The wrapped step from bit pattern ``b`` to ``a`` (int32: sign-extended, unsigned for 1 byte)."""
    if W == 4:
        return _wrap(a.to(tl.int64) - b.to(tl.int64), 4).to(tl.int32)
    else:
        half: tl.constexpr = 1 << (8 * W - 1)
        return ((a - b + half) & (2 * half - 1)) - half


@triton.jit
def _block_share(b, a, local, start, W: tl.constexpr):
    """``_share`` of a block's values (int32 bit patterns, the block starting at value ``start``, a
    multiple of 4): word weights in int32, from one 64-bit modulo per block."""
    SHIFT: tl.constexpr = 0 if W == 4 else (1 if W == 2 else 2)
    w = ((start >> SHIFT) % 65521).to(tl.int32) + (local >> SHIFT)
    w = (tl.where(w >= 65521, w - 65521, w) + 1).to(tl.int64)
    if W == 4:
        return (a.to(tl.int64) - b.to(tl.int64)) * w
    elif W == 2:
        low = (local & 1) == 0  # a word's low half counts unsigned
        b = tl.where(low & (b < 0), b + 65536, b)
        a = tl.where(low & (a < 0), a + 65536, a)
        return (a - b).to(tl.int64) * tl.where(low, 1, 65536) * w
    else:
        slot = local & 3  # a word's top byte counts signed
        b = tl.where((slot == 3) & (b >= 128), b - 256, b)
        a = tl.where((slot == 3) & (a >= 128), a - 256, a)
        return (a - b).to(tl.int64) * (1 << (slot * 8)).to(tl.int64) * w


@triton.jit
def _values(table, owner, BLOCK: tl.constexpr, IT: tl.constexpr):
    """A program's block of its row: (table entry, first value, indices in the block, in range, base
    and new pointers at the block, their bit patterns as int32)."""
    pid = tl.program_id(0).to(tl.int64)
    e = table + tl.load(owner + pid).to(tl.int64) * 8
    start = (pid - tl.load(e + 3)) * BLOCK
    local = tl.arange(0, BLOCK)
    mask = local < tl.minimum(tl.load(e + 2) - start, BLOCK).to(tl.int32)
    base = tl.load(e + 0).to(tl.pointer_type(IT)) + start
    new = tl.load(e + 1).to(tl.pointer_type(IT)) + start
    return pid, e, start, local, mask, base, new


@triton.jit
def _count(table, owner, out, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr):
    pid, e, start, local, mask, base, new = _values(table, owner, BLOCK, IT)
    b = tl.load(base + local, mask=mask, other=0).to(tl.int32)
    a = tl.load(new + local, mask=mask, other=0).to(tl.int32)
    changed = (a != b) & mask
    n = tl.sum(changed.to(tl.int32))
    step = _step(a, b, W)
    inner = n * 0
    if n > 1:  # gaps of 256 or more between the block's own changes
        prev = _previous(changed, local)
        inner = tl.sum((changed & (prev >= 0) & (local - prev >= 256)).to(tl.int32))
    o = out + pid * 6
    tl.store(o + 0, n.to(tl.int64))
    tl.store(o + 1, tl.min(tl.where(changed, local, BLOCK)).to(tl.int64))
    tl.store(o + 2, tl.max(tl.where(changed, local, -1)).to(tl.int64))
    tl.store(o + 3, inner.to(tl.int64))
    tl.store(o + 4, tl.sum((changed & ((step < -127) | (step > 127))).to(tl.int32)).to(tl.int64))
    tl.store(o + 5, tl.sum(tl.where(changed, _block_share(b, a, local, start, W), 0)))


@triton.jit
def _write(table, owner, starts, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr, FS: tl.constexpr,
           MAGIC: tl.constexpr):
    pid, e, start, local, mask, base, new = _values(table, owner, BLOCK, IT)
    raw = tl.load(new + local, mask=mask, other=0)
    b = tl.load(base + local, mask=mask, other=0).to(tl.int32)
    a = raw.to(tl.int32)
    changed = (a != b) & mask
    tl.store(base + local, raw, mask=changed)
    out = tl.load(e + 4)
    if out != 0:  # the row goes as a delta: its arrays, at their places in the packed bytes
        c, fg, fs = tl.load(e + 5), tl.load(e + 6), tl.load(e + 7)
        if pid == tl.load(e + 3):  # the header: magic, width, changes, far gaps, far steps, values
            h = tl.arange(0, 8)
            head = tl.where(h == 0, MAGIC, tl.where(h == 1, W, tl.where(h == 2, c, tl.where(
                h == 3, fg, tl.where(h == 4, fs, tl.load(e + 2))))))
            tl.store(out.to(tl.pointer_type(tl.int32)) + h, head.to(tl.int32), mask=h < 6)
        if tl.sum(changed.to(tl.int32)) > 0:
            s = starts + pid * 4  # where the block's changes, far gaps, far steps start; its previous change
            prev = _previous(changed, local)
            gap = tl.where(prev >= 0, (local - prev).to(tl.int64), start + local - tl.load(s + 3))
            step = _step(a, b, W)
            far_gap = changed & (gap >= 256)
            far_step = changed & ((step < -127) | (step > 127))
            rank = tl.load(s + 0) + (tl.cumsum(changed.to(tl.int32), 0) - changed.to(tl.int32))
            gap_rank = tl.load(s + 1) + (tl.cumsum(far_gap.to(tl.int32), 0) - far_gap.to(tl.int32))
            step_rank = tl.load(s + 2) + (tl.cumsum(far_step.to(tl.int32), 0) - far_step.to(tl.int32))
            bytes_ = out.to(tl.pointer_type(tl.uint8))
            tl.store(bytes_ + 24 + rank, tl.where(far_gap, 0, gap).to(tl.uint8), mask=changed)
            tl.store(bytes_ + 24 + c + rank, (tl.where(far_step, -128, step) & 255).to(tl.uint8), mask=changed)
            at = bytes_ + 24 + 2 * c + 4 * gap_rank
            for k in tl.static_range(4):
                tl.store(at + k, ((gap >> (8 * k)) & 255).to(tl.uint8), mask=far_gap)
            at = bytes_ + 24 + 2 * c + 4 * fg + FS * step_rank
            for k in tl.static_range(FS):
                tl.store(at + k, ((step >> (8 * k)) & 255).to(tl.uint8), mask=far_step)


def _owners(blocks: list[int], programs: int, device: torch.device) -> torch.Tensor:
    """Each program's row (int64, made on the device: millions of programs for a large model)."""
    counts = torch.tensor(blocks, dtype=torch.int64).to(device)
    return torch.repeat_interleave(torch.arange(len(blocks), device=device), counts, output_size=programs)


def _last_before(nonempty: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per block, ``ends`` of the last nonempty block before it (-1: none). Ends grow with the block
    index, so that is the end of the k-th nonempty block, k the nonempty blocks before: a scatter and a
    gather (a running maximum over millions of blocks is one thread block's work in torch)."""
    rank = torch.cumsum(nonempty.to(torch.int64), 0)  # nonempty blocks up to each, inclusive
    listed = torch.full((ends.numel() + 1,), -1, dtype=torch.int64, device=ends.device)
    listed.scatter_(0, torch.where(nonempty, rank - 1, ends.numel()), ends)  # (empty ones: the spare slot)
    k = rank - nonempty.to(torch.int64)
    return torch.where(k > 0, listed[(k - 1).clamp(min=0)], -1)


def _segment_totals(values: torch.Tensor, firsts: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of ``values`` (rows of ``values.shape[1]`` columns) over its blocks (``firsts``:
    its first block; ``blocks``: how many, maybe 0): differences of one running sum, read at each row's
    ends (an ``index_add_`` of millions of blocks into a few hundred rows serialises on atomics)."""
    running = torch.cumsum(values, 0)
    last = (firsts + blocks - 1).clamp(min=0)
    before = torch.where((firsts > 0)[:, None], running[(firsts - 1).clamp(min=0)], 0)
    return torch.where((blocks > 0)[:, None], running[last] - before, 0)


def _segment_starts(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Each block's exclusive running sum of ``values`` within its row (``first``: each block's row's
    first block)."""
    running = torch.cumsum(values, 0) - values
    return running - running[first]


class Encoded:
    """One row's outcome: ``packed`` (its delta's bytes) or None to go whole; the values it changed and
    its ``fp64`` change (mod 2**64)."""

    __slots__ = ("packed", "changes", "change")

    def __init__(self, packed: Optional[torch.Tensor], changes: int, change: int) -> None:
        self.packed, self.changes, self.change = packed, changes, change


def encode_many(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> list[Encoded]:
    """Bring each ``base`` to its ``new`` (1-D, contiguous, same dtype and device, values of 1, 2 or 4
    bytes), returning each row's delta (see the module's header). Waits for the device once, for the
    totals; with ``wait``, also at the end (else the packed bytes and bases are complete once the work
    queued on the device's current stream so far is)."""
    if not rows:
        return []
    device = rows[0][1].device
    out: list[Optional[Encoded]] = [None] * len(rows)
    by_width: dict[int, list[int]] = {}
    for k, (base, new) in enumerate(rows):
        by_width.setdefault(new.element_size(), []).append(k)
    with _on(device):  # (Triton launches on the current device)
        for width, members in by_width.items():
            for k, done in zip(members, _encode_width([rows[k] for k in members], width, device)):
                out[k] = done
        if wait and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return out  # type: ignore[return-value]


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _layout(counts: list[int]) -> tuple[list[int], list[int], int]:
    """Programs for items of ``counts`` values (changes), ``BLOCK`` a program: (each item's programs,
    its first program, all of them)."""
    blocks = [-(-n // BLOCK) for n in counts]
    firsts, programs = [], 0
    for b in blocks:
        firsts.append(programs)
        programs += b
    return blocks, firsts, programs


def _encode_width(rows: list[tuple[torch.Tensor, torch.Tensor]], width: int, device: torch.device) -> list[Encoded]:
    numels = [new.numel() for _, new in rows]
    blocks, firsts, programs = _layout(numels)
    entries = [[base.data_ptr(), new.data_ptr(), n, f, 0, 0, 0, 0] for (base, new), n, f in zip(rows, numels, firsts)]
    if not programs:  # empty rows: a header only
        return _finish(rows, entries, torch.zeros((len(rows), 5), dtype=torch.int64), width, device)
    owner = _owners(blocks, programs, device)
    table = torch.tensor(entries, dtype=torch.int64).to(device)
    counts = torch.empty((programs, 6), dtype=torch.int64, device=device)
    _count[(programs,)](table, owner, counts, BLOCK=BLOCK, W=width, IT=_INT[width], num_warps=WARPS)
    row = owner  # (each block's row)
    firsts_t = torch.tensor(firsts, dtype=torch.int64, device=device)
    first_block = firsts_t[row]
    n, first, last, inner, steps, fp = counts.unbind(1)
    row_start = torch.tensor([0] + numels[:-1], dtype=torch.int64, device=device).cumsum(0)[row]
    block_start = (torch.arange(programs, device=device) - first_block) * BLOCK + row_start  # in the batch
    before = _last_before(n > 0, block_start + last)
    prev = torch.where(before >= row_start, before - row_start, -1)  # the previous change in the row
    far_first = (n > 0) & (block_start - row_start + first - prev >= 256)
    far = inner + far_first.to(torch.int64)
    starts = torch.stack((_segment_starts(n, first_block), _segment_starts(far, first_block),
                          _segment_starts(steps, first_block), prev), 1).contiguous()
    totals = _segment_totals(torch.stack((n, far, steps, fp & 0xFFFFFFFF, fp >> 32), 1),
                             firsts_t, torch.tensor(blocks, dtype=torch.int64, device=device))
    return _finish(rows, entries, totals.cpu(), width, device, (table, owner, starts, programs))


def _finish(rows, entries, totals: torch.Tensor, width: int, device: torch.device, launch=None) -> list[Encoded]:
    """Size the deltas, keep those smaller than their rows, write them (and every base)."""
    far = _FAR[width]
    totals = totals.tolist()
    sizes, at, total = [], [], 0
    for (c, fg, fs, low, high), (_, new) in zip(totals, rows):
        nbytes = codec.HEADER_BYTES + 2 * c + 4 * fg + far * fs
        keep = nbytes < new.numel() * width
        sizes.append(nbytes if keep else 0)
        at.append(total)
        total += -(-nbytes // 16) * 16 if keep else 0
    packed = torch.empty(total, dtype=torch.uint8, device=device)
    for k, (c, fg, fs, *_) in enumerate(totals):
        entries[k][4:8] = [packed.data_ptr() + at[k] if sizes[k] else 0, c, fg, fs]
    if launch is not None:
        table, owner, starts, programs = launch
        table.copy_(torch.tensor(entries, dtype=torch.int64))
        _write[(programs,)](table, owner, starts, BLOCK=BLOCK, W=width, IT=_INT[width], FS=far, MAGIC=codec.MAGIC,
                                   num_warps=WARPS)
    else:  # no values at all: headers only
        for k, e in enumerate(entries):
            if sizes[k]:
                head = codec.header(width, e[5], e[6], e[7], e[2])
                packed[at[k]:at[k] + codec.HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    return [Encoded(packed[a:a + s] if s else None, c, ((high << 32) + low) & _MASK)
            for a, s, (c, _, _, low, high) in zip(at, sizes, totals)]
