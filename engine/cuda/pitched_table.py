"""Descriptor tables of 2-D copies, for one kernel launch: planning only (no CUDA, no Triton).

How this works. A *pitched* copy ``(dst, src, width, height, pitch)`` moves ``height`` rows of ``width``
bytes that lie ``pitch`` bytes apart at the source and land back to back at ``dst`` (a row-parallel TP
slice cut from an FSDP shard: every local row, some columns). ``table(copies)`` cuts each into *pieces*
of at most ``rows`` rows of at most ``tile`` words (4-byte units), one row of the table each:
``(src_at, dst_at, width, height, src_pitch, dst_pitch)`` in words, counted from the lowest source and
destination address (``Table.src_base``, ``dst_base``). A kernel then runs one program per piece
(``engine.cuda.copy_kernel.PitchedKernel``), so every pitched row of a lane is one launch instead of a
``cudaMemcpy2DAsync`` each (tests/engine/test_pitched_table.py carries tables out piece by piece with
torch against a copy per row, byte for byte).

Copies whose addresses, widths or pitches are not 4-byte multiples are left out (``Table.rest``: the
caller copies them its own way). Pure data in, data out.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

WORD = 4
TILE = 256  # words of a row a program copies at most (1 KiB)
ROWS = 16  # rows a program copies at most
Copy = tuple[int, int, int, int, int]  # dst, src, width bytes, height rows, source pitch bytes


@dataclasses.dataclass(frozen=True)
class Table:
    pieces: torch.Tensor  # int64 [n, 6]: src_at, dst_at, width, height, src_pitch, dst_pitch (words)
    src_base: int  # byte address the source offsets count from
    dst_base: int
    rest: tuple[Copy, ...]  # copies the table cannot address (not 4-byte aligned)
    nbytes: int  # bytes the pieces move

    def __len__(self) -> int:
        return self.pieces.shape[0]


def aligned(copy: Copy) -> bool:
    dst, src, width, _, pitch = copy
    return not (dst | src | width | pitch) % WORD


def table(copies: Sequence[Copy], tile: int = TILE, rows: int = ROWS) -> Table:
    """``copies`` as pieces of at most ``rows`` x ``tile`` words (empty copies dropped)."""
    live = [c for c in copies if c[2] and c[3]]
    ok = [c for c in live if aligned(c)]
    rest = tuple(c for c in live if not aligned(c))
    if not ok:
        return Table(torch.zeros((0, 6), dtype=torch.int64), 0, 0, rest, 0)
    src_base, dst_base = min(c[1] for c in ok), min(c[0] for c in ok)
    dst, src, width, height, pitch = (torch.tensor([c[i] for c in ok], dtype=torch.int64) for i in range(5))
    w, p = width // WORD, pitch // WORD
    across, down = (w + tile - 1) // tile, (height + rows - 1) // rows  # column tiles, row groups
    counts = across * down
    copy = torch.repeat_interleave(torch.arange(len(ok)), counts)
    k = torch.arange(int(counts.sum()), dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    r, c = k // across[copy] * rows, k % across[copy] * tile  # the piece's first row and first word
    pieces = torch.stack([(src[copy] - src_base) // WORD + r * p[copy] + c, (dst[copy] - dst_base) // WORD + r * w[copy] + c,
                          (w[copy] - c).clamp(max=tile), (height[copy] - r).clamp(max=rows), p[copy], w[copy]], dim=1)
    return Table(pieces.contiguous(), src_base, dst_base, rest, int((width * height).sum()))

