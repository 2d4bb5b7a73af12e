"""Resolved receiver tensors to pieces, column by column.

How this works: ``Resolver.tensors`` gives, per receiver layout, one row per tensor that moves (name,
its sources' number, its templates' number, region, offset), and each receiver's layout; the
templates are shared (every layer's tensor of one kind uses the same list). ``Expanded`` lays each
layout's rows out as columns once and repeats them receiver by receiver, lays the template
lists and source tuples out as flat arrays and expands every tensor into its pieces' rows with
``numpy.repeat``, so each piece's source name, candidates, bytes and offset are array indexing, not a
Python loop over 10^5-10^6 pieces. On those rows ``designate`` decides which gather-only parameters
go to fewer holders (and ``gather_queues`` when each designated holder has each of them, for the
tables' order); ``pieces`` makes the ``Piece`` tuples from the columns (in the tensors' order,
each tensor's in its templates' order) with the designated candidates in place of the full holders,
and ``streams`` also cuts them per receiver and candidate tuple by one stable sort, the grouping the
schedule starts from (``planner.group_by_locality``), as columns (``sources.Streams``: each stream's
receiver, candidates and bytes read off the rows, no list per stream).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import repeat
from math import prod
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

from weightsync.wire import dtype_size

from .sources import Interned, Piece, Source, Streams, make_piece

if TYPE_CHECKING:
    from .needs import Resolved

__all__ = ["Expanded"]


class Expanded:
    """The pieces of resolved tensors (``needs.Resolved``), as columns; see the module docstring."""

    def __init__(self, resolved: "Resolved", srcs_lists: Sequence[tuple[str, ...]],
                 made_lists: Sequence[list[tuple]]) -> None:
        self.rows = 0
        self.gather_params: dict[str, tuple[int, tuple]] = {}  # (``designate``: every gather-only source)
        # every tensor's row: its layout's rows, receiver after receiver (columns made once per layout)
        per = [_layout_columns(rows) for rows in resolved.rows]
        which = resolved.layout
        sizes = np.fromiter((len(rows) for rows in resolved.rows), np.int64, len(per))[np.asarray(which, np.int64)]
        if not int(sizes.sum()):
            return
        names, srcs_of, made_of, regions, bases = (np.concatenate([per[k][j] for k in which]) for j in range(5))
        ranks = np.repeat(_objects(resolved.ranks), sizes)
        # the templates, flat: list u's rows are start[u]:start[u] + length[u]
        length = np.fromiter(map(len, made_lists), np.int64, len(made_lists))
        start = np.cumsum(length) - length
        slot, slices, nbytes, at, row_bytes, transforms, cands = zip(*(t for made in made_lists for t in made))
        # the sources' names, flat: source tuple v's slot j is name number src_name[src_start[v] + j]
        src_start = np.fromiter(map(len, srcs_lists), np.int64, len(srcs_lists))
        src_start = np.cumsum(src_start) - src_start
        name_ids: dict[str, int] = {}
        src_name = np.fromiter((name_ids.setdefault(s, len(name_ids)) for srcs in srcs_lists for s in srcs),
                               np.int64)
        self.names = list(name_ids)
        # every piece's row: the tensor it is of, and its template
        per = length[made_of]
        self.rows = rows = int(per.sum())
        tensor = np.repeat(np.arange(len(made_of)), per)
        trow = np.repeat(start[made_of] - (np.cumsum(per) - per), per) + np.arange(rows)
        self.tensor, self.trow = tensor, trow
        self.receiver = np.repeat(np.asarray(resolved.ranks, np.int64), sizes)[tensor]
        self.src = src_name[src_start[srcs_of][tensor] + np.asarray(slot, np.int64)[trow]]
        self.nbytes = np.asarray(nbytes, np.int64)[trow]
        self.cands, cands_key = cands, _keys(cands)
        self.cands_row = cands_key[trow]
        self.key_of = dict(zip(map(id, cands), cands_key.tolist()))  # id(candidate tuple) -> its number
        self.tuples = dict(zip(cands_key.tolist(), cands))  # its number -> candidate tuple
        # the rest, as the Python values the pieces take: per tensor (object columns), and per template
        self._tensor_cols = (ranks, names, regions, bases)
        self._template_cols = (slices, nbytes, at, row_bytes, transforms)

    def designate(self, sources: Mapping[str, Source], n_senders: int,
                  intern: Interned) -> dict[str, tuple[tuple, tuple]]:
        """Which gather-only sources' pieces to narrow to fewer candidates, where the gathers would not
        fit: name -> (its full holders, those designated), for ``pieces``. Every sender of such a
        parameter gathers it, and each gather costs the holders' outbound ports the full tensor. If the
        senders' spare room (their capacity, each sending as long as the busiest receiver receives,
        less all bytes sent) holds a gather for every receiver of every such parameter, every holder
        stays a candidate: the schedule keeps its choice. Otherwise each parameter, the most bytes
        first, gets k holders, chosen least-loaded first (k = its bytes to send over a fair share of
        all bytes, at least 1; a sender's load is what it alone can send, and its share of the
        parameters designated before). Then a holder whose shorter gathers leave it idle until its
        longest is done also gets a shorter one (``_early_work``)."""
        self.gather_params = {}
        if not self.rows:
            return {}
        names, cands = self.names, self.cands
        full = {}
        for i, name in enumerate(names):
            s = sources.get(name)
            if s is not None and s.gshards and not s.replicas:
                full[i] = s.full_cands(intern)
        if not full:
            return {}
        full_key = np.full(len(names), -1, np.int64)
        for i, holders in full.items():
            full_key[i] = self.key_of.get(id(holders), -2)
        receiver, src, nbytes = self.receiver, self.src, self.nbytes
        gather = full_key[src] == self.cands_row
        at = _positions(receiver)
        got = np.zeros(int(at.max()) + 1, np.int64)
        np.add.at(got, at, nbytes)
        total_all, busiest = int(got.sum()), int(got.max())
        g_name, g_at, g_bytes = src[gather], at[gather], nbytes[gather]
        if not len(g_name):
            return {}
        order, first = np.unique(g_name, return_index=True)
        order = order[np.argsort(first, kind="stable")]  # the names as they first occur
        totals = np.zeros(len(names), np.int64)
        np.add.at(totals, g_name, g_bytes)
        groups = _distinct(g_name, g_at, len(names), len(got))  # receivers per name
        room = n_senders * busiest - total_all
        size = {i: _full_bytes(sources[names[i]]) for i in order.tolist()}  # (a gather pulls about this)
        self.gather_params = {names[i]: (size[i], full[i]) for i in order.tolist()}
        for i in order.tolist():
            room -= min(len(full[i]), int(groups[i])) * size[i]
        if room >= 0:
            return {}
        forced = _forced_load(self, cands, gather)
        load = defaultdict(int, forced)
        fair = max(1, total_all // max(1, n_senders))
        narrowed: dict[str, tuple[tuple, tuple]] = {}
        for i in sorted(order.tolist(), key=lambda i: -int(totals[i])):
            total, holders = int(totals[i]), full[i]
            k = min(len(holders), max(1, -(-total // fair)))
            if k == len(holders):
                continue
            chosen = tuple(sorted(sorted(holders, key=load.__getitem__)[:k]))  # (holders ascend: ties by rank)
            narrowed[names[i]] = (holders, intern.setdefault(chosen, chosen))
            for s in chosen:
                load[s] += total // k
        _early_work(narrowed, {names[i]: size[i] for i in order.tolist()},
                    {names[i]: int(totals[i]) for i in order.tolist()}, forced, busiest // 100, intern)
        return narrowed

    def pieces(self, narrowed: Mapping[str, tuple[tuple, tuple]] = {}) -> list[Piece]:
        """The pieces, a piece of a source in ``narrowed`` whose candidates are its full holders with the
        designated ones instead."""
        return self._made(narrowed)[0]

    def streams(self, narrowed: Mapping[str, tuple[tuple, tuple]], sources: Mapping[str, Source],
                intern: Interned) -> tuple[list[Piece], Optional[Streams]]:
        """The pieces (as ``pieces``, but in the streams' order) and the same pieces as streams: each
        receiver's (receivers in the tensors' order) split by candidate tuple, the tuples in the order
        they first occur in its pieces, each stream's pieces in their order (``planner.group_by_locality``),
        with when each designated sender has each parameter it gathers (``gather_queues``, from
        ``sources`` and ``intern``); None if no pieces. The rows are put in the streams' order before
        the pieces are made: no piece is made and then moved."""
        cands_col, cands_row, tuples = self._candidates(narrowed)
        if not self.rows:
            return [], None
        stream = _positions(self.receiver) * (int(cands_row.max()) + 1) + cands_row
        _, first, at = np.unique(stream, return_index=True, return_inverse=True)
        first = first[at.reshape(-1)]  # each row's stream, as the stream's first row
        order = np.argsort(first, kind="stable")  # (a tie in row order: a receiver's rows are contiguous)
        starts = np.flatnonzero(np.diff(first[order], prepend=-1))
        head = order[starts]
        pieces = self._pieces(cands_col, order)
        streams = Streams(pieces, starts, np.diff(starts, append=self.rows), self.receiver[head], cands_row[head],
                          np.add.reduceat(self.nbytes[order], starts), [tuples.get(k) for k in range(max(tuples) + 1)])
        streams.gathers, streams.pulls = gather_queues(narrowed, sources, intern)
        streams.gather_params = self.gather_params
        return pieces, streams

    def _made(self, narrowed: Mapping[str, tuple[tuple, tuple]]) -> tuple[list[Piece], np.ndarray, dict]:
        """The pieces, a number per piece for its (final) candidate tuple, and the tuple of each number."""
        cands_col, cands_row, tuples = self._candidates(narrowed)
        return (self._pieces(cands_col) if self.rows else []), cands_row, tuples

    def _candidates(self, narrowed: Mapping[str, tuple[tuple, tuple]]) -> tuple[np.ndarray, np.ndarray, dict]:
        """Each row's final candidate tuple (objects), its number, and the tuple of each number: a
        gather-only row of a parameter in ``narrowed`` takes the designated holders."""
        if not self.rows:
            return np.zeros(0, object), np.zeros(0, np.int64), {}
        cands_col, cands_row, tuples = _objects(self.cands)[self.trow], self.cands_row, self.tuples
        if narrowed:
            tuples = dict(tuples)
            keys = dict(self.key_of)
            full_key = np.full(len(self.names), -1, np.int64)
            chosen = np.empty(len(self.names), object)
            chosen_key = np.zeros(len(self.names), np.int64)
            for i, name in enumerate(self.names):
                pair = narrowed.get(name)
                if pair is not None:
                    full_key[i], chosen[i] = keys.get(id(pair[0]), -2), pair[1]
                    chosen_key[i] = keys.setdefault(id(pair[1]), len(keys))
                    tuples[int(chosen_key[i])] = pair[1]
            swap = full_key[self.src] == cands_row
            cands_col[swap] = chosen[self.src[swap]]
            cands_row = cands_row.copy()
            cands_row[swap] = chosen_key[self.src[swap]]
        return cands_col, cands_row, tuples

    def _pieces(self, cands_col: np.ndarray, order: Optional[np.ndarray] = None) -> list[Piece]:
        """The ``Piece`` tuples of the rows (at ``order``, if given), with the candidates ``cands_col``."""
        (ranks, names, regions, bases), (slices, nbytes, at, row_bytes, transforms) = \
            self._tensor_cols, self._template_cols
        tensor, trow, src = self.tensor, self.trow, self.src
        if order is not None:
            tensor, trow, src, cands_col = tensor[order], trow[order], src[order], cands_col[order]
        offsets = bases[tensor] + np.asarray(at, np.int64)[trow]
        columns = (  # (object columns: each piece takes the template's own values, no new int per piece)
            ranks[tensor].tolist(), names[tensor].tolist(), _objects(self.names)[src].tolist(),
            _objects(slices)[trow].tolist(), _objects(nbytes)[trow].tolist(), regions[tensor].tolist(),
            offsets.tolist(), _objects(row_bytes)[trow].tolist(), _objects(transforms)[trow].tolist(),
            cands_col.tolist(),
        )
        return list(map(make_piece, repeat(Piece, self.rows), zip(*columns)))


def _early_work(narrowed: dict[str, tuple[tuple, tuple]], pull: Mapping[str, int], totals: Mapping[str, int],
                forced: Mapping[int, int], least: int, intern: Interned) -> None:
    """A designated sender gathers its parameters shortest first and sends a parameter's pieces once
    it has it: where what it sends with no gather (``forced``) and its share of its shorter gathers
    come to fewer bytes than its longest gather pulls, its port idles until that one is done. Each
    such sender also gathers one more parameter that it holds, whose gather is shorter than its
    longest and whose bytes to send would fill that wait: round robin over such parameters, the most
    bytes first. So once the shorter gathers are done every gatherer has work, not only those the
    bytes chose for them. Only gathers of ``least`` bytes at least count (a hundredth of the busiest
    receiver's bytes): a shorter wait costs the round less than that, and more holders for small
    parameters would only make more streams for the schedule. ``narrowed`` is updated in place."""
    mine: dict[int, list[str]] = defaultdict(list)
    for n, (_, chosen) in narrowed.items():
        for s in chosen:
            mine[s].append(n)
    early = sorted((n for n in narrowed if pull[n] >= least), key=lambda n: (-totals[n], pull[n], n))
    extra: dict[str, list[int]] = defaultdict(list)
    at = 0
    for s in sorted(mine):
        longest = max(pull[n] for n in mine[s])
        if longest < least:
            continue
        lacks = longest - forced.get(s, 0) - sum(totals[n] // len(narrowed[n][1]) for n in mine[s] if pull[n] < longest)
        if lacks <= 0:
            continue
        for j in range(len(early)):
            n = early[(at + j) % len(early)]
            holders, chosen = narrowed[n]
            if pull[n] < longest <= totals[n] and s not in chosen and s in holders:
                extra[n].append(s)
                at = (at + j + 1) % len(early)
                break
    for n, more in extra.items():
        holders, chosen = narrowed[n]
        both = tuple(sorted((*chosen, *more)))
        narrowed[n] = (holders, intern.setdefault(both, both))


def gather_queues(narrowed: Mapping[str, tuple[tuple, tuple]], sources: Mapping[str, Source],
                  intern: Interned) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int]]:
    """When each designated sender has each of its designated parameters, as the bytes it has pulled
    by then, keyed (sender, name): it gathers them shortest first (its table takes them in that
    order: ``tables.build_tables``), each the full tensor less its own dim-0 shard (read off the
    sharding's ``Spans``, shared by every parameter sharded alike); and each of those pulls' bytes."""
    pulls: dict[int, list[tuple[int, str]]] = defaultdict(list)  # sender -> (pull, name)
    rows_of: dict[int, dict[int, int]] = {}  # id(spans) -> sender -> the dim-0 rows it holds
    for name, (_, chosen) in narrowed.items():
        src = sources[name]
        full, spans = _full_bytes(src), src.spans(intern)
        own = rows_of.get(id(spans))
        if own is None:
            own = rows_of[id(spans)] = {s: b - a for a, b, holders in spans.rows for s in holders}
        rows = max(1, src.full_shape[0]) if src.full_shape else 1
        for s in chosen:
            pulls[s].append((full - full * own.get(s, 0) // rows, name))
    done: dict[tuple[int, str], int] = {}
    each: dict[tuple[int, str], int] = {}
    for s, queue in pulls.items():
        at = 0
        for n, name in sorted(queue):
            at += n
            done[s, name], each[s, name] = at, n
    return done, each


def _full_bytes(src: Source) -> int:
    return prod(src.full_shape) * dtype_size(src.dtype)


def _forced_load(ex: Expanded, cands: tuple, gather: np.ndarray) -> dict[int, int]:
    """Bytes each sender must send as the one candidate of a piece (not a gather-only one)."""
    single = np.fromiter((c[0] if len(c) == 1 else -1 for c in cands), np.int64, len(cands))
    who = single[ex.trow]
    pick = (who >= 0) & ~gather
    senders, at = np.unique(who[pick], return_inverse=True)
    sums = np.zeros(len(senders), np.int64)
    np.add.at(sums, at, ex.nbytes[pick])
    return dict(zip(senders.tolist(), sums.tolist()))


def _positions(values: np.ndarray) -> np.ndarray:
    """Each value's position among the distinct values, ascending (``numpy.unique``'s inverse): by
    counting changes where the values never decrease, as a plan's receiver column (receivers in rank
    order, each one's rows together), else by sorting."""
    if len(values) and (values[1:] >= values[:-1]).all():
        return np.cumsum(np.diff(values, prepend=values[0]) != 0)
    return np.unique(values, return_inverse=True)[1].reshape(-1)


def _distinct(a: np.ndarray, b: np.ndarray, na: int, nb: int) -> np.ndarray:
    """For each a in range(na), how many distinct b in range(nb) it occurs with (rows (a, b)): by
    marking a table of the pairs where it is small (64 MiB at most; no sort), else by the distinct
    pairs."""
    if na * nb <= 1 << 26:
        seen = np.zeros((na, nb), bool)
        seen[a, b] = True
        return seen.sum(axis=1)
    return np.bincount(np.unique(a * nb + b) // nb, minlength=na)


def _keys(objects: Sequence) -> np.ndarray:
    """A number per object, the same for the same object (candidate tuples are interned)."""
    ids = np.fromiter(map(id, objects), np.int64, len(objects))
    return np.unique(ids, return_inverse=True)[1].reshape(-1)


def _layout_columns(rows: list[tuple]) -> tuple[np.ndarray, ...]:
    """One layout's rows (``needs.Resolved``) as columns: names and regions as objects, the sources'
    and templates' numbers and the offsets as integers."""
    names, srcs_of, made_of, regions, bases = zip(*rows) if rows else ((),) * 5
    return (_objects(names), np.asarray(srcs_of, np.int64), np.asarray(made_of, np.int64), _objects(regions),
            np.asarray(bases, np.int64))


def _objects(values: Sequence) -> np.ndarray:
    """``values`` as a 1-D object array (tuples stay elements)."""
    return np.fromiter(values, object, len(values))
