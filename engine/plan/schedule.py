"""The list schedule and the levelling after it: which sender sends each chunk of a receiver's streams.

How this works: ``schedule`` runs one list schedule per link class (``_ClassSchedule``) over virtual
time. Forced streams (pieces only one sender has) leave nothing to choose and are placed in bulk
first (``_place_forced``, on columns: every forced stream's start and its ports' busy time by numpy,
the same additions in the same order as chunk by chunk): each receiver takes its forced senders back
to back, rotated so that receivers of the same senders start on different ones; a port is free for
flexible work once its forced work is done. Then, whenever a receiver's port is free it takes, of its largest stream with a
free candidate, the candidate with the least work (its forced work and what it was given so far) and
the next chunk of that stream (about 1/8 of its bytes, cut at dim-0 row boundaries, ``_Stream.take``).
Receivers with the most work left choose first; a receiver that found no free candidate is retried
only once one of its candidates frees. A stream's candidates and the free senders are also kept as
integer bits, so the scan for a receiver's first stream with a free candidate is one AND per stream.
The result is a ``Schedule`` (``work.py``): the flexible work as ``Segment``s (sender, receiver, pieces, start), the
forced work as ``Runs`` (columns), and each port's busy time, summed as the work is placed.
``levelling.balance`` then levels sender ports where one would be the bottleneck, reading those sums.
``tables.build_tables`` turns it into tables.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections import defaultdict
from itertools import accumulate, compress, count
from typing import TYPE_CHECKING, Optional

import numpy as np

from .links import LinkClass, LinkModel
from .sources import Piece, Streams
from .work import Runs, Schedule, Segment

_nbytes = operator.attrgetter("nbytes")
_mask = operator.attrgetter("mask")

if TYPE_CHECKING:
    from .planner import PlanOptions


class _Stream:
    """A receiver's queue of pieces that the senders in ``cands`` may supply. ``ends`` holds each
    piece's end offset in the stream, so a take finds its whole pieces by bisection (made at the first
    take that cuts: most streams are taken whole, at once)."""

    __slots__ = ("cands", "pieces", "ends", "at", "done", "nbytes", "seq", "mask", "key")

    def __init__(self, cands: frozenset[int], pieces: list[Piece], seq: int = 0, nbytes: int = -1) -> None:
        self.cands = cands
        self.mask = 0  # its candidates as bits (``_ClassSchedule.bit``)
        self.key: tuple[int, ...] = ()  # its candidates as the schedule's groups name them
        self.seq = seq  # breaks ties between streams of equal bytes left
        self.pieces = pieces
        self.ends: Optional[list[int]] = None
        self.at = 0  # the next piece
        self.done = 0  # bytes taken so far: where pieces[at] starts
        self.nbytes = nbytes if nbytes >= 0 else sum(map(_nbytes, pieces))  # bytes left

    @property
    def empty(self) -> bool:
        return self.at == len(self.pieces)

    def take(self, quantum: int, min_bytes: int) -> tuple[list[Piece], int]:
        """Pop about ``quantum`` bytes, cutting a splittable tensor at a row boundary; the pieces and
        their bytes."""
        at, pieces = self.at, self.pieces
        if self.nbytes <= quantum:  # the rest fits: all of it (most streams are taken whole, at once)
            out = pieces[at:] if at else pieces
            taken = self.nbytes
            self.at, self.done, self.nbytes = len(pieces), self.done + taken, 0
            return out, taken
        ends = self.ends
        if ends is None:
            ends = self.ends = list(accumulate(map(_nbytes, pieces)))
        j = bisect.bisect_right(ends, self.done + quantum, at, len(pieces))  # pieces at..j-1 fit whole
        out = pieces[at:j]
        taken = ends[j - 1] - self.done if j > at else 0
        if j < len(pieces):
            p = pieces[j]
            if not out and not p.row_bytes:  # an unsplittable head larger than the quantum goes whole
                out.append(p)
                taken += p.nbytes
                j += 1
            else:
                cut = int((quantum - taken) // p.row_bytes) * p.row_bytes if p.row_bytes else 0
                if p.row_bytes and 0 < cut < p.nbytes and (cut >= min_bytes or not out):
                    head, pieces[j] = p.split(cut)
                    out.append(head)
                    taken += cut
                elif not out:
                    out.append(p)
                    taken += p.nbytes
                    j += 1
        self.at = j
        self.done += taken
        self.nbytes -= taken
        return out, taken


def schedule(groups, link: LinkModel, options: "PlanOptions") -> Schedule:
    """Work-conserving list scheduling, one link class at a time (ports of classes are independent).
    ``groups``: class -> streams, as ``Streams`` or receiver -> candidate senders -> pieces
    (``planner.group_by_locality``)."""
    out = Schedule([], defaultdict(float), defaultdict(float))
    for cls in sorted(groups):
        one = _ClassSchedule(cls, groups[cls], link, options)
        segments, forced = one.run()
        out.segments.extend(segments)
        out.forced.append(forced)
        out.sending.update(((s, cls), t) for s, t in one.load.items() if t)
        out.receiving.update(((r, cls), t) for r, t in one.received.items() if t)
    return out


class _ClassSchedule:
    """The list schedule of one link class, after forced work is placed (``_place_forced``). At each
    event (a transfer ends, or a port's forced work does, freeing its sender and receiver ports), the
    free receivers with flexible work left, most work first, each take, of their largest stream with a
    free candidate, the candidate with the least work (its forced work and what it was given so far).
    A receiver that found none is retried only once one of its candidates is freed: until then it
    would find none again. A freed sender wakes the receivers that have a stream left naming it: for
    each candidate tuple naming the sender (``tuples_of``), the receivers with a stream of that tuple
    left (``holders``; receivers of one layout share their tuples, so there are few), so a receiver
    woken by a sender finds work from it."""

    def __init__(self, cls: LinkClass, groups: "Streams | dict[int, dict[tuple[int, ...], list[Piece]]]",
                 link: LinkModel, options: "PlanOptions") -> None:
        self.cls, self.link, self.options = cls, link, options
        self.flex: dict[int, list[_Stream]] = defaultdict(list)  # receiver -> streams, largest first
        self.holders: dict[tuple[int, ...], set[int]] = defaultdict(set)  # candidates -> receivers with a stream left
        self.tuples_of: dict[int, list[tuple[int, ...]]] = defaultdict(list)  # sender -> candidate tuples naming it
        streams = groups if isinstance(groups, Streams) else Streams.of(groups)
        self.pool = streams.pool
        # the forced streams (one candidate; (receiver, its one sender) unique), as columns
        tuples = streams.tuples
        one = np.fromiter((c[0] if c and len(c) == 1 else -1 for c in tuples), np.int64, len(tuples))[streams.key]
        forced = np.flatnonzero(one >= 0)
        self.forced_r, self.forced_s = streams.receiver[forced], one[forced]
        self.forced_first, self.forced_count = streams.first[forced], streams.count[forced]
        self.forced_bytes = streams.nbytes[forced]
        got, at = np.unique(streams.receiver, return_inverse=True)
        need = dict(zip(got.tolist(), _by(at.reshape(-1), streams.nbytes, len(got)).tolist()))  # receiver -> bytes
        frozen = self._flexible(streams, np.flatnonzero(one < 0))
        for cands in frozen:
            for s in cands:
                self.tuples_of[s].append(cands)
        self.receivers = sorted(need)
        self.senders = sorted(set(np.unique(self.forced_s).tolist()).union(self.tuples_of))
        self.bit = {s: 1 << i for i, s in enumerate(self.senders)}  # a set of senders as one int: its bits
        masks = {cands: _bits(cands, self.bit) for cands in frozen}
        for mine in self.flex.values():
            for st in mine:
                st.mask = masks[st.key]
        self.bw_r = {r: link.port_bw(cls, "receiver", r) for r in self.receivers}
        self.bw_s = {s: link.port_bw(cls, "sender", s) for s in self.senders}
        self.left = {r: sum(s.nbytes for s in self.flex.get(r, ())) / self.bw_r[r] for r in self.receivers}
        self.quantum = {r: max(options.min_chunk_bytes, -(-need[r] // options.chunks_per_receiver))
                        for r in self.receivers}
        self.load = dict.fromkeys(self.senders, 0.0)  # each sender port's busy time so far
        self.received = dict.fromkeys(self.receivers, 0.0)  # each receiver port's (the same sums)
        self.ranked: dict[int, tuple[float, int]] = {}  # sender -> (load, sender), as ``run`` goes

    def _flexible(self, streams: Streams, flexible: np.ndarray) -> dict[tuple[int, ...], frozenset[int]]:
        """A ``_Stream`` for each of ``streams`` at ``flexible``, numbered in (receiver, candidate tuple)
        order (``_Stream.seq``), in its receiver's ``flex`` (largest first, a tie by number: put in that
        order by one sort) and its tuple's ``holders``; each candidate tuple's frozenset, in the order
        first met."""
        tuples, key = streams.tuples, streams.key
        ranked = np.empty(len(tuples), np.int64)
        ranked[np.asarray(sorted(range(len(tuples)), key=lambda k: tuples[k] or ()), np.int64)] = np.arange(len(tuples))
        flexible = flexible[np.lexsort((ranked[key[flexible]], streams.receiver[flexible]))]
        numbered = np.arange(len(flexible))
        placed = np.lexsort((numbered, -streams.nbytes[flexible], streams.receiver[flexible]))
        flexible, numbered = flexible[placed], numbered[placed]
        frozen: dict[tuple[int, ...], frozenset[int]] = {}  # (receivers of one layout share candidate tuples)
        pool = self.pool
        for seq, receiver, k, a, n, nbytes in zip(numbered.tolist(), *(col[flexible].tolist() for col in (
                streams.receiver, key, streams.first, streams.count, streams.nbytes))):
            cands = tuples[k]
            fs = frozen.get(cands)
            if fs is None:
                fs = frozen[cands] = frozenset(cands)
            stream = _Stream(fs, pool[a:a + n], seq, nbytes)
            stream.key = cands
            self.holders[cands].add(receiver)
            self.flex[receiver].append(stream)
        return frozen

    def run(self) -> tuple[list[Segment], Runs]:
        """The flexible segments, and the forced runs (``_place_forced``)."""
        out: list[Segment] = []
        forced, free_at = self._place_forced()
        self.ranked = {s: (t, s) for s, t in self.load.items()}  # (load, sender): the least loaded, ties by rank
        events = [(t, s, r) for (s, r), t in free_at.items()]  # ports busy with forced work free then
        heapq.heapify(events)
        free_s = {s for s in self.senders if (s, -1) not in free_at}
        free_r = {r for r in self.flex if (-1, r) not in free_at}  # free receivers with flexible work left
        to_try = set(free_r)  # of those, the ones that may find a sender now
        bit, holders, tuples_of = self.bit, self.holders, self.tuples_of
        free_bits = _bits(free_s, bit)  # free_s as bits (a stream's free candidates: one integer AND)
        now = 0.0
        while True:
            left = self.left
            for _, r in sorted([(-left[r], r) for r in to_try]):  # the most work left first
                if not free_s:
                    break  # (no receiver can find a sender now)
                seg = self._match(r, free_s, free_bits)
                if seg is None:
                    continue  # (woken by senders another receiver took first)
                s = seg.sender
                seg.start = now
                out.append(seg)
                free_s.discard(s)
                free_bits ^= bit[s]
                free_r.discard(r)
                self.left[r] -= seg.nbytes / self.bw_r[r]
                heapq.heappush(events, (now + self._busy(seg), s, r))
            if not events:
                return out, forced
            now, s, r = heapq.heappop(events)
            freed_s, freed_r = [s], [r]
            while events and events[0][0] <= now:
                _, s2, r2 = heapq.heappop(events)
                freed_s.append(s2)
                freed_r.append(r2)
            freed_s = [s for s in freed_s if s >= 0]  # (-1: an event that frees a receiver port only)
            free_s.update(freed_s)
            for s in freed_s:
                free_bits |= bit[s]
            free_r.update(r for r in freed_r if self.flex.get(r))
            to_try = {r for r in freed_r if r in free_r}
            # a receiver still waiting found every candidate busy when it last tried (or found no sender
            # free at all): the senders freed now are the only free ones it may take, so it is tried
            # again only if one of them is its candidate (and then against every free sender: the
            # others are none of its candidates)
            waiting = free_r.difference(to_try)
            for s in freed_s:
                for key in tuples_of.get(s, ()):
                    woken = holders[key].intersection(waiting)
                    if woken:
                        to_try |= woken
                        waiting -= woken

    def _place_forced(self) -> tuple[Runs, dict[tuple[int, int], float]]:
        """Forced streams (one candidate: nothing to choose) in bulk, ahead of flexible work: each
        receiver takes its forced senders back to back, in rank order rotated by the receiver's
        position (receivers of the same senders start on different ones, and each sender's table, in
        start order, goes round its receivers), each stream in chunks cut as ``_Stream.take``
        cuts them. A port with forced work is free for flexible work once all of it is done. Returns
        the runs in the order placed, and when each port with forced work frees, keyed (sender, -1)
        or (-1, receiver). Done on columns: the start times and port sums are the same additions in
        the same order as adding chunk by chunk (``numpy.cumsum`` and ``add.at`` add in order)."""
        if not len(self.forced_r):
            return Runs.empty(), {}
        receivers, senders = np.asarray(self.receivers, np.int64), np.asarray(self.senders, np.int64)
        pos = np.searchsorted(receivers, self.forced_r)  # each stream's receiver's position
        order = np.lexsort((self.forced_s, pos))  # by receiver, then sender
        pos = pos[order]
        first = np.flatnonzero(np.diff(pos, prepend=-1))  # each receiver's first stream
        k = np.diff(first, append=len(pos))  # its number of senders
        j = np.arange(len(pos)) - np.repeat(first, k)  # a sender's place among them, in rank order
        k_of = np.repeat(k, k)
        # rotated by the receiver's position (``pos`` stays as it is: streams move only among a receiver's)
        order = order[np.lexsort(((j - pos % k_of) % k_of, pos))]
        quantum = np.asarray([self.quantum[r] for r in self.receivers], np.int64)
        nbytes, count, first = self.forced_bytes[order], self.forced_count[order], self.forced_first[order]
        stream, pool = order, self.pool
        big = np.flatnonzero(nbytes > quantum[pos])
        if len(big):  # (rare: a stream of more than the receiver's chunk, cut as ``_Stream.take`` cuts)
            stream, nbytes, count, first, pool = self._chunked(big, stream, nbytes, count, first, quantum[pos])
            pos = np.searchsorted(receivers, self.forced_r[stream])
        send = np.searchsorted(senders, self.forced_s[stream])
        bw_s = np.asarray([self.bw_s[s] for s in self.senders])
        bw_r = np.asarray([self.bw_r[r] for r in self.receivers])
        data = nbytes / np.minimum(bw_s[send], bw_r[pos])  # (as ``_busy``)
        took = np.maximum(data, count * self.link.per_transfer_s)
        start, free_at = np.empty(len(took)), {}
        bounds = [*np.flatnonzero(np.diff(pos, prepend=-1)).tolist(), len(pos)]
        for a, b in zip(bounds, bounds[1:]):  # each receiver's chunks back to back from 0
            ends = np.cumsum(took[a:b])
            start[a], start[a + 1:b] = 0.0, ends[:-1]
            free_at[(-1, self.receivers[int(pos[a])])] = float(ends[-1])
        load, received = np.zeros(len(senders)), np.zeros(len(receivers))
        np.add.at(load, send, data)
        np.add.at(received, pos, data)
        self.load.update(zip(self.senders, load.tolist()))
        self.received.update(zip(self.receivers, received.tolist()))
        free_at.update(((s, -1), t) for s, t in self.load.items() if t)
        return Runs(start, self.forced_r[stream], self.forced_s[stream], nbytes, first, count, pool), free_at

    def _chunked(self, big: np.ndarray, stream, nbytes, count, first, quantum):
        """The forced streams in placement order with those at ``big`` cut into chunks (``_Stream.take``):
        each chunk's stream, bytes, piece count and first piece, and the pool with the chunks' pieces
        after the streams'."""
        min_bytes, reps, cut, pool = self.options.min_chunk_bytes, np.ones(len(stream), np.int64), {}, self.pool
        for i in big.tolist():
            a = int(first[i])
            st = _Stream(frozenset(), pool[a:a + int(count[i])])
            chunks = cut[i] = []
            while not st.empty:
                chunks.append(st.take(int(quantum[i]), min_bytes))
            reps[i] = len(chunks)
        at = np.cumsum(reps) - reps
        stream, nbytes, count, first = (np.repeat(col, reps) for col in (stream, nbytes, count, first))
        extra: list[Piece] = []
        for i, chunks in cut.items():
            a = int(at[i])
            nbytes[a:a + len(chunks)] = [n for _, n in chunks]
            count[a:a + len(chunks)] = [len(p) for p, _ in chunks]
            for j, (pieces, _) in enumerate(chunks, a):
                first[j] = len(pool) + len(extra)
                extra.extend(pieces)
        return stream, nbytes, count, first, pool + extra

    def _busy(self, seg: Segment) -> float:
        """How long ``seg`` holds its ports in the schedule's time (its sender's load grows by its data)."""
        data = seg.nbytes / min(self.bw_s[seg.sender], self.bw_r[seg.receiver])  # (``LinkModel.bandwidth``)
        load = self.load[seg.sender] = self.load[seg.sender] + data
        self.ranked[seg.sender] = (load, seg.sender)
        self.received[seg.receiver] += data
        return max(data, len(seg.pieces) * self.link.per_transfer_s)

    def _match(self, r: int, free_s: set[int], free_bits: int) -> Optional[Segment]:
        """Of receiver r's largest stream with a candidate in ``free_s`` (``free_bits``, as bits), the
        next chunk, from the candidate with the least work (forced, and given so far). A stream taken
        to its end no longer holds the receiver among its tuple's ``holders``."""
        flex_r = self.flex[r]
        # the first stream with a free candidate: the scan is the hot loop, so it is one integer AND
        # per stream, by C-level iterators
        i = next(compress(count(), map(free_bits.__and__, map(_mask, flex_r))), None)
        if i is not None:
            st = flex_r[i]
            s = min(st.cands & free_s, key=self.ranked.__getitem__)
            pieces, nbytes = st.take(self.quantum[r], self.options.min_chunk_bytes)
            del flex_r[i]
            if not st.empty:  # back in its place among the others, by the bytes it has left
                bisect.insort(flex_r, st, key=_largest_first)
            else:
                self.holders[st.key].discard(r)
            return Segment(r, self.cls, pieces, s, nbytes, st.cands)
        return None


def _bits(senders, bit: dict[int, int]) -> int:
    """A set of senders as one integer: the OR of their bits."""
    out = 0
    for s in senders:
        out |= bit[s]
    return out


def _largest_first(st: _Stream) -> tuple[int, int]:
    return -st.nbytes, st.seq


def _by(at: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``values`` summed by ``at`` (integers, exact)."""
    out = np.zeros(n, np.int64)
    np.add.at(out, at, values)
    return out

