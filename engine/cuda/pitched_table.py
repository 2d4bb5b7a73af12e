"""Descriptor tables of copies, for one kernel launch: planning only (no CUDA, no Triton).

How this works. A *dense* copy ``(dst, src, nbytes)`` is cut by ``dense(copies, piece)`` into pieces of
at most ``piece`` bytes: ``(src_at, dst_at, words)`` in 4-byte words from the lowest source and
destination (``engine.cuda.copy_kernel.CopyKernel``). A *pitched* copy ``(dst, src, width, height, pitch)`` moves ``height`` rows of ``width``
bytes that lie ``pitch`` bytes apart at the source and land back to back at ``dst`` (a row-parallel TP
slice cut from an FSDP shard: every local row, some columns). ``table(copies)`` cuts each into *pieces*
of at most ``rows`` rows of at most ``tile`` words (4-byte units), one row of the table each:
``(src_at, dst_at, width, height, src_pitch, dst_pitch)`` in words, counted from the lowest source and
destination address (``Table.src_base``, ``dst_base``). A kernel then runs one program per piece
(``engine.cuda.copy_kernel.PitchedKernel``), so every pitched row of a lane is one launch instead of a
``cudaMemcpy2DAsync`` each (tests/engine/test_pitched_table.py carries tables out piece by piece with
torch against a copy per row, byte for byte).

Copies whose addresses, widths or pitches are not 4-byte multiples are left out (``Table.rest``: the
caller copies them its own way). Pure data in, data out. The tables are built with numpy, single-threaded:
a compiled round builds them inside the round that first needs them, where torch's CPU operators took
40-180 ms for tens of thousands of pieces in processes sharing a host's cores (their thread pools
oversubscribed); numpy builds the 7B lane's 241,472 pieces in about 4 ms on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

WORD = 4
TILE = 256  # words of a row a program copies at most (1 KiB)
ROWS = 16  # rows a program copies at most
WARPS = 4  # (bench/diagnostics/copy_kernel.py --pitched times other shapes)
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


def vectors(copies: Sequence[Copy]) -> bool:
    """Every 4-byte-aligned copy's addresses, width and pitch are 16-byte multiples: each piece's offsets,
    widths and pitches in words are then multiples of 4 (tiles are too), so a kernel may move 16-byte vectors."""
    return all(not (c[0] | c[1] | c[2] | c[4]) % 16 for c in copies if aligned(c))


def _pieces(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[i]`` pieces of copy ``i``: each piece's copy and its number inside that copy."""
    copy = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return copy, np.arange(int(counts.sum()), dtype=np.int64) - first[copy]


def dense(copies: Sequence[tuple[int, int, int]], piece: int) -> tuple[torch.Tensor, int, int]:
    """``(dst, src, nbytes)`` copies whose addresses and lengths are 4-byte multiples, cut into pieces of
    at most ``piece`` bytes (a multiple of 4): the int64 table ``[n, 3]`` (source word offset,
    destination word offset, words) from the lowest source and destination, and those two addresses."""
    dst, src, size = np.array(copies, dtype=np.int64).reshape(-1, 3).T
    src_base, dst_base = int(src.min()), int(dst.min())
    words = piece // WORD
    counts = (size + piece - 1) // piece
    at = np.arange(int(counts.sum()), dtype=np.int64) * words  # each piece's first word inside its copy:
    at -= np.repeat((np.cumsum(counts) - counts) * words, counts)  # (repeats, not gathers: a 7B table in ms)
    out = np.empty((len(at), 3), dtype=np.int64)
    np.add(np.repeat((src - src_base) // WORD, counts), at, out=out[:, 0])
    np.add(np.repeat((dst - dst_base) // WORD, counts), at, out=out[:, 1])
    np.minimum(np.repeat(size // WORD, counts) - at, words, out=out[:, 2])
    return torch.from_numpy(out), src_base, dst_base


def table(copies: Sequence[Copy], tile: int = TILE, rows: int = ROWS) -> Table:
    """``copies`` as pieces of at most ``rows`` x ``tile`` words (empty copies dropped)."""
    live = [c for c in copies if c[2] and c[3]]
    ok = [c for c in live if aligned(c)]
    rest = tuple(c for c in live if not aligned(c))
    if not ok:
        return Table(torch.zeros((0, 6), dtype=torch.int64), 0, 0, rest, 0)
    dst, src, width, height, pitch = np.array(ok, dtype=np.int64).T
    src_base, dst_base = int(src.min()), int(dst.min())
    w, p = width // WORD, pitch // WORD
    across, down = (w + tile - 1) // tile, (height + rows - 1) // rows  # column tiles, row groups
    copy, k = _pieces(across * down)
    r, c = k // across[copy] * rows, k % across[copy] * tile  # the piece's first row and first word
    pieces = np.stack([(src[copy] - src_base) // WORD + r * p[copy] + c, (dst[copy] - dst_base) // WORD + r * w[copy] + c,
                       np.minimum(w[copy] - c, tile), np.minimum(height[copy] - r, rows), p[copy], w[copy]], axis=1)
    return Table(torch.from_numpy(np.ascontiguousarray(pieces)), src_base, dst_base, rest, int((width * height).sum()))
