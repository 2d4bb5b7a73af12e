"""Compiled rounds: a plan's static routing table turned, once, into per-connection copy tables.

How this works. A round writes the same rows every time (the routing table is static for a plan), so
the per-row host work (slicing a source view, checking bounds, turning it into bytes or pointers)
belongs to the plan, not to the round. ``compile_round`` (pure, synchronous) splits each receiver's
lane into *direct* rows (no transform, no gather, no checksum, a dense source on memory the
connection reads without staging: ``Connection.direct_devices``) and *staged* rows (everything else,
which keep the stage -> write pipeline of ``engine.pipeline``). The direct rows of a lane, with their
landing slot applied, become ``CopyRow`` s that the connection compiles into its own replayable form
(``Connection.compile``: pointer arrays and a copy kernel for cuda_ipc, frame headers and memoryviews
for TCP), checking bounds there: a row that does not fit its target raises ``StagingError`` naming
the parameter. A round then calls ``Connection.replay(table, epoch)``: a few host calls per chunk of
rows, whatever the tensor count.

``RoundCompiler`` caches compiled rounds by what they depend on: the table object (a plan's
``transfers`` tuple, the same every round), each lane's landing slot (a shadow receiver alternates
two), the checksum setting, and each connection (the object, and its ``generation``, which it bumps
when what it knows of the target's registrations changes). A new plan, new connections, a new slot or
a changed registration compile again; anything else replays.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch

from wire import Transfer

from .errors import StagingError
from .staging import SourceSet


@dataclasses.dataclass(frozen=True)
class CopyRow:
    """One direct row: ``nbytes`` of ``src`` (dense) to ``offset`` of the target's ``region`` (slot applied)."""

    name: str
    src: torch.Tensor
    region: int
    offset: int
    nbytes: int


@dataclasses.dataclass
class CompiledLane:
    """One receiver's part of a round: a compiled table of its direct rows, and the rows to stage."""

    rows: tuple[CopyRow, ...]
    table: object  # what the connection's ``compile`` made of ``rows`` (None: no direct rows)
    staged: Optional[list[Transfer]]  # None: recomputed each round (the order of gathered rows changes)
    staged_ids: frozenset = frozenset()  # id() of the direct rows, to filter a round's order by
    nbytes: int = 0  # of the direct rows

    def staged_rows(self, ordered: Sequence[Transfer], rank: int) -> list[Transfer]:
        if self.staged is not None:
            return self.staged
        return [t for t in ordered if t.dst_rank == rank and id(t) not in self.staged_ids]


def direct_view(t: Transfer, sources: SourceSet, devices: frozenset, checksum: str) -> Optional[torch.Tensor]:
    """``t``'s source view when the row can be replayed from a compiled table, else None."""
    if checksum or t.transform or not devices or sources.gathered(t):
        return None
    view = sources._known_view(t)
    if view is None or not view.is_contiguous() or view.device.type not in devices:
        return None
    if view.numel() * view.element_size() != t.nbytes:
        raise StagingError(t.name, f"source gives {view.numel() * view.element_size()} bytes, the table says {t.nbytes}")
    return view


def compile_lane(transfers: Sequence[Transfer], sources: SourceSet, conn, slot: int, checksum: str,
                 stable: bool) -> CompiledLane:
    """One lane's rows (table order) -> a ``CompiledLane`` for ``conn``; ``stable``: the staging order
    is the table's every round (no gathers), so the staged rows are kept too."""
    devices = getattr(conn, "direct_devices", frozenset()) if hasattr(conn, "compile") else frozenset()
    rows, ids, staged = [], set(), []
    for t in transfers:
        view = direct_view(t, sources, devices, checksum)
        if view is None:
            staged.append(t)
            continue
        rows.append(CopyRow(t.name, view, t.dst_region + slot, t.dst_offset, t.nbytes))
        ids.add(id(t))
    table = conn.compile(rows) if rows else None
    return CompiledLane(tuple(rows), table, staged if stable else None, frozenset(ids), sum(r.nbytes for r in rows))


class RoundCompiler:
    """Compiled lanes of the last round's shape, rebuilt when what they depend on changes."""

    def __init__(self) -> None:
        self.compiles = 0  # how many times a round was compiled (a replay does not count)
        self._key: object = None
        self._table: object = None  # the transfers the cached lanes come from (kept: the key holds its id)
        self._lanes: dict[int, CompiledLane] = {}

    def __repr__(self) -> str:
        return f"<RoundCompiler compiles={self.compiles} lanes={len(self._lanes)}>"

    def lanes(self, transfers: Sequence[Transfer], sources: SourceSet, conns: Mapping[int, object],
              slots: Mapping[int, int], checksum: str) -> dict[int, CompiledLane]:
        """Receiver rank -> its compiled lane, for every receiver ``transfers`` names."""
        key = (id(transfers), checksum, tuple(sorted(slots.items())),
               tuple((r, id(c), getattr(c, "generation", 0)) for r, c in sorted(conns.items())))
        if key == self._key and transfers is self._table and isinstance(transfers, tuple):
            return self._lanes
        by_rank: dict[int, list[Transfer]] = {}
        for t in transfers:
            by_rank.setdefault(t.dst_rank, []).append(t)
        stable = sources.gatherer is None
        lanes = {rank: compile_lane(rows, sources, conns[rank], slots.get(rank, 0), checksum, stable)
                 for rank, rows in sorted(by_rank.items())}
        self.compiles += 1
        self._key, self._table, self._lanes = key, transfers, lanes
        return lanes

    def forget(self) -> None:
        self._key, self._table, self._lanes = None, None, {}

