"""The routing planner: pure, synchronous, deterministic. Manifests in, routing tables out.

How this works, in four steps:
1. ``build_pieces`` lists every (parameter slice, receiver) that must move and its candidate senders.
2. Locality: a receiver's ports of different classes (same GPU, same host, network) work at once, so
   its bytes are spread over the classes its candidates reach it by, in proportion to their bandwidth
   (water-filling to the receiver's lower bound, ``model.receiver_bound``): a piece goes to its fastest
   class with room left, cut at a row boundary where it straddles; it keeps only the candidates of
   that class. Pieces are grouped by (receiver, link class, candidates); a group is a byte stream.
3. Assignment: groups are cut into segments of about equal bytes (at dim-0 row boundaries where a
   tensor is larger than a segment) so that each receiver is fed by several senders at once, and each
   segment goes to the least-loaded candidate (load = busy seconds of its port), largest groups first.
   Single-candidate groups are placed first: they are not a choice.
4. Ordering: a list-scheduling pass over virtual time; whenever a sender's port frees up it takes,
   among its segments, the one whose receiver is free soonest. Each sender's table lists its segments
   in start order, so receivers are served in parallel rather than one after another.
The result is one ``SenderTable`` per sender and one ``ReceiverTable`` per receiver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import operator
from collections import defaultdict, deque
from typing import Iterable, Mapping, Sequence

from weightsync.wire import ExpectedEntry, PeerInfo, ReceiverTable, SenderTable, Transfer
from weightsync.wire.schema import trusted

from ..errors import PlanError
from .links import LinkClass, LinkModel, Participant, link_class
from .mapping import Mapping as NameMapping
from .model import receiver_bound
from .needs import Piece, build_pieces

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    min_chunk_bytes: int = 32 * MiB  # never cut a tensor into pieces smaller than this
    chunks_per_receiver: int = 8  # a receiver's bytes go out in about this many chunks
    prefer_locality: bool = True


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    plan_id: int
    senders: dict[int, SenderTable]
    receivers: dict[int, ReceiverTable]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.senders.values())

    @property
    def transfer_count(self) -> int:
        return sum(len(t.transfers) for t in self.senders.values())


class Segment:
    __slots__ = ("sender", "receiver", "cls", "pieces", "nbytes", "start")

    def __init__(self, receiver: int, cls: LinkClass, pieces: list[Piece]) -> None:
        self.sender = -1
        self.receiver = receiver
        self.cls = cls
        self.pieces = pieces
        self.nbytes = sum(p.nbytes for p in pieces)
        self.start = 0.0


def check_ranks(senders: Sequence[Participant], receivers: Sequence[Participant]) -> None:
    for role, group in (("sender", senders), ("receiver", receivers)):
        seen: set[int] = set()
        for p in group:
            if p.rank in seen:
                raise PlanError(f"two {role}s claim rank {p.rank}", ranks=[f"{role}/{p.rank}"])
            seen.add(p.rank)
    if not senders:
        raise PlanError("no senders to plan with")


def plan(
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    link: LinkModel = LinkModel(),
    options: PlanOptions = PlanOptions(),
    transforms: Mapping[tuple[str, str], str] = {},
    plan_id: int = 0,
    mapping: "str | NameMapping" = "identity",
) -> RoutingPlan:
    """Compute routing tables; raises ``PlanError`` (naming parameter and ranks) before any byte moves.

    ``mapping``: how receiver names are made from sender names (``weightsync.engine.plan.mapping``)."""
    with _gc_paused():
        return _plan(senders, receivers, link, options, transforms, plan_id, mapping)


@contextlib.contextmanager
def _gc_paused():
    """Planning allocates ~10^5 acyclic objects next to ~10^6 live manifest objects; cyclic GC passes
    over the latter would triple the plan time. Nothing here makes cycles, so pause it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plan(senders, receivers, link, options, transforms, plan_id, mapping) -> RoutingPlan:
    check_ranks(senders, receivers)
    senders = sorted(senders, key=lambda p: p.rank)
    receivers = sorted(receivers, key=lambda p: p.rank)
    pieces, _ = build_pieces(senders, receivers, transforms, mapping)
    groups = group_by_locality(pieces, senders, receivers, options.prefer_locality, link)
    segments = schedule(groups, link, options)
    return build_tables(segments, senders, receivers, plan_id)


def group_by_locality(
    pieces: Iterable[Piece], senders: Sequence[Participant], receivers: Sequence[Participant], prefer: bool,
    link: LinkModel = LinkModel(),
) -> dict[tuple[int, LinkClass, tuple[int, ...]], list[Piece]]:
    groups: dict[tuple[int, LinkClass, tuple[int, ...]], list[Piece]] = defaultdict(list)
    if not prefer:
        for piece in pieces:
            groups[(piece.receiver, LinkClass.NET, piece.cands)].append(piece)
        return dict(groups)
    s_by_rank = {p.rank: p for p in senders}
    r_by_rank = {p.rank: p for p in receivers}
    by_class: dict[tuple[int, int], dict[LinkClass, tuple[int, ...]]] = {}  # (receiver, id(cands)) -> class -> cands
    per_receiver: dict[int, list[Piece]] = defaultdict(list)
    classes: dict[tuple[int, int], LinkClass] = {}  # (sender, receiver) -> its link class
    for piece in pieces:
        key = (piece.receiver, id(piece.cands))  # candidate tuples are interned by build_pieces
        if key not in by_class:
            r = piece.receiver
            split: dict[LinkClass, list[int]] = defaultdict(list)
            for s in piece.cands:
                cls = classes.get((s, r))
                if cls is None:
                    cls = classes[s, r] = link_class(s_by_rank[s], r_by_rank[r])
                split[cls].append(s)
            by_class[key] = {c: tuple(ss) for c, ss in sorted(split.items())}
        per_receiver[piece.receiver].append(piece)
    for r, rpieces in per_receiver.items():
        for piece, cls in _spread(r, rpieces, by_class, link):
            groups[(r, cls, by_class[(r, id(piece.cands))][cls])].append(piece)
    return dict(groups)


def _spread(r: int, pieces: list[Piece], by_class, link: LinkModel) -> list[tuple[Piece, LinkClass]]:
    """Each piece of receiver ``r`` with the class it arrives by: every class gets about its share
    (bound x port bandwidth), the fastest first; single-class pieces are placed before the others."""
    classes_of = [by_class[(r, id(p.cands))] for p in pieces]
    if all(len(c) == 1 for c in classes_of):  # the common case: nothing to choose
        return [(p, next(iter(c))) for p, c in zip(pieces, classes_of)]
    demand: dict[frozenset, int] = defaultdict(int)
    for p, c in zip(pieces, classes_of):
        demand[frozenset(c)] += p.nbytes
    bound = receiver_bound(r, demand, link)
    room = {c: bound * link.port_bw(c, "receiver", r) for cs in demand for c in cs}
    out: list[tuple[Piece, LinkClass]] = []
    for p, c in zip(pieces, classes_of):
        if len(c) == 1:
            cls = next(iter(c))
            room[cls] -= p.nbytes
            out.append((p, cls))
    for p, c in zip(pieces, classes_of):
        if len(c) > 1:
            out.extend(_fill(p, sorted(c), room))
    return out


def _fill(piece: Piece, classes: list[LinkClass], room: dict[LinkClass, float]) -> list[tuple[Piece, LinkClass]]:
    out = []
    for cls in classes:
        if piece.nbytes <= room[cls] + 1e-6:
            room[cls] -= piece.nbytes
            return [*out, (piece, cls)]
        rows = int(max(room[cls], 0) // piece.row_bytes) if piece.row_bytes and piece.slice is not None else 0
        if 0 < rows * piece.row_bytes < piece.nbytes:  # straddles: the head fills this class
            head, piece = piece.split(rows * piece.row_bytes)
            room[cls] -= head.nbytes
            out.append((head, cls))
    cls = max(classes, key=lambda c: (room[c], -c))  # no room anywhere: where most is left
    room[cls] -= piece.nbytes
    return [*out, (piece, cls)]


class _Stream:
    """A receiver's queue of pieces that the senders in ``cands`` may supply."""

    __slots__ = ("cands", "pieces", "nbytes")

    def __init__(self, cands: frozenset[int], pieces: list[Piece]) -> None:
        self.cands = cands
        self.pieces = deque(pieces)
        self.nbytes = sum(p.nbytes for p in pieces)

    def take(self, quantum: float, min_bytes: int) -> list[Piece]:
        """Pop about ``quantum`` bytes, cutting a splittable tensor at a row boundary."""
        out: list[Piece] = []
        room = quantum
        while self.pieces:
            p = self.pieces[0]
            if p.nbytes <= room or not out and not p.row_bytes:
                out.append(self.pieces.popleft())
                room -= p.nbytes
                continue
            rows = int(room // p.row_bytes) if p.row_bytes else 0
            cut = rows * p.row_bytes
            if p.row_bytes and 0 < cut < p.nbytes and (cut >= min_bytes or not out):
                head, tail = p.split(cut)
                self.pieces[0] = tail
                out.append(head)
            elif not out:
                out.append(self.pieces.popleft())
            break
        self.nbytes -= sum(p.nbytes for p in out)
        return out


def schedule(groups, link: LinkModel, options: PlanOptions) -> list[Segment]:
    """Work-conserving list scheduling, one link class at a time (ports of classes are independent)."""
    by_cls: dict[LinkClass, dict] = defaultdict(dict)
    for key, pieces in groups.items():
        by_cls[key[1]][key] = pieces
    segments: list[Segment] = []
    for cls in sorted(by_cls):
        segments.extend(_schedule_class(cls, by_cls[cls], link, options))
    return segments


def _schedule_class(cls: LinkClass, groups, link: LinkModel, options: PlanOptions) -> list[Segment]:
    forced: dict[int, dict[int, _Stream]] = defaultdict(dict)  # receiver -> sender -> stream
    flex: dict[int, list[_Stream]] = defaultdict(list)  # receiver -> streams
    senders: set[int] = set()
    for (receiver, _, cands), pieces in sorted(groups.items()):
        senders.update(cands)
        if len(cands) == 1:
            forced[receiver][cands[0]] = _Stream(frozenset(cands), pieces)
        elif pieces:  # (flex lists hold only streams with pieces left: _match drops the emptied)
            flex[receiver].append(_Stream(frozenset(cands), pieces))
    receivers = sorted(set(forced) | set(flex))
    bw_r = {r: link.port_bw(cls, "receiver", r) for r in receivers}
    need = {r: sum(s.nbytes for s in forced[r].values()) + sum(s.nbytes for s in flex[r]) for r in receivers}
    left = {r: need[r] / bw_r[r] for r in receivers}
    quantum = {r: max(options.min_chunk_bytes, -(-need[r] // options.chunks_per_receiver)) for r in receivers}
    forced_left = defaultdict(float)
    for r, by_s in forced.items():
        for s, st in by_s.items():
            forced_left[s] += st.nbytes
    load = {s: 0.0 for s in senders}
    free_s, free_r = set(senders), set(receivers)
    events: list[tuple[float, int, int]] = []
    now = 0.0
    out: list[Segment] = []
    while True:
        for r in sorted(free_r, key=lambda r: (-left[r], r)):
            seg = _match(r, cls, forced[r], flex[r], free_s, load, forced_left, quantum[r], options)
            if seg is None:
                continue
            s = seg.sender
            busy = seg.nbytes / link.bandwidth(cls, s, r)
            seg.start = now
            out.append(seg)
            free_s.discard(s)
            free_r.discard(r)
            left[r] -= seg.nbytes / bw_r[r]
            load[s] += busy
            done = now + max(busy, len(seg.pieces) * link.per_transfer_s)
            heapq.heappush(events, (done, s, r))
        if not events:
            break
        now, s, r = heapq.heappop(events)
        free_s.add(s)
        if left[r] > 0 or forced[r] or flex[r]:
            free_r.add(r)
        while events and events[0][0] <= now:
            _, s2, r2 = heapq.heappop(events)
            free_s.add(s2)
            free_r.add(r2)
        free_r = {r for r in free_r if forced[r] or flex[r]}
    return out


def _match(r, cls, forced_r, flex_r, free_s, load, forced_left, quantum, options) -> Segment | None:
    """Pick a free sender for receiver r: its own forced work first, else the least-loaded candidate."""
    best = None
    for s, st in forced_r.items():
        if s in free_s and (best is None or forced_left[s] > forced_left[best] or
                            forced_left[s] == forced_left[best] and s < best):
            best = s
    if best is not None:
        st = forced_r[best]
        pieces = st.take(quantum, options.min_chunk_bytes)
        forced_left[best] -= sum(p.nbytes for p in pieces)
        if not st.pieces:
            del forced_r[best]
        seg = Segment(r, cls, pieces)
        seg.sender = best
        return seg
    for st in sorted(flex_r, key=lambda st: -st.nbytes):
        small, large = (st.cands, free_s) if len(st.cands) < len(free_s) else (free_s, st.cands)
        cands = [s for s in small if s in large]  # (walk the smaller: FSDP pieces have a few holders)
        if not cands:
            continue
        s = min(cands, key=lambda s: (load[s], s))
        seg = Segment(r, cls, st.take(quantum, options.min_chunk_bytes))
        seg.sender = s
        if not st.pieces:
            flex_r.remove(st)
        return seg
    return None


def build_tables(
    segments: list[Segment], senders: Sequence[Participant], receivers: Sequence[Participant], plan_id: int
) -> RoutingPlan:
    by_sender: dict[int, list[Segment]] = defaultdict(list)
    for seg in segments:
        by_sender[seg.sender].append(seg)
    ordered = {
        s: [p for seg in sorted(segs, key=lambda g: (g.start, g.receiver)) for p in seg.pieces]
        for s, segs in by_sender.items()
    }
    return tables_from_assignment(ordered, senders, receivers, plan_id)


def tables_from_assignment(
    assignment: Mapping[int, list[Piece]], senders: Sequence[Participant], receivers: Sequence[Participant],
    plan_id: int = 0,
) -> RoutingPlan:
    """Number each sender's pieces in order and mirror them into the receivers' expected entries."""
    r_by_rank = {p.rank: p for p in receivers}
    sender_tables: dict[int, SenderTable] = {}
    expected: dict[int, list[ExpectedEntry]] = {p.rank: [] for p in receivers}
    for sp in senders:
        pieces = assignment.get(sp.rank, [])
        transfers = []
        for i, p in enumerate(pieces):  # values come from validated manifests: trusted construction
            transfers.append(trusted(Transfer, i, p.src_name, p.slice, p.receiver, p.dst_name, p.region,
                                     p.offset, p.nbytes, p.transform))
            expected[p.receiver].append(trusted(
                ExpectedEntry, p.dst_name, sp.rank, i, p.slice, p.region, p.offset, p.nbytes, p.transform))
        dsts = sorted({p.receiver for p in pieces})
        peers = tuple(PeerInfo(r, r_by_rank[r].transport, r_by_rank[r].manifest.regions) for r in dsts)
        sender_tables[sp.rank] = SenderTable(sp.rank, tuple(transfers), peers)
    by_place = operator.attrgetter("region", "offset", "src_rank", "index")
    receiver_tables = {r: ReceiverTable(r, tuple(sorted(es, key=by_place))) for r, es in expected.items()}
    return RoutingPlan(plan_id, sender_tables, receiver_tables)
