"""Compiled rounds: a plan's static routing table turned, once, into per-connection copy tables.

How this works. A round writes the same rows every time (the routing table is static for a plan), so
the per-row host work (slicing a source view, checking bounds, turning it into bytes or pointers)
belongs to the plan, not to the round. ``compile_round`` (pure, synchronous) splits each receiver's
lane into *direct* rows (no transform, no gather, no checksum, a dense source on memory the
connection reads without staging: ``Abilities.direct_devices``; or a pitched one, dense rows at a
stride, where the connection copies those as they lie: ``Abilities.pitched_rows``) and *staged* rows (everything else,
which keep the stage -> write pipeline of ``weightsync.engine.datapath.pipeline``). The direct rows of a lane, with their
landing slot applied, become ``CopyRow`` s that the connection compiles into its own replayable form
(``Connection.compile``: pointer arrays and a copy kernel for cuda_ipc, frame headers and memoryviews
for TCP), checking bounds there: a row that does not fit its target raises ``StagingError`` naming
the parameter. A round then calls ``Connection.replay(table, epoch)``: a few host calls per chunk of
rows, whatever the tensor count. A round that checks ``fp64`` fingerprints keeps its direct rows
compiled: their fingerprints are read from the sources, all of a lane's in one pass
(``checksums.fp64_many``: one launch on a GPU); other checksums stage every row.

Rows written in place (a block-FP8 quantization that stores straight into the receiver's memory:
``TransformSet.writes_directly``) are compiled too: a lane keeps them apart (``written``) with their
totals per source device, and a round launches their quantizations together for all lanes
(``TransformSet.write_all``) and hands each connection one ``submit_written`` per device for the
lot, instead of staging and submitting them row by row.

``RoundCompiler`` caches compiled rounds by what they depend on: the table object (a plan's
``transfers`` tuple, the same every round), each lane's landing slot (a shadow receiver alternates
two), the checksum setting (none and ``fp64`` compile the same lanes: a full check every 8th round
replays the tables of the rounds between), and each connection (the object, and its ``generation``, which it bumps
when what it knows of the target's registrations changes). A new plan, new connections, a new slot or
a changed registration compile again; anything else replays.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch

from weightsync.wire import Transfer

from ..errors import ConfigError, StagingError
from .staging import SourceSet


FINGERPRINTED = ("fp64",)  # checksums of direct rows computed from their sources in one pass (``fp64_many``)


@dataclasses.dataclass(frozen=True)
class CopyRow:
    """One direct row: ``nbytes`` of ``src`` to ``offset`` of the target's ``region`` (slot applied). A
    dense source has ``pitch`` 0; a pitched one (a block: some columns of a rank's own rows) is ``height``
    rows of ``nbytes // height`` bytes each, ``pitch`` bytes apart, landing back to back."""

    name: str
    src: torch.Tensor
    region: int
    offset: int
    nbytes: int
    height: int = 1
    pitch: int = 0
    index: int = -1  # the routing-table row's (its checksum is reported under it)


def pitch_of(view: torch.Tensor) -> Optional[tuple[int, int]]:
    """(rows, bytes from one row to the next) of a view whose dim-0 rows are each dense but not adjacent
    (``narrow`` of a later dim of a contiguous tensor); None for any other layout."""
    if view.dim() < 2 or view.shape[0] < 2 or not view[0].is_contiguous():
        return None
    row_bytes = view[0].numel() * view.element_size()
    pitch = view.stride(0) * view.element_size()
    return (view.shape[0], pitch) if pitch > row_bytes else None


@dataclasses.dataclass
class CompiledLane:
    """One receiver's part of a round: a compiled table of its direct rows, and the rows to stage."""

    rows: tuple[CopyRow, ...]
    table: object  # what the connection's ``compile`` made of ``rows`` (None: no direct rows)
    staged: list[Transfer]  # the rest, in staging order
    nbytes: int = 0  # of the direct rows
    written: tuple[Transfer, ...] = ()  # rows a quantization writes into the receiver (staging order)
    written_totals: tuple[tuple[torch.device, int, int, int, int], ...] = ()  # per source device of ``written``:
    # (device, rows, bytes, region, offset of its first row: what ``submit_written`` is handed)
    prints: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)  # its rows' table
    # indices and ``checksums.ManyPrints``, made by the first checked round (``lanes.fingerprints``)


def direct_view(t: Transfer, sources: SourceSet, devices: frozenset, checksum: str,
                pitched: bool = False) -> Optional[tuple[torch.Tensor, int, int]]:
    """``t``'s source view with its (height, pitch) when the row can be replayed from a compiled table,
    else None; ``pitched``: the connection also copies pitched rows (``pitch_of``) as they lie."""
    if (checksum and checksum not in FINGERPRINTED) or t.transform or not devices or sources.gathered(t):
        return None
    view = sources.known_view(t)
    if view is None or view.device.type not in devices:
        return None
    shape = (1, 0) if view.is_contiguous() else pitch_of(view) if pitched else None
    if shape is None:
        return None
    if view.numel() * view.element_size() != t.nbytes:
        raise StagingError(t.name, f"source gives {view.numel() * view.element_size()} bytes, the table says {t.nbytes}")
    return view, *shape


def compile_lane(transfers: Sequence[Transfer], sources: SourceSet, conn, slot: int, checksum: str,
                 enabled: bool = True) -> CompiledLane:
    """One lane's rows (in staging order) -> a ``CompiledLane`` for ``conn``; ``enabled`` False: every
    row is staged (``PipelineOptions.compiled``)."""
    abilities = conn.abilities
    compiles = enabled and abilities.compiles
    devices = abilities.direct_devices if compiles else frozenset()
    pitched = abilities.pitched_rows
    rows, staged, written = [], [], []
    totals: dict[torch.device, list[int]] = {}
    for t in transfers:
        direct = direct_view(t, sources, devices, checksum, pitched)
        if direct is None:
            if compiles and t.transform and sources.transforms.writes_directly(t):
                written.append(t)
                total = totals.setdefault(sources.known_view(t).device, [0, 0, t.dst_region + slot, t.dst_offset])
                total[0] += 1
                total[1] += t.nbytes
            else:
                staged.append(t)
            continue
        view, height, pitch = direct
        rows.append(CopyRow(t.name, view, t.dst_region + slot, t.dst_offset, t.nbytes, height, pitch, t.index))
    table = conn.compile(rows) if rows else None
    return CompiledLane(tuple(rows), table, staged, sum(r.nbytes for r in rows), tuple(written),
                        tuple((device, *total) for device, total in totals.items()))


class RoundCompiler:
    """Compiled lanes by (receiver, landing slot, checksum, connection and its generation), for the
    current table (``fp64`` rounds share the unchecked rounds' lanes); a new table forgets them all."""

    def __init__(self) -> None:
        self.compiles = 0  # lanes compiled so far (a replay does not count)
        self.written = 0  # rows of those lanes written in place (``CompiledLane.written``)
        self._table: object = None  # the transfers the cached lanes come from
        self._by_rank: dict[int, list[Transfer]] = {}
        self._cache: dict[tuple, tuple[object, CompiledLane]] = {}  # key -> (its connection, lane)

    def __repr__(self) -> str:
        return f"<RoundCompiler compiles={self.compiles} written={self.written} cached={len(self._cache)}>"

    def lanes(self, transfers: Sequence[Transfer], sources: SourceSet, conns: Mapping[int, object],
              slots: Mapping[int, int], checksum: str, enabled: bool = True,
              order: Optional[Sequence[Transfer]] = None, staged_lanes: frozenset = frozenset(),
              token: object = None) -> dict[int, CompiledLane]:
        """Receiver rank -> its compiled lane, for every receiver ``transfers`` names. ``order``: the
        same rows in staging order (``SourceSet.begin``: fixed for a table), if not the table's.
        ``staged_lanes``: receivers whose rows are all staged this round (delta lanes). ``token``: what
        decides which rows are written in place (``SourceSet.begin``'s: every lane's slot and connection)."""
        if transfers is not self._table or not isinstance(transfers, tuple):
            self._cache.clear()
            self._by_rank = {}
            for t in (transfers if order is None else order):
                self._by_rank.setdefault(t.dst_rank, []).append(t)
            self._table = transfers if isinstance(transfers, tuple) else None  # (a list may change: never cached)
        compiles_as = "" if checksum in FINGERPRINTED else checksum  # (fingerprinted rows compile as unchecked ones)
        missing = sorted(set(self._by_rank) - set(conns))
        if missing:
            raise ConfigError("connections", f"no connection to receivers {missing}")
        out, used = {}, set()
        for rank, rows in sorted(self._by_rank.items()):
            conn, slot = conns[rank], slots.get(rank, 0)
            compiled = enabled and rank not in staged_lanes
            key = (rank, slot, compiles_as, compiled, conn.generation, token)
            used.add(key)
            entry = self._cache.get(key)
            if entry is None or entry[0] is not conn:  # (the object itself: a closed one's id may be reused)
                entry = self._cache[key] = (conn, compile_lane(rows, sources, conn, slot, compiles_as, compiled))
                self.compiles += 1
                self.written += len(entry[1].written)
            out[rank] = entry[1]
        if len(self._cache) > 4 * len(out):  # connections replaced since: drop their tables
            current = {id(c) for c in conns.values()}
            self._cache = {k: e for k, e in self._cache.items() if id(e[0]) in current}
        if len(self._cache) > 8 * len(out):  # (many tokens: lanes in and out of delta mode) keep this round's
            self._cache = {k: e for k, e in self._cache.items() if k in used}
        return out
