"""Deltas of many GPU rows in a few launches (Triton): the sender's encoder.

``engine.transforms.delta`` defines the format (one byte per changed value for the gap from the
previous change, 0 escaping to a uint32; one byte for the wrapped step of its bit pattern, -128
escaping to a wider integer; a 24-byte header). Its torch code takes a dozen launches and several host
synchronisations per row; here a whole batch of rows takes a fixed number of each.

How this works (``encode_many``): rows anywhere on the device go in one launch per stage and value
width, through tables of row addresses and sizes (int64, so the kernels need no tensor per row).

1. ``_count``: each program compares ``TILE`` values of one row with its base: the changes of its
   tile. A running sum per row gives each tile where its changes go; one copy of the rows' change
   counts to the host (the first wait) sizes the staging.
2. ``_compact``: each tile with changes writes their positions (int32) in order: the changed values
   compacted, each row's starting at a multiple of ``BLOCK``. Stream compaction is the only pass over
   every value after the first; the rest reads about 1% of them.
3. ``_measure``: each program takes ``BLOCK`` changes of one row: its escaped gaps and steps and its
   share of the row's ``fp64`` change (old and new values gathered from the base and the new bytes).
   Running sums per row; one copy of the rows' totals to the host (the second wait): the host sizes
   each row's delta, keeps those smaller than the row, lays them out in one buffer, writes the headers.
4. ``_pack``: per block of changes, the gaps, steps and escapes at their places in the packed format
   ``delta.unpack_tensor`` reads, and the new values into the base (every row: a row that goes whole
   leaves its base equal to the new bytes all the same).

Positions take 4 bytes a change while a batch is encoded, within ``STAGING_SHARE`` of the batch's bytes
(at least ``STAGING_MIN``): rows whose changes outgrow that go through stages 2 to 4 in groups that fit
it (a row that alone outgrows it goes whole, its base copied). Far
gaps and steps lie unaligned after the one-byte arrays, so they are stored and read byte by byte (they
are rare). Values of 1, 2 and 4 bytes; others take the torch code. Sums across many blocks are 1-D
running sums (torch's scan of a 2-D tensor's outer dimension runs a column a thread: 100x slower).
The module imports Triton at import time: import it only where it is.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from ..transforms import delta as codec
from ..transforms.delta import Encoded

TILE = 2048  # values a program compares (count and compact)
TILE_WARPS = 4
BLOCK = 1024  # changes per program (measure and pack; the receiver's apply)
WARPS = 8  # per program: 4 changes a thread, few registers
STAGING_MIN = 64 << 20  # bytes of positions a batch may always stage
STAGING_SHARE = 8  # ... or its bytes over this
_INT = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_FAR = {1: 2, 2: 2, 4: 4}  # bytes of an escaped step
_MASK = (1 << 64) - 1


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
def _step(a, b, W: tl.constexpr):
    """The wrapped step from bit pattern ``b`` to ``a`` (int64)."""
    if W == 1:
        return ((a - b + 128) & 255) - 128
    else:
        return _wrap(a - b, W)


@triton.jit
def _tile(table, owner, TILE: tl.constexpr, IT: tl.constexpr):
    """A program's tile of its row: (program, first value, indices, in range, base and new at the tile)."""
    pid = tl.program_id(0).to(tl.int64)
    e = table + tl.load(owner + pid).to(tl.int64) * 8
    start = (pid - tl.load(e + 3)) * TILE
    local = tl.arange(0, TILE)
    mask = local < tl.minimum(tl.load(e + 2) - start, TILE).to(tl.int32)
    base = tl.load(e + 0).to(tl.pointer_type(IT)) + start
    new = tl.load(e + 1).to(tl.pointer_type(IT)) + start
    return pid, start, local, mask, base, new


@triton.jit
def _count(table, owner, counts, TILE: tl.constexpr, IT: tl.constexpr):
    pid, start, local, mask, base, new = _tile(table, owner, TILE, IT)
    b = tl.load(base + local, mask=mask, other=0)
    a = tl.load(new + local, mask=mask, other=0)
    tl.store(counts + pid, tl.sum(((a != b) & mask).to(tl.int32)).to(tl.int64))


@triton.jit
def _compact(table, owner, counts, offsets, pos, TILE: tl.constexpr, IT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    at = tl.load(offsets + pid)
    if (tl.load(counts + pid) > 0) & (at >= 0):  # (-1: the row goes whole)
        pid, start, local, mask, base, new = _tile(table, owner, TILE, IT)
        b = tl.load(base + local, mask=mask, other=0)
        a = tl.load(new + local, mask=mask, other=0)
        changed = ((a != b) & mask).to(tl.int32)
        rank = at + (tl.cumsum(changed, 0) - changed)
        tl.store(pos + rank, (start + local).to(tl.int32), mask=changed != 0)


@triton.jit
def _changes(rows, cowner, pos, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr):
    """A program's changes of its row: (program, row entry, change index, count, in range, positions,
    gaps, old and new bit patterns as int64, new raw, where the row's values are)."""
    pid = tl.program_id(0).to(tl.int64)
    e = rows + tl.load(cowner + pid).to(tl.int64) * 8
    j = (pid - tl.load(e + 2)) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(e + 1)
    mask = j < c
    at = pos + tl.load(e + 0) + j
    p = tl.load(at, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    q = tl.load(at - 1, mask=mask & (j > 0), other=-1).to(tl.int64)
    q = tl.where(j > 0, q & 0xFFFFFFFF, -1)
    base = tl.load(e + 6).to(tl.pointer_type(IT))
    raw = tl.load(tl.load(e + 7).to(tl.pointer_type(IT)) + p, mask=mask, other=0)
    b = tl.load(base + p, mask=mask, other=0).to(tl.int64)
    return pid, e, j, c, mask, p, p - q, b, raw.to(tl.int64), raw, base


@triton.jit
def _measure(rows, cowner, pos, sums, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr):
    pid, e, j, c, mask, p, gap, b, a, raw, base = _changes(rows, cowner, pos, BLOCK, W, IT)
    step = _step(a, b, W)
    o = sums + pid * 3
    tl.store(o + 0, tl.sum((mask & (gap >= 256)).to(tl.int64)))
    tl.store(o + 1, tl.sum((mask & ((step < -127) | (step > 127))).to(tl.int64)))
    tl.store(o + 2, tl.sum(tl.where(mask, _share(p, b, a, W), 0)))


@triton.jit
def _pack(rows, cowner, pos, starts, BLOCK: tl.constexpr, W: tl.constexpr, IT: tl.constexpr, FS: tl.constexpr):
    pid, e, j, c, mask, p, gap, b, a, raw, base = _changes(rows, cowner, pos, BLOCK, W, IT)
    out = tl.load(e + 3)
    if out != 0:  # the row goes as a delta: its arrays, at their places in the packed bytes
        step = _step(a, b, W)
        far_gap = mask & (gap >= 256)
        far_step = mask & ((step < -127) | (step > 127))
        fg = far_gap.to(tl.int64)
        fs = far_step.to(tl.int64)
        gap_rank = tl.load(starts + pid * 2) + tl.cumsum(fg, 0) - fg
        step_rank = tl.load(starts + pid * 2 + 1) + tl.cumsum(fs, 0) - fs
        bytes_ = out.to(tl.pointer_type(tl.uint8))
        tl.store(bytes_ + 24 + j, tl.where(far_gap, 0, gap).to(tl.uint8), mask=mask)
        tl.store(bytes_ + 24 + c + j, (tl.where(far_step, -128, step) & 255).to(tl.uint8), mask=mask)
        at = bytes_ + 24 + 2 * c + 4 * gap_rank
        for k in tl.static_range(4):
            tl.store(at + k, ((gap >> (8 * k)) & 255).to(tl.uint8), mask=far_gap)
        at = bytes_ + 24 + 2 * c + 4 * tl.load(e + 4) + FS * step_rank
        for k in tl.static_range(FS):
            tl.store(at + k, ((step >> (8 * k)) & 255).to(tl.uint8), mask=far_step)
    tl.store(base + p, raw, mask=mask)  # (after every read of the old values)


def _owners(blocks, programs: int, device: torch.device) -> torch.Tensor:
    """Each program's row (int64, made on the device: millions of programs for a large model); ``blocks``
    a list or an int64 tensor on ``device``."""
    counts = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(blocks, dtype=torch.int64).to(device)
    return torch.repeat_interleave(torch.arange(len(blocks), device=device), counts, output_size=programs)


def _segment_totals(values: torch.Tensor, firsts: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of ``values`` (rows of ``values.shape[1]`` columns) over its blocks (``firsts``:
    its first block; ``blocks``: how many, maybe 0): differences of one running sum per column, read at
    each row's ends (an ``index_add_`` of millions of blocks into a few hundred rows serialises on
    atomics)."""
    running = torch.stack([torch.cumsum(values[:, k], 0) for k in range(values.shape[1])], 1)
    last = (firsts + blocks - 1).clamp(min=0)
    before = torch.where((firsts > 0)[:, None], running[(firsts - 1).clamp(min=0)], 0)
    return torch.where((blocks > 0)[:, None], running[last] - before, 0)


def _segment_starts(values: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Each block's exclusive running sum of ``values`` (1-D) within its row (``first``: each block's
    row's first block)."""
    running = torch.cumsum(values, 0) - values
    return running - running[first]


def encode_many(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> list[Encoded]:
    """Bring each ``base`` to its ``new`` (1-D, contiguous, same dtype and device, values of 1, 2 or 4
    bytes), returning each row's delta (see the module's header). Waits for the device twice, for the
    sizes; with ``wait``, also at the end (else the packed bytes and bases are complete once the work
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
            for k, done in zip(members, _Batch([rows[k] for k in members], width, device).run()):
                out[k] = done
        if wait and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return out  # type: ignore[return-value]


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _layout(counts: list[int], per: int = BLOCK) -> tuple[list[int], list[int], int]:
    """Programs for items of ``counts`` values (changes), ``per`` a program: (each item's programs, its
    first program, all of them)."""
    blocks = [-(-n // per) for n in counts]
    firsts, programs = [], 0
    for b in blocks:
        firsts.append(programs)
        programs += b
    return blocks, firsts, programs


def _tensor(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _upload(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """Lists of ints as int64 tensors on ``device``, in one copy. (Made before a stage's launches: a copy
    from pageable memory waits for the work queued before it.)"""
    return list(_tensor([v for values in lists for v in values], device).split([len(v) for v in lists]))


class _Batch:
    """One width's rows through the four stages (the module's header)."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]], width: int, device: torch.device) -> None:
        self.rows, self.width, self.device = rows, width, device
        self.it = _INT[width]

    def run(self) -> list[Encoded]:
        changes = self._count()
        out: list[Optional[Encoded]] = [None] * len(self.rows)
        for members in self._groups(changes):
            self._group(members, changes, out)
        for k, (base, new) in enumerate(self.rows):
            if out[k] is None:  # whole: no delta of it could be smaller, or it alone outgrows the staging
                if changes[k]:
                    base.copy_(new)
                out[k] = Encoded(None, changes[k], 0)
        return out  # type: ignore[return-value]

    def _group(self, members: list[int], changes: list[int], out: list) -> None:
        """Stages 2 to 4 for rows ``members`` (their positions fit the staging together)."""
        counted = [changes[k] for k in members]
        if not sum(counted):
            self._finish(members, counted, [(0, 0, 0, 0)] * len(members), None, out)
            return
        pos, rows, cowner, blocks_t, bfirsts_t, programs = self._compact(members, counted)
        sums = torch.empty((programs, 3), dtype=torch.int64, device=self.device)
        _measure[(programs,)](rows, cowner, pos, sums, BLOCK=BLOCK, W=self.width, IT=self.it, num_warps=WARPS)
        fg, fs, share = sums.unbind(1)
        first = bfirsts_t[cowner]
        starts = torch.stack((_segment_starts(fg, first), _segment_starts(fs, first)), 1).contiguous()
        totals = _segment_totals(torch.stack((fg, fs, share & 0xFFFFFFFF, share >> 32), 1), bfirsts_t,
                                 blocks_t).cpu().tolist()
        self._finish(members, counted, totals, (pos, rows, cowner, starts, programs), out)

    def _count(self) -> list[int]:
        """Each row's changed values (the first wait)."""
        numels = [new.numel() for _, new in self.rows]
        tiles, firsts, programs = _layout(numels, TILE)
        self.entries = [[base.data_ptr(), new.data_ptr(), n, f, 0, 0, 0, 0]
                        for (base, new), n, f in zip(self.rows, numels, firsts)]
        if not programs:
            return [0] * len(self.rows)
        tiles_t, firsts_t = _upload(self.device, tiles, firsts)
        self.table = _tensor(self.entries, self.device)
        self.owner = _owners(tiles_t, programs, self.device)
        self.counts = torch.empty(programs, dtype=torch.int64, device=self.device)
        _count[(programs,)](self.table, self.owner, self.counts, TILE=TILE, IT=self.it, num_warps=TILE_WARPS)
        self.in_row = _segment_starts(self.counts, firsts_t[self.owner])
        return _segment_totals(self.counts[:, None], firsts_t, tiles_t)[:, 0].cpu().tolist()

    def _groups(self, changes: list[int]) -> list[list[int]]:
        """The rows that may go as deltas (two bytes a change at least: smaller than the row), in groups
        whose positions fit the staging (a row that alone outgrows it goes whole)."""
        room = max(STAGING_MIN, sum(new.numel() * self.width for _, new in self.rows) // STAGING_SHARE) // 4
        groups: list[list[int]] = [[]]
        left = room
        for k, (_, new) in enumerate(self.rows):
            if 2 * changes[k] + codec.HEADER_BYTES >= new.numel() * self.width or changes[k] > room:
                continue
            if changes[k] > left:
                groups.append([])
                left = room
            groups[-1].append(k)
            left -= changes[k]
        return [g for g in groups if g]

    def _compact(self, members: list[int], counted: list[int]):
        """Rows ``members``' changed positions, each row's from a multiple of ``BLOCK``; the tables of the
        change blocks."""
        blocks, bfirsts, programs = _layout(counted)
        placed = [-1] * len(self.rows)
        for k, first in zip(members, bfirsts):
            placed[k] = first * BLOCK
        self.change_rows = [[placed[k], c, f, 0, 0, 0, *self.entries[k][:2]] for k, c, f in zip(members, counted, bfirsts)]
        rows = _tensor(self.change_rows, self.device)
        placed_t, blocks_t, bfirsts_t = _upload(self.device, placed, blocks, bfirsts)
        pos = torch.empty(programs * BLOCK, dtype=torch.int32, device=self.device)
        at = placed_t[self.owner]
        offsets = torch.where(at >= 0, at + self.in_row, -1)
        _compact[(self.owner.numel(),)](self.table, self.owner, self.counts, offsets, pos, TILE=TILE, IT=self.it,
                                        num_warps=TILE_WARPS)
        return pos, rows, _owners(blocks_t, programs, self.device), blocks_t, bfirsts_t, programs

    def _finish(self, members: list[int], counted: list[int], totals, launch, out: list) -> None:
        """Size the deltas of rows ``members``, keep those smaller than their rows, write them and
        their bases (a row that goes whole: its base too)."""
        far = _FAR[self.width]
        sizes, at, total, heads = [], [], 0, []
        for k, c, (fg, fs, _, _) in zip(members, counted, totals):
            numel = self.rows[k][1].numel()
            nbytes = codec.HEADER_BYTES + 2 * c + 4 * fg + far * fs
            keep = nbytes < numel * self.width
            sizes.append(nbytes if keep else 0)
            at.append(total)
            if keep:
                heads.append((total // 4, codec.MAGIC, self.width, c, fg, fs, numel))
                total += -(-nbytes // 16) * 16
        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        if heads:
            fields = _tensor(heads, self.device)
            words = packed.view(torch.int32)
            words[fields[:, :1] + torch.arange(6, device=self.device)] = fields[:, 1:].to(torch.int32)
        if launch is not None:
            pos, rows, cowner, starts, programs = launch
            for entry, a, size, (fg, fs, _, _) in zip(self.change_rows, at, sizes, totals):
                entry[3:6] = [packed.data_ptr() + a if size else 0, fg, fs]
            rows.copy_(torch.tensor(self.change_rows, dtype=torch.int64))
            _pack[(programs,)](rows, cowner, pos, starts, BLOCK=BLOCK, W=self.width, IT=self.it, FS=far,
                               num_warps=WARPS)
        lengths = [n for size in sizes if size for n in (size, -(-size // 16) * 16 - size)]
        views = iter(packed.split(lengths)[::2])  # (one call for every row's view of the packed bytes)
        for k, c, size, (_, _, low, high) in zip(members, counted, sizes, totals):
            if size:
                out[k] = Encoded(next(views), c, ((high << 32) + low) & _MASK)
            elif c:  # (a delta no smaller than its row: the base took the new values all the same)
                out[k] = Encoded(None, c, 0)
