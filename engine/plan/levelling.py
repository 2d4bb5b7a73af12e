"""Levelling after the list schedule: where a sender port would be the bottleneck, move flexible work off it.

How this works: the list schedule (``schedule.py``) gives a flexible chunk only to a candidate free at
that moment, so senders sharing work can end apart. ``balance`` starts from each port's busy time as the
schedule summed it (``Schedule.sending`` / ``.receiving``) and looks only at the flexible segments, the
only ones it may move: the busiest sender port hands part of one (``_best_move``: the largest it can,
to its least busy candidate as fast for that receiver) to level the two, cut at a row boundary
(``_tail_bytes``, ``_cut_tail``), until no move lowers it. The sum of squared port times falls at every
move, so it ends. Then ``spread``: a receiver's lanes run side by side and its largest ends last, so
where one sender has several flexible segments for a receiver, all but the largest move to the
candidate with the least work for that receiver, where that makes no lane larger and no port busier
than the sender was.
"""

from __future__ import annotations

import heapq
import operator
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from .links import LinkClass, LinkModel
from .work import Schedule, Segment
from .sources import Piece, looked_up

if TYPE_CHECKING:
    from .planner import PlanOptions


def balance(sched: Schedule, link: LinkModel, options: "PlanOptions") -> None:
    """Even out sender ports where one would be the bottleneck (busier than every receiver port): the
    busiest sender port hands part of a flexible segment to its least busy candidate, enough to bring
    the two level (water-filling, cut at a row boundary, never a part under ``min_chunk_bytes`` unless
    the whole segment moves), until no such move lowers it. The list schedule gives a flexible segment
    only to a candidate free at that moment, so a pair of senders sharing work can end apart (docs/PLANNER.md
    has the figures); this levels them. A move goes only to a port as
    fast for that receiver and leaves the pair no further apart than it found them, so the sum of
    squared port times falls at every move: it ends. A moved part keeps its place in the schedule's
    time (after what stays), which orders it in its new sender's table. ``sched``'s segments and
    sending times are updated in place."""
    segments, load = sched.segments, sched.sending
    movable: dict[tuple[int, LinkClass], list[Segment]] = defaultdict(list)
    for seg in segments:
        if len(seg.cands) > 1:
            movable[seg.sender, seg.cls].append(seg)
    top_r = max(sched.receiving.values(), default=0.0)  # the busiest receiver port: no makespan is shorter
    heap = [(-v, key) for key, v in load.items() if v > top_r]
    heapq.heapify(heap)
    while heap:
        top, key = heapq.heappop(heap)
        if -top != load[key]:
            continue  # an outdated entry
        move = _best_move(movable[key], key, load, link, options.min_chunk_bytes)
        if move is None:
            continue
        seg, to, nbytes, bw_from, bw_to = move
        part = _cut_tail(seg, nbytes) if nbytes < seg.nbytes else seg
        load[key] -= nbytes / bw_from
        load[to, seg.cls] += nbytes / bw_to
        if part is seg:
            movable[key].remove(seg)
        else:
            part.start = seg.start + seg.nbytes / bw_from  # after what stays
            segments.append(part)
        part.sender = to
        movable[to, seg.cls].append(part)
        for k in (key, (to, seg.cls)):
            if load[k] > top_r:
                heapq.heappush(heap, (-load[k], k))


def _best_move(segs: list[Segment], key, load, link: LinkModel, min_bytes: int):
    """(segment, candidate, bytes, the two bandwidths): the largest of ``segs`` (sent by ``key``'s port)
    that a candidate as fast and less busy can take part of; the least busy such candidate, and the
    bytes that level the two (all of the segment at most; a part of ``min_bytes`` at least, cut at a
    row boundary)."""
    s, top = key[0], load[key]
    for seg in sorted(segs, key=lambda g: (-g.nbytes, g.start, g.receiver)):
        bw_from = link.bandwidth(seg.cls, s, seg.receiver)
        least = min(seg.nbytes, min_bytes)  # the smallest part that may move must already help
        best = None  # (candidate, its bandwidth)
        for t in sorted(seg.cands):
            if t == s or (best is not None and load[t, seg.cls] >= load[best[0], seg.cls]):
                continue
            bw_to = link.bandwidth(seg.cls, t, seg.receiver)
            if bw_to >= bw_from and load[t, seg.cls] + least / bw_to < top - least / bw_from:
                best = (t, bw_to)
        if best is None:
            continue
        t, bw_to = best
        x = (top - load[t, seg.cls]) / (1 / bw_from + 1 / bw_to)  # load[t] + x / bw_to = top - x / bw_from
        nbytes = _tail_bytes(seg, min(int(x), seg.nbytes))
        if nbytes and (nbytes == seg.nbytes or nbytes >= min_bytes):  # (nothing to move: not a move)
            return seg, t, nbytes, bw_from, bw_to
    return None


def _tail_bytes(seg: Segment, want: int) -> int:
    """The bytes of the largest tail of ``seg`` of at most ``want`` bytes that ends on piece or row
    boundaries."""
    got = 0
    for p in reversed(seg.pieces):
        if got + p.nbytes <= want:
            got += p.nbytes
            continue
        if p.row_bytes and p.slice is not None:
            got += (want - got) // p.row_bytes * p.row_bytes
        break
    return got


def _cut_tail(seg: Segment, nbytes: int) -> Segment:
    """Take the last ``nbytes`` (from ``_tail_bytes``) off ``seg``, as a new segment of the same stream."""
    tail: list[Piece] = []
    left = nbytes
    seg.pieces = list(seg.pieces)  # (may be its stream's own list)
    while left:
        p = seg.pieces[-1]
        if p.nbytes <= left:
            tail.append(seg.pieces.pop())
            left -= p.nbytes
        else:
            head, rest = p.split(p.nbytes - left)
            seg.pieces[-1] = head
            tail.append(rest)
            left = 0
    seg.nbytes -= nbytes
    return Segment(seg.receiver, seg.cls, tail[::-1], seg.sender, nbytes, seg.cands)


def spread(sched: Schedule, link: LinkModel) -> int:
    """Spread each receiver's flexible work over more senders. The engine runs a sender's lanes side
    by side and a port shares its bandwidth among them, so a receiver's lanes progress alike and its
    largest lane ends last: where one sender has several flexible segments for a receiver (the list
    schedule took whichever candidate was free), all but the largest may move, each whole, to the
    candidate with the least work for that receiver, if its lane then stays smaller than the
    sender's was, and it is as fast for that receiver and ends no busier than the sender was. A
    moved segment keeps its start. Returns the segments moved; ``sched`` is updated in place."""
    segs, load = sched.segments, sched.sending
    if not segs:
        return 0
    receiver = np.fromiter(map(_receiver, segs), np.int64, len(segs))
    sender = np.fromiter(map(_sender, segs), np.int64, len(segs))
    lane_of = receiver * (int(sender.max()) + 1) + sender
    _, first, count = np.unique(lane_of, return_index=True, return_counts=True)
    if (count < 2).all():
        return 0
    lanes: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for i in np.flatnonzero(np.isin(lane_of, lane_of[first[count > 1]])).tolist():
        lanes[segs[i].receiver, segs[i].sender].append(segs[i])
    size = _lane_bytes(sched, lanes, receiver, sender, segs)
    moved = 0
    for (r, s), mine in sorted(lanes.items()):
        for g in sorted((g for g in mine if len(g.cands) > 1), key=_nbytes)[: len(mine) - 1]:
            bw_from, before = link.bandwidth(g.cls, s, r), size[r, s]
            fits = [t for t in g.cands if size[r, t] + g.nbytes < before
                    and link.bandwidth(g.cls, t, r) >= bw_from
                    and load[t, g.cls] + g.nbytes / link.bandwidth(g.cls, t, r) <= load[s, g.cls]]
            if not fits:
                continue
            t = min(fits, key=lambda t: (size[r, t], load[t, g.cls], t))
            bw_to = link.bandwidth(g.cls, t, r)
            load[s, g.cls] -= g.nbytes / bw_from
            load[t, g.cls] += g.nbytes / bw_to
            size[r, s] -= g.nbytes
            size[r, t] += g.nbytes
            g.sender = t
            moved += 1
    return moved


def _lane_bytes(sched: Schedule, lanes: dict[tuple[int, int], list[Segment]], receiver: np.ndarray,
                sender: np.ndarray, segs: list[Segment]) -> dict[tuple[int, int], int]:
    """The bytes each candidate of the segments in ``lanes`` has for their receiver, forced or flexible
    (``segs``, whose ``receiver`` and ``sender`` columns are given), keyed (receiver, sender): every
    lane's bytes summed by one sort, then looked up for those pairs alone."""
    nbytes = np.fromiter(map(_nbytes, segs), np.int64, len(segs))
    rs = np.concatenate([receiver, *(runs.receiver for runs in sched.forced)])
    ss = np.concatenate([sender, *(runs.sender for runs in sched.forced)])
    ns = np.concatenate([nbytes, *(runs.nbytes for runs in sched.forced)])
    width = int(max(ss.max(), max(t for mine in lanes.values() for g in mine for t in g.cands))) + 1
    keys, at = np.unique(rs * width + ss, return_inverse=True)
    sums = np.bincount(at.reshape(-1), ns, len(keys))
    pairs = sorted({(r, t) for (r, _), mine in lanes.items() for g in mine for t in g.cands})
    _, got = looked_up(keys, sums.astype(np.int64), np.fromiter((r * width + t for r, t in pairs), np.int64, len(pairs)))
    return dict(zip(pairs, got.tolist()))


_receiver, _sender, _nbytes = (operator.attrgetter(f) for f in ("receiver", "sender", "nbytes"))
