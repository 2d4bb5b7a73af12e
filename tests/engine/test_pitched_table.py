"""Descriptor tables of copies (engine/cuda/pitched_table.py): carried out piece by piece they land every
byte where a copy per row (or per dense copy) would; what they cannot address is left to the caller."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.engine.cuda import pitched_table as pt


def _copies(draw_sizes, src: torch.Tensor, dst: torch.Tensor) -> list[pt.Copy]:
    """Blocks of rows (some columns of a matrix, ``pitch`` apart) and contiguous runs (height 1), landing
    back to back in ``dst``."""
    out, at = [], 0
    for rows, cols, pitch_extra, col0, itemsize in draw_sizes:
        width, pitch = cols * itemsize, (cols + pitch_extra) * itemsize
        start = (col0 * itemsize) % max(1, src.numel() - rows * pitch)
        if start + rows * pitch > src.numel() or at + width * rows > dst.numel():
            break
        out.append((dst.data_ptr() + at, src.data_ptr() + start, width, rows, pitch))
        at += width * rows
    return out


def _pieces(t: pt.Table, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry ``t`` out piece by piece, as the kernel does: ``src`` and ``dst`` 1-D uint8 whose byte 0 is at
    ``t.src_base`` and ``t.dst_base``."""
    s, d = src.view(torch.int32), dst.view(torch.int32)
    for src_at, dst_at, width, height, src_pitch, dst_pitch in t.pieces.tolist():
        for r in range(height):
            d[dst_at + r * dst_pitch:dst_at + r * dst_pitch + width] = s[src_at + r * src_pitch:src_at + r * src_pitch + width]


def _per_row(copies, src: torch.Tensor, dst: torch.Tensor, dst_address: int) -> None:
    """Each copy row by row into ``dst``, the copies' destinations counted from ``dst_address``."""
    for d, s, width, height, pitch in copies:
        for r in range(height):
            a, b = s - src.data_ptr() + r * pitch, d - dst_address + r * width
            dst[b:b + width] = src[a:a + width]


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 700), st.integers(0, 300), st.integers(0, 5000),
                                st.sampled_from([1, 2, 4])), min_size=1, max_size=12),
       tile=st.sampled_from([7, 256]), rows=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16))
def test_a_table_lands_every_row_where_a_copy_per_row_would(sizes, tile, rows, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (1 << 20,), generator=g, dtype=torch.uint8)
    want, got = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    copies = _copies(sizes, src, got)
    _per_row(copies, src, want, got.data_ptr())
    t = pt.table(copies, tile=tile, rows=rows)
    assert len(t.rest) + sum(1 for c in copies if pt.aligned(c)) == len(copies)
    assert t.pieces[:, 2].max().item() <= tile if len(t) else True
    assert t.nbytes == sum(c[2] * c[3] for c in copies if pt.aligned(c))
    if len(t):
        _pieces(t, src[t.src_base - src.data_ptr():], got[t.dst_base - got.data_ptr():])
    _per_row(t.rest, src, got, got.data_ptr())  # (the caller's part: 2-D copies)
    assert torch.equal(got, want)


def test_unaligned_copies_are_left_to_the_caller_and_an_empty_list_makes_no_pieces():
    src, dst = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    odd = (dst.data_ptr(), src.data_ptr() + 2, 6, 2, 10)  # a bf16 block of 3 columns: 6-byte rows
    t = pt.table([odd, (dst.data_ptr() + 16, src.data_ptr(), 0, 3, 8)])
    assert len(t) == 0 and t.rest == (odd,)
    assert len(pt.table([])) == 0


@settings(max_examples=80, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 5000)), min_size=1, max_size=12),
       piece=st.sampled_from([16, 1024, 65536]), seed=st.integers(0, 2**16))
def test_a_dense_table_lands_every_copy_where_the_copy_would(spans, piece, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32)
    want, got = torch.zeros(1 << 17, dtype=torch.int32), torch.zeros(1 << 17, dtype=torch.int32)
    copies, at = [], 0
    for start, words in spans:  # (word ranges of src, landing back to back, a gap of 3 words between)
        words = min(words, src.numel() - start)
        copies.append((got.data_ptr() + 4 * at, src.data_ptr() + 4 * start, 4 * words))
        want[at:at + words] = src[start:start + words]
        at += words + 3
    table, src_base, dst_base = pt.dense(copies, piece)
    assert table.dtype == torch.int64 and table.shape[1] == 3
    assert int(table[:, 2].max()) <= piece // 4 and int(table[:, 2].sum()) == sum(c[2] for c in copies) // 4
    s, d = src[(src_base - src.data_ptr()) // 4:], got[(dst_base - got.data_ptr()) // 4:]
    for src_at, dst_at, words in table.tolist():
        d[dst_at:dst_at + words] = s[src_at:src_at + words]
    assert torch.equal(got, want)


def test_vectors_only_where_every_address_width_and_pitch_is_a_16_byte_multiple():
    base = 1 << 20
    ok = (base, base + 4096, 1024, 8, 2048)
    assert pt.vectors([ok])
    assert pt.vectors([])
    for i, odd in enumerate((8, 8, 8, None, 8)):  # each field in turn off by 8 bytes (the height does not count)
        if odd is None:
            continue
        bad = list(ok)
        bad[i] += odd
        assert not pt.vectors([ok, tuple(bad)])
    assert pt.vectors([ok, (base + 2, base, 6, 3, 10)])  # (not 4-byte aligned: not in the table)
