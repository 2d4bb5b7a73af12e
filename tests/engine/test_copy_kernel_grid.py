"""The copy kernels (``engine.cuda.copy_kernel``) with a bounded grid copy exactly what a program per piece
does: every program loops over every ``grid``-th piece. Run on the CPU under Triton's interpreter where it
is installed (``TRITON_INTERPRET=1``; ``make test`` has no Triton and skips these), on dense and pitched
tables (mixed sizes, pieces past the grid, a grid larger than the table)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from weightsync.engine.cuda import pitched_table

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")


def _addr(x: torch.Tensor) -> int:
    return x.data_ptr()


@pytest.mark.parametrize("programs", [None, 1, 3, 10_000])
def test_dense_pieces_equal_the_copies_whatever_the_grid(programs):
    from weightsync.engine.cuda.copy_kernel import _copy_pieces_kernel, grid

    g = torch.Generator().manual_seed(0)
    src = torch.randint(-2**31, 2**31 - 1, (9000,), generator=g, dtype=torch.int32)
    dst = torch.zeros(9000, dtype=torch.int32)
    spans = [(0, 4000), (4000, 4004), (4100, 9000)]  # (word ranges: one spans several 1 KiB pieces)
    copies = [(_addr(dst) + a * 4, _addr(src) + a * 4, (b - a) * 4) for a, b in spans]
    table, src_base, dst_base = pitched_table.dense(copies, 256 * 4)
    assert len(table) > 3 and (src_base, dst_base) == (_addr(src), _addr(dst))
    # (the interpreter takes tensors where the GPU launch passes raw addresses: the same bases here)
    _copy_pieces_kernel[(grid(len(table), programs),)](table, src, dst, len(table), TILE=64, STEPS=4)
    want = torch.zeros_like(dst)
    for a, b in spans:
        want[a:b] = src[a:b]
    assert torch.equal(dst, want)


@pytest.mark.parametrize("programs", [None, 2, 7])
@pytest.mark.parametrize("vec", [False, True])
def test_pitched_pieces_equal_the_copies_whatever_the_grid(programs, vec):
    from weightsync.engine.cuda.copy_kernel import _pitched_pieces_kernel, grid

    g = torch.Generator().manual_seed(1)
    src = torch.randn(70, 300, generator=g)  # rows of 1200 bytes: take columns 10:290 of every row
    dst = torch.zeros(70, 280)
    t = pitched_table.table([(_addr(dst), _addr(src) + 40, 280 * 4, 70, 300 * 4)], tile=64, rows=16)
    assert len(t) > 7
    words, out = src.view(torch.int32).view(-1)[10:], dst.view(torch.int32).view(-1)  # (at the table's bases)
    assert (_addr(words), _addr(out)) == (t.src_base, t.dst_base)
    _pitched_pieces_kernel[(grid(len(t), programs),)](t.pieces, words, out, len(t), TILE=64, ROWS=16, VEC=vec)
    assert torch.equal(dst, src[:, 10:290])


def test_the_grid_is_a_program_per_piece_or_at_most_the_bound():
    from weightsync.engine.cuda.copy_kernel import grid

    assert grid(100, None) == grid(100, 0) == 100
    assert grid(100, 33) == 33 and grid(5, 33) == 5 and grid(0, 33) == 1
