"""Routing tables: who writes which bytes where, in what order.

How this works: the controller's planner (``weightsync.engine.plan``) turns manifests into one ``SenderTable``
per sender and one ``ReceiverTable`` per receiver; both travel inside a ``Plan`` message. A sender's
``transfers`` are in the order it should issue them; ``index`` numbers them per sender so that a
receiver's ``ExpectedEntry`` (and a ``WritesDone`` checksum) can name a transfer as (src_rank, index).
Tables are plain data: sorting and deduplication are the planner's job, validation is here. Rows
travel as columns (``wire.columns``); the planner keeps them so (``Rows``) from the start.
"""

from __future__ import annotations

from typing import Optional

from .columns import column
from .manifest import RegionInfo, Slice, TransportInfo
from .schema import U32, U64, Columns, Violation, struct


@struct
class Transfer:
    """One write: ``slice`` of source parameter ``name`` -> receiver ``dst_rank``'s ``dst_name``."""

    index: U32
    name: str
    slice: Optional[Slice]
    dst_rank: U32
    dst_name: str
    dst_region: U32
    dst_offset: U64
    nbytes: U64
    transform: str


@struct
class ExpectedEntry:
    """What a receiver gets: transfer ``index`` of sender ``src_rank`` lands in ``name``."""

    name: str
    src_rank: U32
    index: U32
    slice: Optional[Slice]
    region: U32
    offset: U64
    nbytes: U64
    transform: str


@struct
class PeerInfo:
    """A receiver as its senders see it: how to connect, and its registered regions."""

    rank: U32
    transport: TransportInfo
    regions: tuple[RegionInfo, ...]


@struct
class SenderTable:
    rank: U32
    transfers: Columns[Transfer]
    peers: tuple[PeerInfo, ...]

    def _check(self) -> None:
        index = column(self.transfers, "index")
        if tuple(index) != tuple(range(len(index))):
            i = next(i for i, x in enumerate(index) if x != i)
            raise Violation("value", f"transfers[{i}].index", f"index {index[i]} at position {i}")
        ranks = {p.rank for p in self.peers}
        dst = column(self.transfers, "dst_rank")
        if not ranks.issuperset(dst):
            i = next(i for i, r in enumerate(dst) if r not in ranks)
            raise Violation("value", f"transfers[{i}].dst_rank", f"no peer info for receiver {dst[i]}")

    @property
    def nbytes(self) -> int:
        return sum(column(self.transfers, "nbytes"))


@struct
class ReceiverTable:
    rank: U32
    entries: Columns[ExpectedEntry]

    def _check(self) -> None:
        keys = list(zip(column(self.entries, "src_rank"), column(self.entries, "index")))
        if len(set(keys)) != len(keys):
            seen: set[tuple[int, int]] = set()
            for i, key in enumerate(keys):
                if key in seen:
                    raise Violation("value", f"entries[{i}]", f"transfer {key} expected twice")
                seen.add(key)

    @property
    def nbytes(self) -> int:
        return sum(column(self.entries, "nbytes"))
