"""How one part of a receiver tensor becomes pieces, from what the senders hold of its source (pure).

How this works: a part a single sender holds (a replica, a gatherable full tensor, or inside one
non-gatherable shard) is one piece with its candidates; rows of dim 0 that only several shards cover are
stitched from them (``_cover_with_shards``). Shard-to-shard: a plain dim-0 piece of a parameter that
FSDP ranks hold as gatherable shards is cut at their shard boundaries and each part sent by the ranks
whose own shard holds it; a plain slice along a later dim (a row-parallel TP slice) is cut the same way
into blocks, each rank's dim-0 rows of it (``Slice.dim0_start:dim0_stop``), which land back to back in
the receiver. No gather either way; in an FSDP group of more than ``STITCH_SMALL_GROUP`` shards each
dim-0 part must have ``STITCH_MIN_BYTES`` at least, and there are no blocks, else one gathering rank
sends the need whole.
Block-FP8 parts (weights and their scales) are cut the same way in a small group where every cut falls
on a 128-row block of the part's grid (of a 3-D stack of matrices, fused experts, every cut between
matrices does): each rank quantizes its own whole blocks (``_quantized_runs``).
A TP rank's share of every expert of a fused gate-and-up stack (the ``share`` transform,
``mapping._inside_matrices``) is cut between experts the same way, from FSDP or expert-parallel
shards: each rank takes the shares of its own experts (``_matrix_runs``).
``pieces_for`` is the entry (``needs._templates`` calls it per part); what it reads of a source is what
``Source.likeness`` lists. Every failure is a ``PlanError`` naming the parameter and ranks.
"""

from __future__ import annotations

import bisect
from math import prod
from typing import Optional

from weightsync.wire import Slice, TensorSpec, dtype_size

from ..errors import Unsuppliable
from .mapping import Part
from .sources import Interned, Piece, Source, Spans

STITCH_MIN_BYTES = 1 << 20  # a shard-to-shard part smaller than this is not worth its own write ...
STITCH_SMALL_GROUP = 8  # ... unless the FSDP group has this many shards at most: then a need takes a few
#                          writes, which cost less than a gather (a collective every rank of the group
#                          joins, a latency the byte model leaves out, and the tensor on an inbound port)


def pieces_for(src: Source, t: TensorSpec, rank: int, part: Part, intern: "Interned") -> list[Piece]:
    need = part.slice
    region = t.region if t.region is not None else 0
    offset = t.offset + part.offset
    if part.transform.startswith("share:") and (src.gshards or src.shards):
        shares = _matrix_runs(src, t, rank, part, region, offset, intern)
        if shares is not None:
            return shares
    if src.gshards and part.row_bytes and need is not None and need.dim == 0:
        stitched = _stitch(src, t, rank, need, region, offset, part.row_bytes, intern)
        if stitched is not None:
            return stitched
    if src.gshards and not part.transform and need is not None and need.dim > 0 and src.full_shape:
        blocks = _blocks(src, t, rank, need, region, offset, part.nbytes, intern)
        if blocks is not None:
            return blocks
    if (src.gshards or src.shards) and need is not None and part.transform.partition(":")[0] in ("fp8w", "fp8s"):
        quantized = _quantized_runs(src, t, rank, part, region, offset, intern)
        if quantized is not None:
            return quantized
    if not src.shards and src.full:
        cands = src.full_cands(intern)
    else:
        found = set(src.full)
        if need is not None and need.dim in src.cuts():
            starts, rows = src.cuts()[need.dim]
            i = bisect.bisect_right(starts, need.start) - 1
            if i >= 0 and need.stop <= rows[i][1]:  # the one span that starts at or before the need
                found.update(rows[i][2])
        key = tuple(sorted(found))
        cands = intern.setdefault(key, key)
    if cands:
        return [Piece(rank, t.name, src.name, need, part.nbytes, region, offset, part.row_bytes, part.transform,
                      cands)]
    return _cover_with_shards(src, t, rank, need, region, offset, part.row_bytes, part.transform, intern)


def _stitch(src: Source, t: TensorSpec, rank: int, need: Slice, region: int, offset: int, row_bytes: int,
            intern: "Interned") -> Optional[list[Piece]]:
    """Rows ``need`` of a plain dim-0 part, each run sent by the FSDP ranks whose own shard holds it;
    None where the shards are not cut along dim 0, leave a gap, or would make a part too small. The runs
    depend only on the rows, so receivers that need the same rows share them (``Spans.runs``)."""
    runs = _runs(src, need.start, need.stop, row_bytes, intern)
    if runs is None:
        return None
    return [Piece(rank, t.name, src.name, Slice(0, at, stop), (stop - at) * row_bytes, region,
                  offset + (at - need.start) * row_bytes, row_bytes, "", holders) for at, stop, holders in runs]


def _blocks(src: Source, t: TensorSpec, rank: int, need: Slice, region: int, offset: int, nbytes: int,
            intern: "Interned") -> Optional[list[Piece]]:
    """A plain slice along a later dim (a row-parallel TP slice: all dim-0 rows, some columns), sent as
    blocks: each FSDP rank sends its own dim-0 rows of it (a pitched source) to where they land, back to
    back in the receiver's slice; no gather. Only in a group of ``STITCH_SMALL_GROUP`` shards at most;
    None there too where ``_stitch_runs`` says no."""
    rows = src.full_shape[0]
    if rows == 0 or nbytes % rows or len(src.spans(intern).rows) > STITCH_SMALL_GROUP:
        return None  # (a large group would cut every slice into a block per rank: Kimi-K2 256 -> 128 tp8 had
        #              4 M transfers, 30x, and planned in a minute; there the rank that gathers sends it)
    row_bytes = nbytes // rows  # one dim-0 row of the slice, as it lies in the receiver
    runs = _runs(src, 0, rows, row_bytes, intern)
    if runs is None:
        return None
    return [Piece(rank, t.name, src.name, Slice(need.dim, need.start, need.stop, at, stop), (stop - at) * row_bytes,
                  region, offset + at * row_bytes, row_bytes, "", holders) for at, stop, holders in runs]


def _matrix_runs(src: Source, t: TensorSpec, rank: int, part: Part, region: int, offset: int,
                 intern: "Interned") -> Optional[list[Piece]]:
    """A transform of every matrix of a stack on its own (``share``: a TP rank's share of every expert)
    from trainers that hold runs of whole matrices, FSDP or expert-parallel shards: each rank transforms
    and sends its own experts, landing at their place; None where one rank holds them all, the shards do
    not cover them, or an FSDP group has more than ``STITCH_SMALL_GROUP`` shards (every receiver needs
    a share of every expert: a write per rank per stack and receiver, where a gathering rank sends one)."""
    experts = src.full_shape[0]
    if part.slice is not None or len(src.full_shape) != 3 or experts == 0 or part.nbytes % experts:
        return None
    if src.gshards and len(src.spans(intern).rows) > STITCH_SMALL_GROUP:
        return None
    if src.gshards:
        runs = _runs(src, 0, experts, prod(src.full_shape[1:]) * dtype_size(src.dtype), intern)
    else:
        runs = _held_runs(src, 0, experts, intern)
    if runs is None:
        return None
    each = part.nbytes // experts  # (one matrix's share, as it lands)
    return [Piece(rank, t.name, src.name, Slice(0, at, stop), (stop - at) * each, region, offset + at * each, 0,
                  part.transform, holders) for at, stop, holders in runs]


def _quantized_runs(src: Source, t: TensorSpec, rank: int, part: Part, region: int, offset: int,
                    intern: "Interned") -> Optional[list[Piece]]:
    """An FP8 weight or scale part (``fp8w:B`` / ``fp8s:B``) of FSDP dim-0 shards, cut where the shards
    are, when every cut falls on a B-row block boundary of the part's grid (anchored at its first row):
    each rank quantizes its own rows, which are whole blocks of that grid, so its weight rows and block
    scales are those of the whole part, and no rank gathers. Weight rows land at row offsets, scale rows
    at block-row offsets. Only in a group of ``STITCH_SMALL_GROUP`` shards at most, but for a stack of
    matrices (fused experts: each rank quantizes its own experts, a run of a matrix at least, sized as
    ``_stitch_runs`` sizes plain runs), which expert-parallel ranks holding whole experts (not
    gatherable) cut the same way; None otherwise."""
    need, block = part.slice, int(part.transform.partition(":")[2])
    origin, rows = (need.start, need.stop - need.start) if need.dim == 0 else (0, src.full_shape[0])
    stack = len(src.full_shape) == 3  # matrices (fused experts), each on its own grid: every cut is on one
    if rows == 0:
        return None
    if not src.gshards:  # experts held whole by their expert-parallel ranks: each quantizes its own
        runs = _held_runs(src, origin, origin + rows, intern) if stack else None
    elif stack or len(src.spans(intern).rows) <= STITCH_SMALL_GROUP:
        # (row size: only a large group's size rule reads it; a stack's weight and scales alike go by a matrix)
        runs = _runs(src, origin, origin + rows, prod(src.full_shape[1:]) if stack else 1, intern)
    else:
        return None
    if runs is None or not stack and any((at - origin) % block for at, _, _ in runs):
        return None
    scales = part.transform.startswith("fp8s") and not stack  # (a stack's scales go matrix by matrix too)
    unit = -(-rows // block) if scales else rows  # the part's rows: block rows of scales, weight rows, or matrices
    if part.nbytes % unit:
        return None
    row_bytes = part.nbytes // unit
    out = []
    for at, stop, holders in runs:
        first, count = (at - origin, stop - at) if not scales else ((at - origin) // block, -(-(stop - at) // block))
        piece_slice = Slice(0, at, stop) if need.dim == 0 else Slice(need.dim, need.start, need.stop, at, stop)
        out.append(Piece(rank, t.name, src.name, piece_slice, count * row_bytes, region, offset + first * row_bytes,
                         0, part.transform, holders))
    return out


def _held_runs(src: Source, start: int, stop: int, intern: "Interned") -> Optional[list[tuple[int, int, tuple]]]:
    """Dim-0 rows ``start:stop`` as runs of the (non-gatherable) shards that cover them, with their holders;
    None where they leave a gap or one shard holds them all (then its holders are the part's candidates)."""
    cuts = src.cuts().get(0)
    if cuts is None:
        return None
    runs, at, _ = _covering(*cuts, start, stop)
    if at != stop or len(runs) < 2:
        return None
    out = []
    for a, b, holders in runs:
        key = tuple(sorted(holders))
        out.append((a, b, intern.setdefault(key, key)))
    return out


def _runs(src: Source, start: int, stop: int, row_bytes: int, intern: "Interned") -> Optional[list[tuple[int, int, tuple]]]:
    """``_stitch_runs`` of dim-0 rows ``start:stop``, once per sharding: they depend only on the rows, so
    receivers that need the same rows, and parameters sharded alike, share them (``Spans.runs``)."""
    spans = src.spans(intern)
    key = (start, stop, row_bytes)
    runs = spans.runs.get(key, False)
    if runs is False:
        runs = spans.runs[key] = _stitch_runs(spans, Slice(0, start, stop), row_bytes)
    return runs


def _stitch_runs(layout: Spans, need: Slice, row_bytes: int) -> Optional[list[tuple[int, int, tuple]]]:
    spans = layout.rows
    out, at, _ = _covering(layout.starts, spans, need.start, need.stop)
    if at != need.stop or not out:
        return None
    if len(spans) > STITCH_SMALL_GROUP and len(out) > 1 and any((b - a) * row_bytes < STITCH_MIN_BYTES
                                                                 for a, b, _ in out):
        return None  # small parts of a large group: one gathering rank sends the need whole
    return out


def _cover_with_shards(src, t, rank, need, region, offset, row_bytes, transform, intern) -> list[Piece]:
    """No single sender covers the need: stitch it from dim-0 shards, or fail."""
    def holders() -> list[str]:
        return [f"receiver/{rank}", *(f"sender/{r}" for r in sorted({r for rs in src.shards.values() for r in rs}))]

    if need is None or need.dim != 0 or not src.shards or next(iter(src.shards))[0] != 0 or not row_bytes:
        raise Unsuppliable("no sender holds or can gather the needed part", param=t.name, ranks=holders())
    runs, at, gap_end = _covering(*src.cuts()[0], need.start, need.stop)
    if at < need.stop:
        raise Unsuppliable(f"rows {at}:{gap_end} of dim 0 are held by no sender", param=t.name, ranks=holders())
    out: list[Piece] = []
    for at, stop, senders in runs:
        cands = tuple(sorted(senders))
        out.append(Piece(rank, t.name, src.name, Slice(0, at, stop), (stop - at) * row_bytes, region,
                         offset + (at - need.start) * row_bytes, row_bytes, transform, intern.setdefault(cands, cands)))
    return out


def _covering(starts: list[int], spans: list[tuple[int, int, object]], start: int, stop: int):
    """Rows ``start:stop`` as runs of the sorted, non-overlapping ``spans`` (start, stop, holders) that
    cover them back to back from ``start``: (runs, where the cover ends, where the gap after it ends)."""
    out, at = [], start
    for a, b, holders in spans[max(0, bisect.bisect_right(starts, at) - 1):]:
        if b <= at:
            continue
        if a > at or a >= stop:
            return out, at, min(a, stop)
        end = min(b, stop)
        out.append((at, end, holders))
        at = end
    return out, at, stop
