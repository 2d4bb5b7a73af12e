"""Routing tables: who writes which bytes where, in what order.

How this works: the controller's planner (``weightsync.engine.plan``) turns manifests into one ``SenderTable``
per sender and one ``ReceiverTable`` per receiver; both travel inside a ``Plan`` message. A sender's
``transfers`` are in the order it should issue them; ``index`` numbers them per sender so that a
receiver's ``ExpectedEntry`` (and a ``WritesDone`` checksum) can name a transfer as (src_rank, index).
Tables are plain data: sorting and deduplication are the planner's job, validation is here.
"""

from __future__ import annotations

from typing import Optional

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
        for i, t in enumerate(self.transfers):
            if t.index != i:
                raise Violation("value", f"transfers[{i}].index", f"index {t.index} at position {i}")
        ranks = {p.rank for p in self.peers}
        for i, t in enumerate(self.transfers):
            if t.dst_rank not in ranks:
                raise Violation("value", f"transfers[{i}].dst_rank", f"no peer info for receiver {t.dst_rank}")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@struct
class ReceiverTable:
    rank: U32
    entries: Columns[ExpectedEntry]

    def _check(self) -> None:
        seen: set[tuple[int, int]] = set()
        for i, e in enumerate(self.entries):
            key = (e.src_rank, e.index)
            if key in seen:
                raise Violation("value", f"entries[{i}]", f"transfer {key} expected twice")
            seen.add(key)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)
