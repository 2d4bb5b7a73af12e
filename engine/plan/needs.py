"""From manifests to pieces: every (parameter slice, receiver) that must move, and who can supply it.

How this works: ``index_sources`` checks that all senders agree on each parameter (dtype, full shape)
and that non-gatherable shards tile cleanly. ``build_pieces`` walks each receiver's manifest (skipping
names the receiver ties to another: one storage moves once), checks it against the sources, and turns
each need into one ``Piece`` — or several, when only a combination of dim-0 shards covers it. A piece
lists its candidate senders. Every failure is a ``PlanError`` naming the parameter and ranks.
"""

from __future__ import annotations

import difflib
from math import prod
from typing import Mapping, Optional, Sequence

from wire import Slice, TensorSpec, dtype_size

from ..errors import BadTiling, ManifestMismatch, Unsuppliable, UnknownParameter
from .links import Participant


class Piece:
    """One contiguous write into a receiver: rows of a source parameter, in full-tensor coordinates."""

    __slots__ = (
        "receiver", "dst_name", "src_name", "slice", "nbytes", "region", "offset",
        "row_bytes", "transform", "cands",
    )

    def __init__(self, receiver, dst_name, src_name, slice_, nbytes, region, offset, row_bytes, transform, cands):
        self.receiver: int = receiver
        self.dst_name: str = dst_name
        self.src_name: str = src_name
        self.slice: Optional[Slice] = slice_
        self.nbytes: int = nbytes
        self.region: int = region
        self.offset: int = offset
        self.row_bytes: int = row_bytes  # >0: may be split along dim 0 at multiples of this
        self.transform: str = transform
        self.cands: tuple[int, ...] = cands

    def split(self, nbytes: int) -> tuple["Piece", "Piece"]:
        """Cut after ``nbytes`` (a positive multiple of row_bytes, less than the size)."""
        rows = nbytes // self.row_bytes
        s = self.slice
        a = Slice(0, s.start, s.start + rows)
        b = Slice(0, s.start + rows, s.stop)
        head = Piece(self.receiver, self.dst_name, self.src_name, a, nbytes, self.region, self.offset,
                     self.row_bytes, self.transform, self.cands)
        tail = Piece(self.receiver, self.dst_name, self.src_name, b, self.nbytes - nbytes, self.region,
                     self.offset + nbytes, self.row_bytes, self.transform, self.cands)
        return head, tail


class Source:
    """What the senders hold of one parameter."""

    __slots__ = ("name", "dtype", "full_shape", "full", "shards", "_full_cands")

    def __init__(self, name: str, dtype: str, full_shape: tuple[int, ...]) -> None:
        self.name = name
        self.dtype = dtype
        self.full_shape = full_shape
        self.full: list[int] = []  # senders that hold or can gather the full tensor
        self.shards: dict[tuple[int, int, int], list[int]] = {}  # (dim, start, stop) -> senders
        self._full_cands: tuple[int, ...] | None = None

    def full_cands(self, intern: dict) -> tuple[int, ...]:
        """The full holders as one shared (interned) tuple: pieces compare and hash it cheaply."""
        if self._full_cands is None:
            key = tuple(sorted(set(self.full)))
            self._full_cands = intern.setdefault(key, key)
        return self._full_cands


def index_sources(senders: Sequence[Participant]) -> dict[str, Source]:
    sources: dict[str, Source] = {}
    first_holder: dict[str, int] = {}
    for p in senders:
        for t in p.manifest.tensors:
            src = sources.get(t.name)
            if src is None:
                src = sources[t.name] = Source(t.name, t.dtype, tuple(t.full_shape))
                first_holder[t.name] = p.rank
            elif src.dtype != t.dtype or src.full_shape != tuple(t.full_shape):
                raise ManifestMismatch(
                    f"senders disagree: {src.dtype}{list(src.full_shape)} vs {t.dtype}{list(t.full_shape)}",
                    param=t.name, ranks=[f"sender/{first_holder[t.name]}", f"sender/{p.rank}"],
                )
            if t.shard is None or t.gatherable:
                src.full.append(p.rank)
            else:
                src.shards.setdefault((t.shard.dim, t.shard.start, t.shard.stop), []).append(p.rank)
    for src in sources.values():
        _check_tiling(src)
    return sources


def _check_tiling(src: Source) -> None:
    if not src.shards:
        return
    dims = {d for d, _, _ in src.shards}
    ranks = [f"sender/{r}" for rs in src.shards.values() for r in rs]
    if len(dims) > 1:
        raise BadTiling(f"shards are cut along several dims {sorted(dims)}", param=src.name, ranks=ranks)
    spans = sorted((a, b) for _, a, b in src.shards)
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise BadTiling(f"shards [{a0}:{b0}] and [{a1}:{b1}] overlap", param=src.name, ranks=ranks)


def _closest(name: str, names: Sequence[str]) -> list[str]:
    return difflib.get_close_matches(name, names, n=3, cutoff=0.5)


def build_pieces(
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    transforms: Mapping[tuple[str, str], str] = {},
) -> tuple[list[Piece], dict[str, Source]]:
    sources = index_sources(senders)
    intern: dict[tuple[int, ...], tuple[int, ...]] = {}
    pieces: list[Piece] = []
    for rp in receivers:
        for t in rp.manifest.tensors:
            if t.tied_to is not None:
                continue  # the receiver shares this storage with t.tied_to: it moves once, under that name
            src = sources.get(t.name)
            if src is None:
                raise UnknownParameter(t.name, f"receiver/{rp.rank}", _closest(t.name, list(sources)))
            transform = _transform_for(src, t, rp.rank, transforms)
            pieces.extend(_pieces_for(src, t, rp.rank, transform, intern))
    return pieces, sources


def _transform_for(src: Source, t: TensorSpec, rank: int, transforms: Mapping[tuple[str, str], str]) -> str:
    if (t.shard.full_shape if t.shard is not None else t.shape) != src.full_shape:
        raise ManifestMismatch(
            f"receiver wants full shape {list(t.full_shape)}, senders have {list(src.full_shape)}",
            param=t.name, ranks=[f"receiver/{rank}"],
        )
    if t.dtype == src.dtype:
        return ""
    transform = transforms.get((src.dtype, t.dtype))
    if transform is None:
        raise ManifestMismatch(
            f"receiver wants {t.dtype}, senders have {src.dtype} and no transform converts them",
            param=t.name, ranks=[f"receiver/{rank}"],
        )
    return transform


def _pieces_for(src: Source, t: TensorSpec, rank: int, transform: str, intern: dict) -> list[Piece]:
    full = src.full_shape
    shard = t.shard
    need = shard.slice if shard is not None else None
    region = t.region if t.region is not None else 0
    splittable = len(full) >= 1 and (need is None or need.dim == 0) and not transform
    row_bytes = prod(full[1:]) * dtype_size(t.dtype) if splittable else 0
    if need is None and splittable:
        need = Slice(0, 0, full[0])
    if not src.shards and src.full:
        cands = src.full_cands(intern)
    else:
        found = set(src.full)
        for (dim, a, b), holders in src.shards.items():
            if need is not None and dim == need.dim and a <= need.start and need.stop <= b:
                found.update(holders)
        key = tuple(sorted(found))
        cands = intern.setdefault(key, key)
    if cands:
        return [Piece(rank, t.name, src.name, need, t.nbytes, region, t.offset, row_bytes, transform, cands)]
    return _cover_with_shards(src, t, rank, need, region, row_bytes, transform)


def _cover_with_shards(src, t, rank, need, region, row_bytes, transform) -> list[Piece]:
    """No single sender covers the need: stitch it from dim-0 shards, or fail."""
    holders = [f"sender/{r}" for rs in src.shards.values() for r in rs]
    if need is None or need.dim != 0 or not src.shards or next(iter(src.shards))[0] != 0 or not row_bytes:
        raise Unsuppliable("no sender holds or can gather the needed part", param=t.name,
                           ranks=[f"receiver/{rank}", *holders])
    out: list[Piece] = []
    at = need.start
    for (_, a, b), senders in sorted(src.shards.items()):
        if b <= at or a >= need.stop:
            continue
        if a > at:
            raise Unsuppliable(f"rows {at}:{a} of dim 0 are held by no sender", param=t.name,
                               ranks=[f"receiver/{rank}", *holders])
        stop = min(b, need.stop)
        nbytes = (stop - at) * row_bytes
        out.append(Piece(rank, t.name, src.name, Slice(0, at, stop), nbytes, region,
                         t.offset + (at - need.start) * row_bytes, row_bytes, transform, tuple(sorted(senders))))
        at = stop
    if at < need.stop:
        raise Unsuppliable(f"rows {at}:{need.stop} of dim 0 are held by no sender", param=t.name,
                           ranks=[f"receiver/{rank}", *holders])
    return out
