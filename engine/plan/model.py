"""The makespan model, the lower bound, and the two baselines it is compared with.

How this works: ``makespan`` replays routing tables over virtual time the way the engine runs them
(``weightsync.engine.datapath.pipeline``): a sender's table is split into one lane per receiver, in
table order inside each lane, and all its lanes run at once, each with writes in flight back to back.
One host thread issues the table in order, one transfer every ``per_transfer_s`` (issue overhead; it
overlaps with data already moving). A lane's data crosses its sender's and its receiver's port of its
link class (``links.LinkClass``); a port carries all its lanes at once and shares its bandwidth among
them max-min fairly, as a NIC shares a link among queue pairs and copy engines among concurrent copies
(``replay.FluidReplay``); a transfer moves once it is issued, its gather (if any) is done and the
transfer before it in its lane has landed. The makespan is when the last byte lands. With
``sharing="slots"`` a port instead carries one transfer at a time, whole, and when it frees takes the
lane that has waited longest among those whose other port is free (``_SlotReplay``): a pessimistic
reading, which the bench reports beside the other.

Gathers (FSDP): a sender whose table reads rows of a gatherable parameter outside its own shard first
pulls the rest of that full tensor, once per round, over its inbound port of the class that reaches
the parameter's other holders (the network when they span hosts), in table order, at once with the
other senders' pulls; a transfer starts only once its gather is done. (``weightsync.engine.transforms
.gather.Gatherer`` gathers in windows of parameters, smallest first, each window's pulls at once on
every rank and the windows one after another (``windows.gather_windows``): ``stats["windowed_gather_s"]``
is how long the same gathers take so, and ``gathering="windows"`` replays the tables with each gather
done when its window ends.) The holders serve those rows from their
outbound ports: the makespan is also at least any sender's outbound bytes (sends and served rows) over
its port. Rows inside the sender's own shard need no gather (shard-to-shard).

``lower_bound`` ignores ordering and issue overhead, and is a lower bound for *any* tables under this
model (docs/PLANNER.md has the proof): the slowest of
(a) each receiver, whose ports of different classes run concurrently: a piece may arrive through any
    class one of its candidates reaches the receiver by, so for every set S of classes, the pieces
    that can only use classes in S need at least bytes / (sum of the receiver's port bandwidths over
    S) (the tightest S is the receiver's time; with one class it is bytes over that port); and
    bytes that every candidate must first gather arrive no sooner than the quickest candidate's pull
    over its inbound port, so with release times: tau + the bytes released at tau or later over S;
(b) each sender's bytes that only it can supply, over its port of their class;
(c) per class, the bytes that can only leave a sender by that class, plus the rows holders must serve
    to gatherers (a piece every candidate of which reads outside its own gatherable shard makes one of
    them gather the parameter: at least the full tensor less that candidate's shard, once per
    parameter), over all senders' ports of that class together.

Baselines, planned from the same pieces and replayed by the same model: ``broadcast_assignment``
(rank 0 feeds every receiver, parameter by parameter; it is even allowed to send what it would first
have to gather) and ``seed_greedy_assignment`` (for each (parameter, receiver) pair in parameter
order, the candidate sender with the fewest bytes so far; no locality, no splitting, no ordering).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Mapping, Optional, Sequence

from weightsync.wire import SenderTable

from .links import LinkClass, LinkModel, Participant, classes_of, host_mates, link_class
from .needs import Piece
from .replay import FluidReplay
from .windows import GATHER_BUDGET_BYTES, window_ends


def makespan(
    tables: Mapping[int, SenderTable],
    senders: Sequence[Participant],
    receivers: Sequence[Participant],
    link: LinkModel,
    stats: Optional[dict] = None,
    sharing: str = "bandwidth",
    gather_budget: int = GATHER_BUDGET_BYTES,
    gathering: str = "queues",
) -> float:
    """When the last byte lands; ``stats`` (a dict) receives ``gathered_bytes``, ``gather_s`` (the
    busiest sender's inbound gather time) and ``windowed_gather_s`` (the same gathers in the engine's
    windows under each sender's ``gather_budget``: each window as long as its slowest rank's pulls in
    it, one window after another). ``gathering``: when a gather is done, "queues" (each sender pulls
    its own in table order, back to back) or "windows" (when its window ends, as the engine's
    ``Gatherer`` makes them). ``sharing``: how a port carries its lanes, "bandwidth" (all
    at once, max-min fair, as NICs and copy engines share a link: ``replay.FluidReplay``) or "slots"
    (one transfer at a time, whole, the lanes in turn: ``_SlotReplay``, a pessimistic reading reported
    beside it)."""
    if sharing not in ("bandwidth", "slots"):
        raise ValueError(f"sharing must be 'bandwidth' or 'slots', not {sharing!r}")
    if gathering not in ("queues", "windows"):
        raise ValueError(f"gathering must be 'queues' or 'windows', not {gathering!r}")
    gathers = _Gathers(senders, link)
    if gathering == "windows":
        gathers.in_windows(tables, gather_budget)
    lanes, sending = _lanes(tables, senders, receivers, link, gathers)
    end_all = _SlotReplay(lanes, link).run() if sharing == "slots" else _fluid(lanes, link).run()
    if stats is not None:
        stats["gathered_bytes"] = gathers.gathered_bytes
        stats["gather_s"] = max(gathers.free.values(), default=0.0)
        stats["windowed_gather_s"] = gathers.windowed_s(gather_budget)
    return max(end_all, gathers.serving_bound(sending))


def _fluid(lanes, link: LinkModel) -> FluidReplay:
    """The lanes as flows between numbered ports."""
    ports_s: dict[tuple[int, LinkClass], int] = {}
    ports_r: dict[tuple[int, LinkClass], int] = {}
    sport = [ports_s.setdefault((s, c), len(ports_s)) for (s, _), (c, _) in lanes.items()]
    rport = [ports_r.setdefault((r, c), len(ports_r)) for (_, r), (c, _) in lanes.items()]
    return FluidReplay(sport, rport, [items for _, items in lanes.values()],
                       [link.port_bw(c, "sender", s) for s, c in ports_s],
                       [link.port_bw(c, "receiver", r) for r, c in ports_r])


def _lanes(tables, senders, receivers, link: LinkModel, gathers: "_Gathers"):
    """Each (sender, receiver) lane's link class and transfers in table order as (when it is released:
    issued by the sender's one host thread and its gather done, bytes); and each sender port's busy
    time (its bytes at each pair's bandwidth)."""
    s_by_rank = {p.rank: p for p in senders}
    r_by_rank = {p.rank: p for p in receivers}
    lanes: dict[tuple[int, int], tuple[LinkClass, list[tuple[float, int]]]] = {}
    sending: dict[tuple[int, LinkClass], float] = defaultdict(float)
    for s, table in sorted(tables.items()):
        for i, tr in enumerate(table.transfers):
            r = tr.dst_rank
            lane = lanes.get((s, r))
            if lane is None:
                lane = lanes[s, r] = (link_class(s_by_rank[s], r_by_rank[r]), [])
            posted = (i + 1) * link.per_transfer_s  # one host thread issues the table in order
            lane[1].append((max(posted, gathers.ready(s, tr)), tr.nbytes))
            sending[s, lane[0]] += tr.nbytes / link.bandwidth(lane[0], s, r)
    return lanes, sending


class _SlotReplay:
    """The same lanes on ports that carry one transfer at a time, whole (``makespan(sharing="slots")``):
    a port that frees takes the longest-waiting lane whose other port is free."""

    def __init__(self, lanes: Mapping[tuple[int, int], tuple[LinkClass, list[tuple[float, int]]]],
                 link: LinkModel) -> None:
        # (sender, receiver) -> its two ports, ("s", rank, cls) and ("r", rank, cls), and its transfers as
        # (when it can start at the earliest: issued and gathered, seconds of data)
        self.lanes = {(s, r): (("s", s, c), ("r", r, c), [(q, n / link.bandwidth(c, s, r)) for q, n in items])
                      for (s, r), (c, items) in lanes.items()}

    def run(self) -> float:
        busy: set = set()  # ports carrying a transfer
        waiting: dict = defaultdict(dict)  # port -> lane -> since when its next transfer waits (FIFO)
        pos = dict.fromkeys(self.lanes, 0)
        events = [(lane[2][0][0], 0, key) for key, lane in self.lanes.items()]  # (time, kind, lane)
        heapq.heapify(events)
        end_all = 0.0

        def start(key, t):
            sp, rp, items = self.lanes[key]
            waiting[sp].pop(key, None)
            waiting[rp].pop(key, None)
            busy.add(sp)
            busy.add(rp)
            dur = items[pos[key]][1]
            heapq.heappush(events, (t + dur, 1, key))

        def serve(port, t):  # a port just freed: its longest-waiting lane whose other port is free
            for key in waiting[port]:  # (dicts keep insertion order: the oldest first)
                sp, rp, _ = self.lanes[key]
                if sp not in busy and rp not in busy:
                    start(key, t)
                    return

        while events:
            t, kind, key = heapq.heappop(events)
            sp, rp, items = self.lanes[key]
            if kind == 1:  # a transfer ended
                end_all = max(end_all, t)
                busy.discard(sp)
                busy.discard(rp)
                pos[key] += 1
                if pos[key] < len(items):
                    heapq.heappush(events, (max(t, items[pos[key]][0]), 0, key))
                serve(sp, t)
                serve(rp, t)
            elif sp in busy or rp in busy:
                waiting[sp][key] = t
                waiting[rp][key] = t
            else:
                start(key, t)
        return end_all


class _Holders:
    """Who holds which gatherable (FSDP) shard, and the class a gather of each parameter travels by."""

    def __init__(self, senders: Sequence[Participant]) -> None:
        self.shards: dict[int, dict[str, object]] = {}  # sender -> name -> its gatherable TensorSpec
        holders: dict[str, list[Participant]] = defaultdict(list)
        for sp in senders:
            mine = {t.name: t for t in sp.manifest.tensors if t.gatherable and t.shard is not None}
            self.shards[sp.rank] = mine
            for name in mine:
                holders[name].append(sp)
        self.holders = holders
        self.senders = senders
        self.hosts = {name: {p.host for p in ps} for name, ps in holders.items()}

    def gather_class(self, name: str) -> LinkClass:
        """The network when the parameter's holders span hosts, else the host's links."""
        return LinkClass.NET if len(self.hosts[name]) > 1 else LinkClass.HOST


class _Gathers(_Holders):
    """The gathers a set of tables implies, per sender and parameter (see the module's header)."""

    def __init__(self, senders: Sequence[Participant], link: LinkModel) -> None:
        super().__init__(senders)
        self.link = link
        self.free: dict[int, float] = defaultdict(float)  # sender -> when its inbound gather port frees
        self.done: dict[tuple[int, str], float] = {}  # (sender, name) -> when its full tensor is there
        self.took: dict[tuple[int, str], float] = {}  # (sender, name) -> its pull's seconds
        self.full_bytes: dict[str, int] = {}  # name -> its full tensor's bytes
        self.gathered_bytes = 0

    def ready(self, s: int, tr) -> float:
        spec = self.shards.get(s, {}).get(tr.name)
        if spec is None or spec.shard.covers(tr.slice):
            return 0.0
        key = (s, tr.name)
        at = self.done.get(key)
        if at is None:
            pull = max(0, _full_bytes(spec) - spec.nbytes)
            cls = self.gather_class(tr.name)
            took = pull / self.link.port_bw(cls, "sender", s)  # (its own NIC, inbound)
            at = self.free[s] = self.free[s] + took
            self.done[key] = at
            self.took[key] = took
            self.full_bytes[tr.name] = _full_bytes(spec)
            self.gathered_bytes += pull
        return at

    def windowed_s(self, budget: int) -> float:
        """The gathers as the engine's ``Gatherer`` makes them: its windows (``windows.gather_windows``,
        every holder of a parameter one mesh, with ``budget`` each), each as long as its slowest rank's
        pulls in it, one after another."""
        return self.window_ends(budget)[0]

    def in_windows(self, tables: Mapping[int, SenderTable], budget: int) -> None:
        """Every gather the tables imply, each done when its window ends (``window_ends``), instead of
        when its sender's own queue reaches it."""
        for s, table in sorted(tables.items()):
            for tr in table.transfers:
                self.ready(s, tr)
        ends = self.window_ends(budget)[1]
        self.done.update({key: ends[key[1]] for key in self.done})

    def window_ends(self, budget: int) -> tuple[float, dict[str, float]]:
        """The gathers in the engine's windows (``windows.window_ends``): when the last ends, and when
        each parameter's window does."""
        holders = {name: [p.rank for p in self.holders[name]] for name in self.full_bytes}
        return window_ends(self.took, self.full_bytes, holders, _param_order(self.senders), budget)

    def serving_bound(self, sending: Mapping[tuple[int, LinkClass], float]) -> float:
        """Every sender port's busy time: its sends, plus the rows it serves to gatherers."""
        gatherers: dict[str, int] = defaultdict(int)
        for _, name in self.done:
            gatherers[name] += 1
        if not gatherers:
            return 0.0
        out = defaultdict(float, sending)
        for name, n in gatherers.items():
            cls = self.gather_class(name)
            for sp in self.holders[name]:
                mine = (sp.rank, name) in self.done
                out[sp.rank, cls] += self.shards[sp.rank][name].nbytes * (n - mine) / self.link.port_bw(cls, "sender", sp.rank)
        return max(out.values())


def lower_bound(
    pieces: Sequence[Piece], senders: Sequence[Participant], receivers: Sequence[Participant], link: LinkModel
) -> float:
    mates = host_mates(senders, receivers)
    by_classes: dict[int, dict[frozenset, int]] = defaultdict(lambda: defaultdict(int))  # receiver -> usable classes -> bytes
    forced: dict[tuple[int, LinkClass], float] = defaultdict(float)
    confined: dict[LinkClass, int] = defaultdict(int)  # bytes that can only leave a sender by this class
    usable: dict[tuple[int, tuple[int, ...]], frozenset] = {}
    gathers = _MinGathers(senders, link)
    for p in pieces:
        key = (p.receiver, p.cands)
        classes = usable.get(key)
        if classes is None:
            classes = usable[key] = frozenset(classes_of(p.cands, mates[p.receiver]))
        by_classes[p.receiver][classes, gathers.add(p)] += p.nbytes
        if len(p.cands) == 1:
            (c,) = classes
            forced[p.cands[0], c] += p.nbytes / link.port_bw(c, "sender", p.cands[0])
        if len(classes) == 1:
            confined[next(iter(classes))] += p.nbytes
    served = gathers.bytes_by_class()
    aggregate = [(confined[c] + served[c]) / sum(link.port_bw(c, "sender", s.rank) for s in senders)
                 for c in set(confined) | set(served)]
    receiving = [released_bound(r, groups, link) for r, groups in by_classes.items()]
    return max([*aggregate, *receiving, *forced.values()], default=0.0)


class _MinGathers(_Holders):
    """The fewest bytes holders must serve to gatherers, under the model: a piece every one of whose
    candidates reads outside its own gatherable shard makes some candidate gather the parameter, pulling
    the full tensor less its own shard over the class that reaches the other holders; per parameter,
    once, at the smallest such pull."""

    def __init__(self, senders: Sequence[Participant], link: LinkModel) -> None:
        super().__init__(senders)
        self.link = link
        self.pull: dict[str, int] = {}

    def add(self, p: Piece) -> float:
        """Count ``p``'s gather; the earliest its bytes can leave any candidate (0: one sends it from
        its own shard; else the quickest candidate's pull over its inbound port)."""
        pulls = []
        for s in p.cands:
            spec = self.shards[s].get(p.src_name)
            if spec is None or spec.shard.covers(p.slice):
                return 0.0  # this candidate sends it without a gather
            pulls.append((s, _full_bytes(spec) - spec.nbytes))
        if not pulls:
            return 0.0
        least = min(n for _, n in pulls)
        self.pull[p.src_name] = min(self.pull.get(p.src_name, least), least)
        cls = self.gather_class(p.src_name)
        return min(n / self.link.port_bw(cls, "sender", s) for s, n in pulls)

    def bytes_by_class(self) -> dict[LinkClass, int]:
        out: dict[LinkClass, int] = defaultdict(int)
        for name, n in self.pull.items():
            out[self.gather_class(name)] += n
        return out

def _full_bytes(spec) -> int:
    """A gatherable shard's full tensor, in bytes (the same arithmetic as the model's gathers)."""
    shard = spec.shard
    return spec.nbytes // max(1, shard.stop - shard.start) * shard.full_shape[shard.dim] if shard.stop > shard.start else 0


def receiver_bound(rank: int, groups: Mapping[frozenset, int], link: LinkModel) -> float:
    """The least time receiver ``rank`` needs when its ports of all classes run at once: the bytes of
    pieces confined to classes S, over S's summed port bandwidth, maximised over S (Hall's condition:
    a fractional split of the pieces over the classes finishing by T exists iff no S needs longer)."""
    return released_bound(rank, {(classes, 0.0): n for classes, n in groups.items()}, link)


def released_bound(rank: int, groups: Mapping[tuple[frozenset, float], int], link: LinkModel) -> float:
    """``receiver_bound`` with release times: bytes that no candidate can send before ``tau`` (it must
    first gather them) arrive after ``tau``, so for every set S of classes and every ``tau``, the
    receiver needs at least ``tau`` + (bytes confined to S released at ``tau`` or later) / S's ports."""
    present = sorted({c for classes, _ in groups for c in classes})
    worst = 0.0
    for mask in range(1, 1 << len(present)):
        subset = {c for i, c in enumerate(present) if mask >> i & 1}
        bw = sum(link.port_bw(c, "receiver", rank) for c in subset)
        confined: dict[float, int] = defaultdict(int)
        for (classes, release), n in groups.items():
            if classes <= subset:
                confined[release] += n
        later = 0
        for release in sorted(confined, reverse=True):
            later += confined[release]
            worst = max(worst, release + later / bw)
    return worst


def _param_order(senders: Sequence[Participant]) -> dict[str, int]:
    order: dict[str, int] = {}
    for sp in senders:
        for t in sp.manifest.tensors:
            order.setdefault(t.name, len(order))
    return order


def _param_major(pieces: Sequence[Piece], senders: Sequence[Participant]) -> list[Piece]:
    rank = _param_order(senders)
    return sorted(pieces, key=lambda p: (rank[p.src_name], p.receiver, p.offset))


def broadcast_assignment(pieces: Sequence[Piece], senders: Sequence[Participant]) -> dict[int, list[Piece]]:
    root = min(p.rank for p in senders)
    return {root: _param_major(pieces, senders)}


def seed_greedy_assignment(pieces: Sequence[Piece], senders: Sequence[Participant]) -> dict[int, list[Piece]]:
    sent: dict[int, int] = defaultdict(int)
    out: dict[int, list[Piece]] = defaultdict(list)
    for p in _param_major(pieces, senders):
        s = min(p.cands, key=lambda c: (sent[c], c))
        sent[s] += p.nbytes
        out[s].append(p)
    return out
