"""The routing planner: pure, synchronous, deterministic. Manifests in, routing tables out.

How this works, in five steps:
1. ``build_streams`` lists every (parameter slice, receiver) that must move and its candidate senders,
   and cuts them per receiver and candidate tuple.
2. Locality: a receiver's ports of different classes (same GPU, same host, network) work at once, so
   its bytes are spread over the classes its candidates reach it by, in proportion to their bandwidth
   (water-filling to the receiver's lower bound, ``model.receiver_bound``): a piece goes to its fastest
   class with room left, cut at a row boundary where it straddles; it keeps only the candidates of
   that class. Pieces are grouped by (receiver, link class, candidates); a group is a byte stream.
3. Schedule (``schedule.py``), one link class at a time: forced streams (one candidate) are placed
   in bulk, each receiver's rotated over its senders; then a list schedule over virtual time gives
   each chunk of a receiver's flexible streams (about 1/8 of its bytes) a free candidate sender, the
   least loaded counting its forced work.
4. Levelling (``levelling.balance``): where a sender port would be the bottleneck, the busiest hands
   part of a flexible chunk to its least busy candidate, enough to bring the two level, until no move
   lowers it; then a receiver's flexible chunks that one sender has several of go to candidates with
   less for that receiver (``levelling.spread``: its largest lane ends last; ``PlanOptions.spread``).
5. Tables: each sender's chunks in start order, but a designated gatherer's gathered pieces at the
   time it has gathered them, shortest gather first, and a gatherer the schedule chose at the end of
   the engine's gather window for that parameter (``in_windows``); mirrored into receivers' tables. (The engine runs
   a sender's table as one lane per receiver, all at once: the order matters inside a lane, for when
   each transfer is issued, and in the model for when each gather is made.)
The result is one ``SenderTable`` per sender and one ``ReceiverTable`` per receiver.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import operator
from collections import defaultdict
from itertools import groupby
from typing import Mapping, Optional, Sequence

from weightsync.wire import PeerInfo, SenderTable

from ..errors import PlanError
from .catalog import Index
from .links import LinkClass, LinkModel, Participant, classes_of, by_host, host_mates, mates_of
from .mapping import Mapping as NameMapping
from .model import receiver_bound
from .needs import Piece, PlanCache, build_streams
from .sources import Streams
from .levelling import balance, spread
from .schedule import schedule
from .tables import RoutingPlan, build_tables
from .windows import GATHER_BUDGET_BYTES, window_ends

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    min_chunk_bytes: int = 32 * MiB  # never cut a tensor into pieces smaller than this
    chunks_per_receiver: int = 8  # a receiver's bytes go out in about this many chunks
    prefer_locality: bool = True
    level: bool = True  # even out sender ports after the schedule (``levelling.balance``)
    spread: bool = True  # spread a receiver's flexible work over more senders (``levelling.spread``)
    gather_budget_bytes: int = GATHER_BUDGET_BYTES  # the senders' (``SenderOptions``): the engine's gather windows


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
    cache: Optional[PlanCache] = None,
    index: "Optional[Index]" = None,
) -> RoutingPlan:
    """Compute routing tables; raises ``PlanError`` (naming parameter and ranks) before any byte moves.

    ``mapping``: how receiver names are made from sender names (``weightsync.engine.plan.mapping``).
    ``cache``: a ``PlanCache`` kept from plan to plan (a replan with the same senders resolves only
    receiver layouts it has not seen, or patches the last plan: ``patched_plan``); the tables are the
    same with or without it. ``index``: what the caller's ``Catalog`` lent (``Catalog.lend``): the
    senders' sources it kept as they joined (used if they index exactly these senders: no sender
    tensor is read again) and its receivers' layout numbers; the tables are the same without it."""
    # Planning allocates ~10^5-10^6 acyclic objects next to ~10^6 live manifest objects; cyclic GC
    # passes over the latter would triple the plan time. Nothing here makes cycles, so pause it.
    return collector_paused(_plan, senders, receivers, link, options, transforms, plan_id, mapping, cache, index)


def collector_paused(fn, *args):
    """``fn(*args)`` with the cyclic collector paused: for work that makes many acyclic objects while
    many others live (the manifests), which the collections it would set off would walk over and over."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(senders, receivers, link, options, transforms, plan_id, mapping, cache, index) -> RoutingPlan:
    check_ranks(senders, receivers)
    senders = sorted(senders, key=lambda p: p.rank)
    receivers = sorted(receivers, key=lambda p: p.rank)
    if cache is not None and cache.same_senders(senders, transforms, mapping):
        routing = patched_plan(cache, senders, receivers, link, options, plan_id)
        if routing is not None:
            return routing
    pieces, streams = build_streams(senders, receivers, transforms, mapping, cache, index)
    groups = group_by_locality(pieces, senders, receivers, options.prefer_locality, link, streams)
    sched = schedule(groups, link, options)
    if options.level:
        balance(sched, link, options)
    if options.spread:
        spread(sched, link)
    routing = tables_for(sched, senders, receivers, plan_id, streams, link, options)
    if cache is not None:
        cache.last = (receivers, (link, options), senders, routing)
    return routing


def gathered_at(gathers: Mapping[tuple[int, str], int], senders: Sequence[Participant],
                link: LinkModel) -> dict[tuple[int, str], float]:
    """``Streams.gathers`` (bytes each designated sender has pulled once it has each parameter) in
    seconds, over its gather port (``gather_bw``)."""
    bw = gather_bw(senders, link)
    return {(s, name): n / bw[s] for (s, name), n in gathers.items()}


def gather_bw(senders: Sequence[Participant], link: LinkModel) -> dict[int, float]:
    """Each sender's gather port's bandwidth: its network port where the senders span hosts, else its
    host's links (a gather pulls from every holder of the parameter)."""
    cls = LinkClass.NET if len({p.host for p in senders}) > 1 else LinkClass.HOST
    return {p.rank: link.port_bw(cls, "sender", p.rank) for p in senders}


def tables_for(sched, senders: Sequence[Participant], receivers: Sequence[Participant], plan_id: int,
               streams: Optional[Streams], link: LinkModel, options: PlanOptions) -> RoutingPlan:
    """The tables (``build_tables``), each gatherer's gathered pieces at when it has them: a designated
    one's in its own queue (``gathered_at``), the others' in the engine's windows (``in_windows``)."""
    if streams is None:
        return build_tables(sched, senders, receivers, plan_id)
    designated = {name for _, name in streams.pulls}
    undesignated = {n: holders for n, (_, holders) in streams.gather_params.items() if n not in designated}
    timer = functools.partial(in_windows, streams, senders, link, options.gather_budget_bytes)
    return build_tables(sched, senders, receivers, plan_id, gathered_at(streams.gathers, senders, link),
                        undesignated, timer)


def in_windows(streams: Streams, senders: Sequence[Participant], link: LinkModel, budget: int,
               pairs: list[tuple[int, str]]) -> dict[tuple[int, str], float]:
    """When each (sender, parameter) of ``pairs`` (the gathers the schedule made of parameters with no
    designated gatherer) is gathered, in the schedule's seconds, in the windows the engine's
    ``Gatherer`` takes them in (``windows.window_ends``: the smallest first, a window at once on every
    rank, one after another), with the designated gathers beside them. A pull is the full tensor less
    the sender's share of it (its own rows; about one holder's part, here), over its gather port."""
    params, bw = streams.gather_params, gather_bw(senders, link)
    pulls = {(s, n): b / bw[s] for (s, n), b in streams.pulls.items()}
    part = {n: full - full // max(1, len(holders)) for n, (full, holders) in params.items()}
    pulls.update(((s, n), part[n] / bw[s]) for s, n in pairs)
    order = {n: i for i, n in enumerate(params)}
    ends = window_ends(pulls, {n: full for n, (full, _) in params.items()},
                       {n: holders for n, (_, holders) in params.items()}, order, budget)[1]
    return {pair: ends[pair[1]] for pair in pairs}


def patched_plan(cache: PlanCache, senders: Sequence[Participant], receivers: Sequence[Participant],
                 link: LinkModel, options: PlanOptions, plan_id: int) -> Optional[RoutingPlan]:
    """The last plan's tables, if the senders have the same tensors (the caller checks) and every
    receiver is the same process or a restarted one that the planner cannot tell apart (the same rank,
    tensors, region sizes), every restarted member keeps its transport kind, and every sender reaches
    every receiver by the link class it did (``_same_classes``: a new address, new region descriptors;
    another host or device only where no class changes, as for an inference worker back on another
    inference host, or a trainer on another trainers' host). Then a plan from scratch would make the
    same tables, the restarted receivers' ``PeerInfo`` aside: only those are replaced (a restarted
    sender changes no table, only its keys). None otherwise."""
    if cache.last is None or cache.last[1] != (link, options) or len(cache.last[0]) != len(receivers):
        return None
    before, _, senders_before, routing = cache.last
    new_peers: dict[int, PeerInfo] = {}
    for old, new in zip(before, receivers):
        if old.rank != new.rank:
            return None
        if old.manifest is new.manifest and old.transport == new.transport:
            continue
        if not (old.transport.kind == new.transport.kind
                and [(r.region_id, r.nbytes, r.device) for r in old.manifest.regions]
                == [(r.region_id, r.nbytes, r.device) for r in new.manifest.regions]
                and old.manifest.tensors == new.manifest.tensors):
            return None
        new_peers[new.rank] = PeerInfo(new.rank, new.transport, new.manifest.regions)
    if not _same_classes(senders_before, senders, before, receivers):
        return None
    tables = {s: t if not any(p.rank in new_peers for p in t.peers)
              else SenderTable(s, t.transfers, tuple(new_peers.get(p.rank, p) for p in t.peers))
              for s, t in routing.senders.items()}
    patched = RoutingPlan(plan_id, tables, dict(routing.receivers))
    cache.last, cache.patched = (list(receivers), cache.last[1], list(senders), patched), cache.patched + 1
    return patched


def _same_classes(senders_before: Sequence[Participant], senders: Sequence[Participant],
                  before: Sequence[Participant], receivers: Sequence[Participant]) -> bool:
    """Whether every sender reaches every receiver by the same link class as before (and every moved
    sender keeps its transport kind): the planner reads where members are through nothing else
    (``links.mates_of``). Only the pairs with a member whose transport changed are looked at."""
    moved_r = [(o, n) for o, n in zip(before, receivers) if o.transport != n.transport]
    moved_s = [(o, n) for o, n in zip(senders_before, senders) if o.transport != n.transport]
    if not moved_r and not moved_s:
        return True
    if any(o.transport.kind != n.transport.kind for o, n in moved_s):
        return False
    if moved_r:
        senders_then, senders_now = by_host(senders_before), by_host(senders)
        if any(mates_of(o, senders_then) != mates_of(n, senders_now) for o, n in moved_r):
            return False
    if moved_s:  # a moved sender's classes, to the receivers on its host then and now
        receivers_then, receivers_now = by_host(before), by_host(receivers)
        if any(mates_of(o, receivers_then) != mates_of(n, receivers_now) for o, n in moved_s):
            return False
    return True


Groups = dict[LinkClass, "dict[int, dict[tuple[int, ...], list[Piece]]] | Streams"]


def group_by_locality(
    pieces: Sequence[Piece], senders: Sequence[Participant], receivers: Sequence[Participant], prefer: bool,
    link: LinkModel = LinkModel(), streams: Optional[Streams] = None,
) -> Groups:
    """The pieces as byte streams: by link class, receiver, and candidate senders (of that class).
    ``streams``: the pieces already cut by receiver and candidate tuple (``needs.build_streams``); where
    every piece comes by the network as it is (no preference, or no receiver has a sender on its host)
    they are the network's streams as they are."""
    groups: Groups = defaultdict(dict)
    if not pieces:
        return groups
    if not prefer and streams is None:
        net = groups[LinkClass.NET]
        for piece in pieces:
            net.setdefault(piece.receiver, {}).setdefault(piece.cands, []).append(piece)
        return groups
    mates = host_mates(senders, receivers) if prefer else {}
    if streams is not None and not any(mates.values()):
        groups[LinkClass.NET] = streams
        return groups
    raw: dict[int, dict[int, list[Piece]]] = {}  # receiver -> id(cands) -> pieces, in order
    if streams is None:
        _cut(pieces, raw)
    else:
        for same in streams.lists():
            head = same[0]
            by_cands = raw.get(head.receiver)
            if by_cands is None:
                by_cands = raw[head.receiver] = {}
            by_cands[id(head.cands)] = same
    by_class: dict[tuple[int, int], dict] = {}
    spread = set()  # receivers with a choice to make
    for r, by_cands in raw.items():
        if not mates[r]:  # no sender on its host: every piece comes by the network, as it is
            groups[LinkClass.NET][r] = {same[0].cands: same for same in by_cands.values()}
            continue
        for key, same in by_cands.items():
            split = by_class[(r, key)] = classes_of(same[0].cands, mates[r])
            if len(split) > 1:
                spread.add(r)
        if r not in spread:
            for key, same in by_cands.items():
                ((cls, cands),) = by_class[(r, key)].items()
                groups[cls].setdefault(r, {}).setdefault(cands, []).extend(same)
    if spread:
        per_receiver: dict[int, list[Piece]] = defaultdict(list)
        for piece in pieces:
            if piece.receiver in spread:
                per_receiver[piece.receiver].append(piece)
        for r, rpieces in per_receiver.items():
            for piece, cls in _spread(r, rpieces, by_class, link):
                cands = by_class[(r, id(piece.cands))][cls]
                groups[cls].setdefault(r, {}).setdefault(cands, []).append(piece)
    return groups


_receiver = operator.attrgetter("receiver")


def _cut(pieces: Sequence[Piece], raw: dict[int, dict[int, list[Piece]]]) -> None:
    """``pieces`` into ``raw``: by receiver, then candidate tuple, each in order."""
    for r, run in groupby(pieces, _receiver):
        by_cands = raw.get(r)
        if by_cands is None:
            by_cands = raw[r] = {}
        for piece in run:
            key = id(piece.cands)  # candidate tuples are interned by build_pieces
            same = by_cands.get(key)
            if same is None:
                by_cands[key] = [piece]
            else:
                same.append(piece)


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
