"""From the schedule to routing tables: each sender's ordered transfers, mirrored into each receiver's
expected entries, kept as columns.

How this works: ``build_tables`` orders each sender's work by when it starts in the schedule (by
receiver at a tie), one stable ``numpy.lexsort`` over every run (``work.Runs``: ranges of one list
of pieces, so every piece is taken in the senders' order by one C call); a designated gatherer's
piece of what it gathers then takes its place at the time it has gathered it, shortest gather
first, and a gatherer the schedule chose takes its pieces at the end of their gather window (``_when_gathered``:
the schedule counts bytes, not gathers, and a lane waits for its head), and
``tables_from_assignment`` numbers it: a sender's transfers are its pieces
(tuples) transposed into columns by one ``zip`` (``wire.columns.Rows``: a tuple per field, no object
per transfer). The receivers'
entries are the same transfers seen from the other end, sorted by (receiver, region, offset), a tie
kept in (sender, index) order: one stable ``numpy.lexsort`` over every transfer at once, then each
receiver's pieces taken in that order by one C-level ``itemgetter`` and transposed into its columns
(a receiver's pieces fit in cache), so no Python object is made per entry.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from itertools import chain, repeat
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from weightsync.wire import ExpectedEntry, PeerInfo, ReceiverTable, SenderTable, Transfer
from weightsync.wire.columns import Rows

from .links import Participant
from .needs import Piece
from .sources import in_order, looked_up

if TYPE_CHECKING:
    from .work import Schedule


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    plan_id: int
    senders: dict[int, SenderTable]
    receivers: dict[int, ReceiverTable]

    @functools.cached_property
    def nbytes(self) -> int:  # (read at every round's start: summed once per plan)
        return sum(t.nbytes for t in self.senders.values())

    @property
    def transfer_count(self) -> int:
        return sum(len(t.transfers) for t in self.senders.values())


def build_tables(sched: "Schedule", senders: Sequence[Participant], receivers: Sequence[Participant],
                 plan_id: int, gathers: Mapping[tuple[int, str], float] = {}, undesignated: Mapping[str, tuple] = {},
                 timer: Optional[Callable[[list[tuple[int, str]]], Mapping[tuple[int, str], float]]] = None,
                 ) -> RoutingPlan:
    """Each sender's pieces in the order its work starts in the schedule (by receiver at a tie; a tie
    in both keeps ``Schedule.runs``' order): one stable sort of every run. ``gathers``: when (in the
    schedule's seconds) each designated sender has each parameter it gathers; a piece of it then
    takes its place in that sender's table at that time (``_when_gathered``). ``undesignated``: the
    parameters whose gatherers the schedule chose, each with its gather pieces' candidates (its full
    holders); ``timer`` says, for the (sender, name) pairs the schedule made, when each has it, and
    those pieces take their place so too."""
    runs = sched.runs()
    if not len(runs):
        return tables_from_assignment({}, senders, receivers, plan_id)
    order = np.lexsort((runs.receiver, runs.start, runs.sender))
    count = runs.count[order]
    at = np.cumsum(count) - count  # each run's first piece in the senders' order
    taken = np.repeat(runs.first[order] - at, count) + np.arange(int(count.sum()))  # (pool positions)
    by = runs.sender[order]
    if gathers or undesignated:
        taken = _when_gathered(runs.pool, taken, np.repeat(by, count), np.repeat(runs.start[order], count), gathers,
                               undesignated, timer)
    pieces = in_order(runs.pool, taken)
    firsts = np.flatnonzero(np.diff(by, prepend=-1))  # each sender's first run
    bounds = [*at[firsts].tolist(), len(pieces)]
    ordered = {s: pieces[a:b] for s, a, b in zip(by[firsts].tolist(), bounds, bounds[1:])}
    return tables_from_assignment(ordered, senders, receivers, plan_id)


def _when_gathered(pool: list[Piece], taken: np.ndarray, sender: np.ndarray, start: np.ndarray,
                   gathers: Mapping[tuple[int, str], float], undesignated: Mapping[str, tuple] = {},
                   timer=None) -> np.ndarray:
    """``taken``, the positions in ``pool`` of the pieces in the senders' order (each sender's together,
    in start order; ``sender`` and ``start`` each one's), reordered so that, within each sender, each
    piece of a parameter it gathers moves to when it has gathered that parameter (a stable sort by
    that time, or by its start for the others). The schedule counts bytes, not gathers: in the model
    a sender's first transfer of a parameter it gathers sets off that gather, and a lane waits for its
    head. So its gathers go in the order ``gathers`` times them (shortest first), and a gathered piece
    never holds up at a lane's head what could go at once. A gatherer the schedule chose (a parameter
    of ``undesignated``, a piece with its full holders as candidates) is timed by ``timer``, asked
    once for every such (sender, name) pair: the end of the engine's gather window for it
    (``planner.in_windows``)."""
    ids: dict[str, int] = {}
    for _, name in gathers:
        ids.setdefault(name, len(ids))
    first_undesignated = len(ids)
    for name in undesignated:
        ids.setdefault(name, len(ids))
    # each pool piece's parameter number (-1: none gathered), read once per pool piece, then in order
    name = np.fromiter(map(ids.get, map(_src_name, pool), repeat(-1)), np.int64, len(pool))[taken]
    gathering = name >= 0
    if len(ids) > first_undesignated:  # the pairs the schedule made: when each is gathered (``timer``)
        names = list(ids)
        late = np.flatnonzero(name >= first_undesignated)
        cands = [undesignated[names[k]] for k in name[late].tolist()]  # (a gather piece's: the full holders)
        other = np.fromiter((pool[i][9] is not c for i, c in zip(taken[late].tolist(), cands)), bool, len(late))
        gathering[late[other]] = False
        made = (sender * len(ids) + name)[gathering & (name >= first_undesignated)]
        gathers = {**gathers, **timer([(k // len(ids), names[k % len(ids)]) for k in np.unique(made).tolist()])}
    known = np.fromiter((s * len(ids) + ids[name] for s, name in gathers), np.int64, len(gathers))
    order = np.argsort(known)
    found, when = looked_up(known[order], np.fromiter(gathers.values(), np.float64, len(gathers))[order],
                            sender * len(ids) + name)
    gathered = found & gathering  # (a name not gathered, -1, would read the sender before's last)
    if not gathered.any():
        return taken
    return taken[np.lexsort((np.where(gathered, when, start), sender))]  # (stable)


_src_name = operator.itemgetter(2)  # (``Piece.src_name``)

# a transfer's column <- the piece field it is read from
_TRANSFER = {"name": "src_name", "slice": "slice", "dst_rank": "receiver", "dst_name": "dst_name", "dst_region": "region",
             "dst_offset": "offset", "nbytes": "nbytes", "transform": "transform"}
# a receiver's entry column <- the transfers' column it mirrors
_MIRROR = {"region": "dst_region", "offset": "dst_offset", "name": "dst_name", "slice": "slice", "nbytes": "nbytes",
           "transform": "transform"}
_ENTRY = ("src_rank", "index", *_MIRROR)
# a receiver's entry column <- the position of the piece field it is read from
_ENTRY_FIELDS = tuple((entry, Piece._fields.index(_TRANSFER[field])) for entry, field in _MIRROR.items())


def tables_from_assignment(
    assignment: Mapping[int, list[Piece]], senders: Sequence[Participant], receivers: Sequence[Participant],
    plan_id: int = 0,
) -> RoutingPlan:
    """Number each sender's pieces in order and mirror them into the receivers' expected entries."""
    peer_of = {p.rank: PeerInfo(p.rank, p.transport, p.manifest.regions) for p in receivers}  # (frozen: shared)
    sender_tables: dict[int, SenderTable] = {}
    tables: list[tuple[int, dict[str, tuple]]] = []
    for sp in senders:
        pieces = assignment.get(sp.rank, [])
        fields = dict(zip(Piece._fields, zip(*pieces) if pieces else ((),) * len(Piece._fields)))  # (one transposition)
        columns = {f: fields[field] for f, field in _TRANSFER.items()}
        transfers = Rows(Transfer, {"index": range(len(pieces)), **columns})
        ranks = set(columns["dst_rank"])
        if not ranks.issubset(peer_of):
            raise KeyError(f"sender/{sp.rank} is assigned pieces for receivers {sorted(ranks.difference(peer_of))} "
                           "not planned for")
        peers = tuple(map(peer_of.__getitem__, sorted(ranks)))
        sender_tables[sp.rank] = SenderTable(sp.rank, transfers, peers)
        tables.append((sp.rank, columns))
    every = list(chain.from_iterable(assignment.get(sp.rank, ()) for sp in senders))
    entries = receiver_entries(tables, sorted(peer_of), every)
    receiver_tables = {p.rank: ReceiverTable(p.rank, entries[p.rank]) for p in receivers}
    return RoutingPlan(plan_id, sender_tables, receiver_tables)


def receiver_entries(tables: list[tuple[int, dict[str, tuple]]], ranks: list[int],
                     pieces: Sequence[Piece]) -> dict[int, Rows]:
    """Each receiver's expected entries from the senders' transfer columns (``tables``: (sender, columns)
    in sender order; ``pieces``, theirs in that order), sorted by (region, offset); a tie keeps
    (sender, index) order. A receiver's pieces are taken at once and transposed into its columns (in
    cache: a take per column from every transfer's would read each at random)."""
    counts = [len(cols["dst_rank"]) for _, cols in tables]
    n = sum(counts)
    if n == 0:
        return {r: Rows(ExpectedEntry, dict.fromkeys(_ENTRY, ())) for r in ranks}

    def flat(field: str) -> Iterator:
        return chain.from_iterable(cols[field] for _, cols in tables)

    dst, region, offset = (np.fromiter(flat(f), np.int64, n) for f in ("dst_rank", "dst_region", "dst_offset"))
    order = np.lexsort((offset, region, dst))  # (stable: a tie keeps the concatenation's order)
    cuts = np.searchsorted(dst[order], ranks, side="left").tolist() + [n]
    src_rank = np.repeat(np.array([s for s, _ in tables], np.int64), counts)[order]
    index = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])[order]
    out = {}
    for r, a, b in zip(ranks, cuts, cuts[1:]):
        fields = tuple(zip(*_taker(order[a:b].tolist())(pieces))) or ((),) * len(Piece._fields)
        out[r] = Rows(ExpectedEntry, {"src_rank": src_rank[a:b].tolist(), "index": index[a:b].tolist(),
                                      **{entry: fields[at] for entry, at in _ENTRY_FIELDS}})
    return out


def _taker(at: list[int]) -> Callable[[Sequence], tuple]:
    """A C-level take of the positions ``at`` from a sequence, as a tuple."""
    if len(at) > 1:
        return operator.itemgetter(*at)
    return lambda col: tuple(col[i] for i in at)
