"""What the senders hold, and the unit the planner moves.

How this works: ``index_sources`` makes one lean pass over every sender tensor and gathers, per
parameter, who holds it whole (replicas, or FSDP ranks that can gather it) and who holds which shard,
checking that all senders agree on dtype and full shape and that shards tile without overlap
(``BadTiling`` / ``ManifestMismatch`` naming parameter and ranks). ``Interned`` keeps one object per
candidate tuple (pieces compare and hash them by identity) and one ``Spans`` per distinct gatherable
sharding, so parameters sharded alike find their stitched runs once. A ``Piece`` is one contiguous
write into a receiver with its candidate senders; ``needs.build_pieces`` makes them. ``Streams`` holds
pieces cut per receiver and candidate tuple as columns over one list of pieces, so the steps from the
cut to the tables make no Python object per stream.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections import namedtuple
from itertools import chain
from typing import Optional, Sequence

import numpy as np

from weightsync.wire import Slice

from ..errors import BadTiling, ManifestMismatch
from .links import Participant


_PIECE_FIELDS = ("receiver", "dst_name", "src_name", "slice", "nbytes", "region", "offset", "row_bytes", "transform",
                 "cands")


class Piece(namedtuple("Piece", _PIECE_FIELDS)):
    """One contiguous write into a receiver: rows of a source parameter, in full-tensor coordinates.
    ``row_bytes`` > 0: it may be split along dim 0 at multiples of this. A tuple, so that the hundreds of
    thousands a plan makes cost one C call each (``make_piece``) and their fields come out as columns
    by one transposition (``zip(*pieces)``)."""

    __slots__ = ()
    receiver: int
    dst_name: str
    src_name: str
    slice: Optional[Slice]
    nbytes: int
    region: int
    offset: int
    row_bytes: int
    transform: str
    cands: tuple[int, ...]

    def split(self, nbytes: int) -> tuple["Piece", "Piece"]:
        """Cut after ``nbytes`` (a positive multiple of row_bytes, less than the size): along dim 0, the
        slice's rows or, for a block, its dim-0 rows."""
        rows = nbytes // self.row_bytes
        s = self.slice
        if s.block:
            a = Slice(s.dim, s.start, s.stop, s.dim0_start, s.dim0_start + rows)
            b = Slice(s.dim, s.start, s.stop, s.dim0_start + rows, s.dim0_stop)
        else:
            a = Slice(0, s.start, s.start + rows)
            b = Slice(0, s.start + rows, s.stop)
        r, dst, src, _, size, region, offset, row_bytes, transform, cands = self
        return (make_piece(Piece, (r, dst, src, a, nbytes, region, offset, row_bytes, transform, cands)),
                make_piece(Piece, (r, dst, src, b, size - nbytes, region, offset + nbytes, row_bytes, transform, cands)))


make_piece = tuple.__new__  # make_piece(Piece, fields): a Piece without a Python call


def in_order(items: Sequence, order) -> list:
    """``items`` taken at the positions in ``order`` (an integer array), as a list: one C call for
    the 10^5-10^6 pieces or runs of a plan."""
    at = order.tolist()
    return list(operator.itemgetter(*at)(items)) if len(at) > 1 else [items[i] for i in at]


@dataclasses.dataclass
class Streams:
    """Pieces cut into byte streams, as columns: stream i is ``pool[first[i]:first[i] + count[i]]``
    (its pieces in order), of receiver ``receiver[i]``, from the candidates ``tuples[key[i]]``, of
    ``nbytes[i]`` bytes. No stream is empty, and no two share a receiver and a candidate tuple."""

    pool: list[Piece]
    first: np.ndarray  # int64, each column
    count: np.ndarray
    receiver: np.ndarray
    key: np.ndarray
    nbytes: np.ndarray
    tuples: list[tuple[int, ...]]
    # (designated sender, parameter) -> its bytes pulled once that parameter is gathered (``expand.gather_queues``)
    gathers: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    pulls: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)  # ... and that pull's bytes
    # every parameter some piece must gather -> (its full bytes, its holders); those not in ``pulls`` have
    # no designated gatherer: the schedule chooses them
    gather_params: dict[str, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.first)

    def lists(self) -> list[list[Piece]]:
        """Each stream's pieces as a list of its own."""
        return ranges(self.pool, self.first, self.count)

    @classmethod
    def of(cls, groups: dict[int, dict[tuple[int, ...], list[Piece]]]) -> "Streams":
        """``groups`` (receiver -> candidate tuple -> pieces), empty streams left out."""
        rows = [(r, cands, pieces) for r, streams in groups.items() for cands, pieces in streams.items() if pieces]
        keys: dict[tuple[int, ...], int] = {}
        return cls(*pooled([p for _, _, p in rows]), np.fromiter((r for r, _, _ in rows), np.int64, len(rows)),
                   np.fromiter((keys.setdefault(c, len(keys)) for _, c, _ in rows), np.int64, len(rows)),
                   np.fromiter((sum(map(_nbytes, p)) for _, _, p in rows), np.int64, len(rows)), list(keys))


_nbytes = operator.attrgetter("nbytes")


def pooled(lists: Sequence[list]) -> tuple[list, np.ndarray, np.ndarray]:
    """``lists`` as one list and each one's range in it: (pool, first, count)."""
    count = np.fromiter(map(len, lists), np.int64, len(lists))
    return list(chain.from_iterable(lists)), np.cumsum(count) - count, count


def looked_up(keys: np.ndarray, values: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``want``, whether it is among ``keys`` (sorted, distinct) and the value at it there
    (0 where it is not): one ``searchsorted``."""
    if not len(keys):
        return np.zeros(len(want), bool), np.zeros(len(want), values.dtype)
    i = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    found = keys[i] == want
    return found, np.where(found, values[i], 0)


def ranges(pool: list, first: np.ndarray, count: np.ndarray) -> list[list]:
    """``pool[first[i]:first[i] + count[i]]`` for each i, as lists (``pooled``'s inverse)."""
    return [pool[a:a + n] for a, n in zip(first.tolist(), count.tolist())]


class Source:
    """What the senders hold of one parameter."""

    __slots__ = ("name", "dtype", "full_shape", "first_holder", "full", "replicas", "shards", "gshards", "_full_cands", "_spans",
                 "_cuts")

    def __init__(self, name: str, dtype: str, full_shape: tuple[int, ...], first_holder: int = -1) -> None:
        self.name = name
        self.first_holder = first_holder  # the first sender that listed it (errors name it)
        self.dtype = dtype
        self.full_shape = full_shape
        self.full: list[int] = []  # senders that hold or can gather the full tensor
        self.replicas = 0  # how many of them hold it whole
        self.shards: dict[tuple[int, int, int], list[int]] = {}  # (dim, start, stop) -> senders
        self.gshards: dict[tuple[int, int, int], list[int]] = {}  # the same, for gatherable (FSDP) shards
        # (the ``Interned`` they were made for, its value): a catalog's resolver and a planning thread's
        # may read one source, each with its own ``Interned``; a pair is read and written at once
        self._full_cands: Optional[tuple["Interned", tuple[int, ...]]] = None
        self._spans: Optional[tuple["Interned", Spans]] = None
        self._cuts: Optional[dict[int, tuple[list[int], list[tuple[int, int, list[int]]]]]] = None

    def cuts(self) -> dict[int, tuple[list[int], list[tuple[int, int, list[int]]]]]:
        """The (non-gatherable) shards per dim as sorted (start, stop, holders), with their starts (for
        bisect): they tile without overlap (``_check_tiling``), so one span at most contains a need."""
        if self._cuts is None:
            cuts: dict[int, list[tuple[int, int, list[int]]]] = {}
            for (dim, a, b), holders in sorted(self.shards.items()):
                cuts.setdefault(dim, []).append((a, b, holders))
            self._cuts = {dim: ([a for a, _, _ in rows], rows) for dim, rows in cuts.items()}
        return self._cuts

    def spans(self, intern: "Interned") -> "Spans":
        """The gatherable dim-0 shards, shared with every parameter sharded the same way."""
        got = self._spans
        if got is None or got[0] is not intern:
            got = self._spans = (intern, intern.spans(self.gshards))
        return got[1]

    def clone(self) -> "Source":
        """A copy whose holders change apart from this one's (``Catalog``: a source a plan may be reading
        is copied before a join or a leave changes it)."""
        out = Source(self.name, self.dtype, self.full_shape, self.first_holder)
        out.full, out.replicas = list(self.full), self.replicas
        out.shards = {key: list(holders) for key, holders in self.shards.items()}
        out.gshards = {key: list(holders) for key, holders in self.gshards.items()}
        return out

    # --- one sender at a time (``catalog.Catalog``; ``index_sources`` fills the fields in one pass) ---

    def hold(self, rank: int, shard: Optional[tuple[int, int, int]], gatherable: bool) -> None:
        """Sender ``rank`` holds this parameter: whole (``shard`` None) or the shard (dim, start, stop)."""
        if shard is None or gatherable:
            self.full.append(rank)
            self.replicas += shard is None
            if shard is not None:
                self.gshards.setdefault(shard, []).append(rank)
        else:
            holders = self.shards.get(shard)
            if holders is None:
                holders = self.shards[shard] = []
                if self._cuts is not None:  # kept in order in place: a sender's join costs log(shards)
                    starts, rows = self._cuts.setdefault(shard[0], ([], []))
                    i = bisect.bisect_right(starts, shard[1])
                    starts.insert(i, shard[1])
                    rows.insert(i, (shard[1], shard[2], holders))
            holders.append(rank)
        self._full_cands = self._spans = None

    def release(self, rank: int, shard: Optional[tuple[int, int, int]], gatherable: bool) -> None:
        """Undo ``hold``: sender ``rank`` left."""
        if shard is None or gatherable:
            self.full.remove(rank)
            self.replicas -= shard is None
        where = self.gshards if gatherable else self.shards
        if shard is not None:
            where[shard].remove(rank)
            if not where[shard]:
                del where[shard]
                if not gatherable and self._cuts is not None:
                    starts, rows = self._cuts[shard[0]]
                    i = bisect.bisect_left(starts, shard[1])
                    while rows[i][:2] != shard[1:]:
                        i += 1
                    del starts[i], rows[i]
                    if not rows:
                        del self._cuts[shard[0]]
        self._full_cands = self._spans = None

    def held(self) -> bool:
        return bool(self.full or self.shards)

    def a_holder(self) -> int:
        """One sender that holds some of it (errors name it)."""
        return self.full[0] if self.full else next(iter(self.shards.values()))[0]

    def overlap(self, rank: int, shard: tuple[int, int, int]) -> Optional[BadTiling]:
        """The error a new non-gatherable ``shard`` of sender ``rank`` would make: cut along another dim
        than the others, or overlapping one (naming its holders); None if it tiles (or is a replica)."""
        dim, a, b = shard
        if shard in self.shards:
            return None
        cuts = self.cuts()
        if not cuts:
            return None
        if dim not in cuts:
            other = next(iter(cuts))
            return BadTiling(f"shard along dim {dim} where the others are cut along dim {other}", param=self.name,
                             ranks=[f"sender/{rank}", f"sender/{cuts[other][1][0][2][0]}"])
        starts, rows = cuts[dim]
        i = bisect.bisect_right(starts, a)
        for a0, b0, holders in rows[max(0, i - 1): i + 1]:
            if a0 < b and a < b0:
                return BadTiling(f"shards [{a0}:{b0}] and [{a}:{b}] overlap", param=self.name,
                                 ranks=[f"sender/{rank}", *(f"sender/{r}" for r in holders)])
        return None

    def likeness(self, intern: "Interned") -> tuple:
        """All that a piece template reads of this source besides its name (``cuts.pieces_for`` and the
        cuts it calls): dtype and full shape, the full holders, the gatherable shards (their ``Spans``,
        shared by every source sharded alike) and the other shards with their holders. Sources alike
        give the same templates under their own names (``needs.Resolver``)."""
        return (self.dtype, self.full_shape, self.full_cands(intern) if self.full else (),
                id(self.spans(intern)) if self.gshards else None,
                tuple(sorted((key, tuple(holders)) for key, holders in self.shards.items())))

    def full_cands(self, intern: "Interned") -> tuple[int, ...]:
        """The full holders as one shared (interned) tuple: pieces compare and hash it cheaply."""
        got = self._full_cands
        if got is None or got[0] is not intern:
            key = tuple(sorted(set(self.full)))
            got = self._full_cands = (intern, intern.setdefault(key, key))
        return got[1]


class Spans:
    """Gatherable dim-0 shards as sorted (start, stop, holders), with their starts (for bisect), and the
    stitched runs found in them (``_runs``). Parameters sharded alike (an FSDP group's parameters of
    one dim-0 size) share one: their runs are found once."""

    __slots__ = ("starts", "rows", "runs")

    def __init__(self, rows: list[tuple[int, int, tuple[int, ...]]]) -> None:
        self.rows = rows
        self.starts = [a for a, _, _ in rows]
        self.runs: dict[tuple[int, int, int], Optional[list[tuple[int, int, tuple[int, ...]]]]] = {}


class Interned(dict):
    """Candidate tuples, one object per value (pieces compare and hash them by identity), and the
    ``Spans`` of each distinct gatherable sharding."""

    def __init__(self) -> None:
        super().__init__()
        self._spans: dict[tuple, list[tuple[dict, Spans]]] = {}  # (count, first shard) -> [(gshards, spans)]

    def spans(self, gshards: dict[tuple[int, int, int], list[int]]) -> Spans:
        bucket = self._spans.setdefault((len(gshards), next(iter(gshards), None)), [])
        for seen, spans in bucket:
            if seen == gshards:
                return spans
        rows = []
        for (dim, a, b), h in sorted(gshards.items()):
            if dim == 0:
                key = (h[0],) if len(h) == 1 else tuple(sorted(h))
                rows.append((a, b, self.setdefault(key, key)))
        spans = Spans(rows)
        bucket.append((gshards, spans))
        return spans


def index_sources(senders: Sequence[Participant]) -> dict[str, Source]:
    sources: dict[str, Source] = {}
    get = sources.get
    # one object per shard key: parameters sharded alike hold the same key objects, so comparing their
    # shardings (``Interned.spans``) reads a few thousand keys, hot in cache, not a million scattered
    # ones
    keys: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    key_of = keys.setdefault
    for p in senders:  # (the planner's one pass over every sender tensor: kept lean)
        rank = p.rank
        for t in p.manifest.tensors:
            shard = t.shard
            full_shape = t.shape if shard is None else shard.full_shape
            src = get(t.name)
            if src is None:
                src = sources[t.name] = Source(t.name, t.dtype, tuple(full_shape), rank)
            elif src.dtype != t.dtype or src.full_shape != full_shape and src.full_shape != tuple(full_shape):
                raise ManifestMismatch(
                    f"senders disagree: {src.dtype}{list(src.full_shape)} vs {t.dtype}{list(full_shape)}",
                    param=t.name, ranks=[f"sender/{src.first_holder}", f"sender/{rank}"],
                )
            if shard is None:
                src.full.append(rank)
                src.replicas += 1
                continue
            if t.gatherable:
                src.full.append(rank)
                where = src.gshards
            else:
                where = src.shards
            key = (shard.dim, shard.start, shard.stop)
            key = key_of(key, key)
            holders = where.get(key)
            if holders is None:
                where[key] = [rank]
            else:
                holders.append(rank)
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
