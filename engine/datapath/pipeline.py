"""The per-parameter pipeline: stage -> write -> complete, across many connections at once.

How this works: a sender's routing table is split into one lane per receiver, keeping table order
inside each lane. Rows that need no work on the sender (no transform, gather or checksum; a dense
source the connection reads where it is) are *compiled* once per plan (``weightsync.engine.datapath.compiled``) and each
round *replays* them: one ``Connection.replay`` call issues the whole table in a few host calls per
chunk. The other rows (staged rows) go through the stages below. Each lane runs two stages joined by a bounded ``Channel`` of ``depth`` items: the
stager prepares sources (views or staging copies, optional checksums) and the writer
(``weightsync.engine.datapath.writer``) issues one-sided writes (ordered after the source's transform
event, if any) and waits for their completion, then the lane fences the connection. ``depth`` is the connection's own unless the options name one. A
connection with ``submit_many`` gets the rows staged meanwhile (up to ``batch``) in one call: cuda_ipc
makes them one batch of copies, faster than a call per row (docs/TRANSPORTS.md). A lane's first row
goes to the writer at once (lanes without transforms), not once the channel is full. All lanes share one
``ByteBudget`` for temporary memory: a transfer that needs a staging copy or a transform output holds
its bytes from staging until its write completes; a zero-copy write (a view of the source) holds
none and is bounded by ``depth`` alone, so large direct GPU copies queue deep enough to keep the
copy engines busy. The first failure cancels every lane; staging buffers and
budget are returned on every path (``finally``), and the error propagates to the caller.

Sealing. A lane is *sealed* once its connection guarantees delivery of everything written: after
its ``fence``, or, for a connection with ``seal`` (cuda_ipc), as soon as the last write is *issued*:
``seal`` returns a proof the target waits on (an interprocess CUDA event behind the copies); only a
connection with ``submit`` seals, so that every write is queued in the transport before the seal. When
every lane is sealed, ``on_sealed`` gets the report (counts, bytes and checksums are recorded at
issue): the sender announces ``writes_done`` then, while the last copies are still in flight, so the
control messages of the round overlap the data. ``run`` itself still returns only once every write
has completed (the sender's tensors may be reused from then on).

Written in place. A connection with ``address`` and ``submit_written`` (cuda_ipc) can name its target's
memory; the pipeline lets quantizations write their outputs there (``weightsync.engine.transforms``)
without checksums, or with ``fp64`` ones, which the launch computes from what it writes
(``fp8_kernel``, ``lanes.WrittenPrints``: a lane reports its written rows' fingerprints once the launches are done;
other checksums need the bytes on the sender, which are then staged). In a compiled lane such rows are compiled too
(``CompiledLane.written``): ``run`` launches their quantizations together for all lanes (``TransformSet.write_all``) and each
lane hands its connection one ``submit_written`` per source device (counted, sealed and completed like
that many copies). Elsewhere such a row stages as already ``written`` and the writer hands it over with
its launch's event. Neither charges the budget (they allocate nothing). A lane with no staged rows runs
no stager or writer: it replays, seals and fences. What lanes report, and the calls that issue their
compiled parts, are in ``weightsync.engine.datapath.lanes``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence

from weightsync.wire import Transfer

from ..errors import ConfigError
from ..transport import Connection
from ..aio import ByteBudget, Channel, run_all
from .checksums import validate as validate_checksum
from .compiled import CompiledLane, RoundCompiler
from .deltas import ENCODERS, DeltaRound
from .delta_staging import as_delta, as_deltas, hand_over
from .lanes import (WRITTEN_CHECKSUMS, LaneReport, PushReport, Seals, WrittenPrints, fingerprints,
                    prints, replay, submit_written)
from .staging import SourceSet, Staged, StagingPool
from .writer import Writer

__all__ = ["DEFAULT_DEPTH", "LaneReport", "Pipeline", "PipelineOptions", "PushReport"]

MiB = 1 << 20
PRINT_BYTES = 256 << 20  # bytes of staged rows whose fp64 waits for one pass, at most (copies among them stay held)
DEFAULT_DEPTH = 8  # for a connection that names none (``Connection.depth``): bench/pipeline_depth.py


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    max_inflight_bytes: int = 512 * MiB  # staging copies and transform outputs alive, all connections together
    depth: Optional[int] = None  # writes in flight per connection; None: the transport's own (docs/TRANSPORTS.md)
    checksum: str = ""  # "" (off), "crc32" or "sum64" (engine.datapath.checksums)
    batch: Optional[int] = None  # rows per ``submit_many`` call at most; None: the connection's own (docs/TRANSPORTS.md)
    compiled: bool = True  # replay plain rows from per-plan tables (engine.datapath.compiled); False: stage every row

    def __post_init__(self) -> None:
        if self.max_inflight_bytes <= 0:
            raise ConfigError("max_inflight_bytes", f"must be positive, got {self.max_inflight_bytes}")
        if self.depth is not None and self.depth < 1:
            raise ConfigError("depth", f"must be at least 1, got {self.depth}")
        if self.batch is not None and self.batch < 1:
            raise ConfigError("batch", f"must be at least 1, got {self.batch}")
        validate_checksum(self.checksum)


class Pipeline:
    def __init__(self, sources: SourceSet, options: PipelineOptions = PipelineOptions(),
                 pool: StagingPool | None = None) -> None:
        self.sources = sources
        self.options = options
        self.pool = pool or StagingPool()
        self.budget = ByteBudget(options.max_inflight_bytes)  # replaced per run: a failed run leaks nothing
        self.compiler = RoundCompiler()
        self._written_split: dict = {}  # ids of lanes' written rows -> (those rows, split by device): ``_written``
        self.runs = 0

    def __repr__(self) -> str:
        return f"<Pipeline runs={self.runs} {self.compiler!r} {self.budget!r} {self.pool!r}>"

    async def run(self, transfers: Sequence[Transfer], conns: Mapping[int, Connection], epoch: int,
                  slots: Mapping[int, int] = {},
                  on_sealed: Optional[Callable[[PushReport], None]] = None,
                  deltas: Optional[DeltaRound] = None,
                  mark: Callable[[str], None] = lambda event: None) -> PushReport:
        """Write every transfer, fence every connection used; return what went to whom.

        ``slots``: receiver rank -> landing slot this round (added to each transfer's region id).
        ``on_sealed``: called once, when every lane is sealed (see the module's header); without it
        no connection seals early. ``deltas``: the round's delta lanes, whose rows are all staged and
        go as deltas where they may (``weightsync.engine.datapath.deltas``). ``mark``: told of the
        round's steps as they pass ("pipeline:lanes": the lanes are compiled or found; "pipeline:written":
        the quantizations written in place are launched), for the sender's timeline."""
        delta_lanes = deltas.lanes if deltas is not None else frozenset()
        resolve, token = self._resolver({r: c for r, c in conns.items() if r not in delta_lanes}, slots)
        self.sources.transforms.fingerprint = resolve is not None and bool(self.options.checksum)
        ordered = self.sources.begin(transfers, resolve, token)
        lanes = self.compiler.lanes(transfers, self.sources, conns, slots, self.options.checksum, self.options.compiled,
                                    order=ordered, staged_lanes=delta_lanes, token=token)
        mark("pipeline:lanes")
        reports = {rank: LaneReport() for rank in lanes}
        self.budget = ByteBudget(self.options.max_inflight_bytes)
        start = time.perf_counter()
        seals = Seals(len(lanes), lambda: on_sealed(PushReport(reports, time.perf_counter() - start))
                       if on_sealed is not None else None)
        try:
            launched = await self._write_all(self._written(lanes))
            mark("pipeline:written")
            prints = WrittenPrints(self.sources.transforms.prints, launched)
            await run_all(self._lane(conns[r], lane, lane.staged, reports[r], epoch, slots.get(r, 0),
                                     on_sealed is not None, seals.one, deltas if r in delta_lanes else None,
                                     launched, prints)
                          for r, lane in lanes.items())
        except BaseException:
            self.sources.abort()
            raise
        await self.sources.finish()  # collectives (gathers) run to the end of the list on every rank
        seals.all()  # (no lanes at all: nothing to wait for)
        self.runs += 1
        return PushReport(reports, time.perf_counter() - start)

    def _resolver(self, conns: Mapping[int, Connection], slots: Mapping[int, int]):
        """(row, device) -> the address its bytes go to, for rows that may be written in place; and a
        token that changes when the answers may (landing slots, connections). (None, None): no row may."""
        checksum = self.options.checksum
        if checksum and checksum not in WRITTEN_CHECKSUMS:
            return None, None  # (other checksums need the bytes on the sender: they are staged)
        direct = {rank: conn for rank, conn in conns.items() if conn.abilities.writes_in_place
                  and (not checksum or (conn.abilities.compiles and self.options.compiled))}  # (a verified row
        if not direct:  # written in place is a compiled lane's: its launch's fingerprints are read for it there)
            return None, None

        def resolve(t: Transfer, device) -> Optional[int]:
            conn = direct.get(t.dst_rank)
            if conn is None:
                return None
            return conn.address(t.dst_region + slots.get(t.dst_rank, 0), t.dst_offset, t.nbytes, device)
        return resolve, (tuple(sorted(slots.items())), tuple(sorted((r, id(c), c.generation) for r, c in direct.items())))

    def _written(self, lanes: Mapping[int, CompiledLane]) -> tuple[tuple, tuple]:
        """Every lane's rows written in place, split by their sources' device (CUDA, host): the same two
        objects every round of the same compiled lanes (``TransformSet.write_all`` keeps what it works out
        for a rows object), kept per set of lanes: a shadow receiver's two landing slots alternate theirs."""
        parts = tuple(lane.written for lane in lanes.values() if lane.written)
        key = tuple(map(id, parts))
        kept = self._written_split.get(key)  # (its parts are kept with it, so no other object has those ids)
        if kept is None:
            cuda, host = [], []
            for t in (t for part in parts for t in part):
                (cuda if self.sources.known_view(t).device.type == "cuda" else host).append(t)
            if len(self._written_split) >= 8:  # (a few plans' worth)
                self._written_split.clear()
            kept = self._written_split[key] = (parts, (tuple(cuda), tuple(host)))
        return kept[1]

    async def _write_all(self, rows: tuple[tuple, tuple]) -> dict:
        """Launch the quantizations of every lane's rows written in place (``_written``: CUDA sources,
        host ones), once each (one launch per group, ``TransformSet.write_all``): on the loop for CUDA
        sources (launches return at once), in a worker thread for CPU ones. -> per source device, the
        event after its last launch."""
        cuda, host = rows
        if not cuda and not host:
            return {}
        transforms = self.sources.transforms
        launched = transforms.write_all(cuda) if cuda else {}
        if host:
            launched.update(await asyncio.to_thread(transforms.write_all, host))
        return launched

    async def _lane(self, conn: Connection, lane: CompiledLane, transfers: list[Transfer], report: LaneReport,
                    epoch: int, slot: int, seal_early: bool, sealed: Callable[[], None],
                    deltas: Optional[DeltaRound] = None, launched: Mapping = {},
                    prints: Optional[WrittenPrints] = None) -> None:
        """Replay the lane's compiled table (its direct rows), hand over the rows written in place
        (``launched``: their launches' events; ``prints``: their fingerprints), stage and write the rest, fence."""
        depth = self.options.depth or conn.abilities.depth or DEFAULT_DEPTH
        channel: Channel = Channel(depth)
        # (only a connection with submit seals: its writes are queued in the transport before the seal)
        seal = conn.seal if seal_early and conn.abilities.seals and conn.abilities.submits else None
        t0 = time.perf_counter()
        replayed = replay(conn, lane, report, epoch) + submit_written(conn, lane, report, epoch, launched)
        try:
            if lane.rows and self.options.checksum:  # (fp64 only: ``compiled.direct_view``)
                report.add_checksums(*await fingerprints(lane))
            if lane.written and self.options.checksum and prints is not None:  # (fp64: ``_resolver``)
                values = await prints.values()
                report.add_checksums([t.index for t in lane.written], [values[t.index] for t in lane.written])
            if transfers:
                readable = conn.abilities.devices
                await run_all([self._stager(transfers, channel, report, readable, deltas),
                               self._writer(conn, channel, report, epoch, slot, depth, seal, sealed)])
            elif seal is not None and report.count and (proof := seal()):  # every write issued already
                report.proof = proof  # (what the writer does once its last row is issued)
                sealed()
            if replayed:
                await asyncio.gather(*replayed)
                report.write_s += time.perf_counter() - t0
        finally:
            for t, staged in channel.drain_nowait():  # staged but never written: give everything back
                self._give_back(t, staged)
            if replayed:  # (failed, or cancelled elsewhere: stop the rest, and collect every outcome)
                for op in replayed:
                    op.cancel()
                await asyncio.gather(*replayed, return_exceptions=True)
        await conn.fence()
        if not report.proof:
            sealed()

    async def _stager(self, transfers: list[Transfer], channel: Channel, report: LaneReport,
                      readable: frozenset, deltas: Optional[DeltaRound] = None) -> None:
        algo = self.options.checksum
        # (not in lanes with transforms: their launches must keep ahead of the writes, docs/TRANSFORMS.md)
        prompt = transfers[0] if transfers and not any(t.transform for t in transfers) else None
        encoding: collections.deque = collections.deque()  # ([(t, staged, budget)], their encode), lane order
        gathering: list = []  # rows of a delta lane for the next batch: (t, staged, budget)
        gathered = 0  # their bytes
        unprinted: list = []  # (table index, bytes) whose checksum is taken in one pass (``staging.LATER``)
        unprinted_bytes = 0

        async def print_unprinted() -> None:  # (before the channel closes: the writer seals after that)
            nonlocal unprinted, unprinted_bytes
            if unprinted:
                rows, unprinted, unprinted_bytes = unprinted, [], 0
                report.add_checksums(*await prints(rows))

        async def encode_gathered(limit: int) -> None:  # the rows gathered so far go as one batch; at most
            nonlocal gathering, gathered  # ``limit`` encodes left running
            if gathering:
                encoding.append((gathering, asyncio.ensure_future(as_deltas(deltas, gathering, report))))
                gathering, gathered = [], 0
            while len(encoding) > limit:
                await hand_over(encoding, channel)

        try:
            for t in transfers:
                await self.sources.ready(t)  # before taking budget: a lane waiting on a gather holds none
                view = self.sources.view(t)
                moved = self.sources.moved_bytes(t, view)  # a CPU source copied to the GPU to be quantized
                charge = t.nbytes if self.sources.makes_copy(t, view, readable) else 0  # freed once written
                upfront = self.sources.upfront_bytes(t, charge) + moved  # taken now (a group: all of it)
                charge += moved
                if upfront and (gathering or encoding) and not self.budget.fits_now(upfront):
                    await encode_gathered(0)  # (rows held for their encode would wait: written, they free theirs)
                if upfront:
                    await self.budget.acquire(upfront)
                handed_over = False
                try:
                    t0 = time.perf_counter()
                    staged = await self.sources.stage(t, self.pool, algo, readable, view)
                    staged.charge = charge
                    if staged.unprinted is not None:
                        unprinted.append((t.index, staged.unprinted))
                        unprinted_bytes += t.nbytes
                        staged.unprinted = None
                        if unprinted_bytes >= PRINT_BYTES:
                            await print_unprinted()
                    if deltas is not None and (batch := deltas.batches(staged.tensor)):  # encoded in batches
                        gathering.append((t, staged, upfront))
                        gathered += t.nbytes
                        handed_over = True  # (``gathering`` holds it now)
                        report.stage_s += time.perf_counter() - t0
                        if gathered >= batch:
                            await encode_gathered(ENCODERS - 1)
                        continue
                    if deltas is not None and deltas.off_loop(staged.tensor):  # on worker threads, ENCODERS
                        await encode_gathered(ENCODERS)  # at a time (lane order: a batch gathered goes first)
                        encode = asyncio.ensure_future(as_delta(deltas, t, staged, report, t0))
                        encoding.append(([(t, staged, upfront)], encode))
                        handed_over = True  # (``encoding`` holds it now)
                        await encode_gathered(ENCODERS - 1)
                        continue
                    if deltas is not None:
                        await as_delta(deltas, t, staged, report)
                    report.stage_s += time.perf_counter() - t0
                    await encode_gathered(0)  # (lane order)
                    await channel.send((t, staged))  # (no yield per row: measured slower, docs/TRANSFORMS.md)
                    handed_over = True
                    if t is prompt:  # the lane's first row: the writer issues it now, not once the channel
                        await asyncio.sleep(0)  # is full (docs/TRANSPORTS.md, "Batches of copies")
                finally:
                    if not handed_over:
                        self.budget.release(upfront)
                        self.sources.release(t)
            await encode_gathered(0)
            await print_unprinted()
            channel.close()
        except BaseException as exc:
            for _, encode in encoding:  # (a thread still encoding finishes: ``Bases.settle`` waits)
                encode.cancel()
            for t, _, upfront in gathering + [row for rows, _ in encoding for row in rows]:
                self.budget.release(upfront)
                self.sources.release(t)
            channel.fail(exc)
            raise

    async def _writer(self, conn: Connection, channel: Channel, report: LaneReport, epoch: int,
                      slot: int, depth: int, seal: Optional[Callable[[], Optional[bytes]]],
                      sealed: Callable[[], None]) -> None:
        batch = (self.options.batch or conn.abilities.batch) if conn.abilities.submits and conn.abilities.batch > 1 else 1
        await Writer(conn, report, epoch, slot, self._give_back).run(channel, depth, batch, seal, sealed)

    def _give_back(self, t: Transfer, staged: Staged) -> None:
        """``t`` is written or dropped: its budget, its source (a gathered one may go) and its buffer."""
        self.budget.release(staged.charge)
        self.sources.release(t)
        if staged.pooled:
            self.pool.give(staged.buffer)
