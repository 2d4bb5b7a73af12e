"""What a lane of the pipeline reports, and the calls that issue the compiled parts of a lane.

How this works: ``LaneReport`` counts what one connection's lane wrote (rows, bytes, checksums, deltas,
the delivery proof) as writes are issued; ``PushReport`` is a round's lanes, whose ``summaries`` go out
in ``writes_done``. ``replay`` issues a lane's compiled table, ``submit_written`` hands a connection the
rows that quantizations wrote in place (one call per source device), ``fingerprints`` reads the
``fp64`` of compiled rows from their sources (one pass; the round's checks), ``issued`` counts a staged
row, ``Seals`` counts lanes down to the moment every one is sealed
(``weightsync.engine.datapath.pipeline``), and ``WrittenPrints`` reads, once for all lanes, the ``fp64``
that a round's quantizations written in place computed of what they wrote.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import torch

from weightsync.wire import Transfer
from weightsync.wire.columns import Rows
from weightsync.wire.messages import Checksum, DeltaRow, WriteSummary

from ..transport import Connection
from .checksums import ManyPrints
from .compiled import CompiledLane
from .staging import Staged


@dataclasses.dataclass
class LaneReport:
    count: int = 0
    nbytes: int = 0
    checked: list = dataclasses.field(default_factory=list)  # the checksummed rows' table indices, in order
    sums: list = dataclasses.field(default_factory=list)  # and their checksums
    stage_s: float = 0.0
    write_s: float = 0.0
    encode_s: float = 0.0  # of the staging, encoding delta rows (``datapath.deltas``; threads summed)
    issue_s: float = 0.0  # host seconds queueing the staged rows' writes (``Pipeline._issue``)
    proof: bytes = b""  # the connection's delivery proof, when it sealed before its writes completed
    deltas: list = dataclasses.field(default_factory=list)  # DeltaRow of each row that went as a delta

    def add_checksums(self, indices: Sequence[int], values: Sequence[int]) -> None:
        self.checked.extend(indices)
        self.sums.extend(values)

    @property
    def checksums(self) -> Rows:
        """Every row's checksum as ``WriteSummary`` carries them: columns, no object per row (a lane of
        4,720 rows spent 2 ms making them and 2.5 ms encoding them one by one)."""
        return Rows(Checksum, {"index": self.checked, "value": self.sums})


@dataclasses.dataclass
class PushReport:
    lanes: dict[int, LaneReport]
    seconds: float

    def summaries(self) -> tuple[WriteSummary, ...]:
        return tuple(
            WriteSummary(rank, lane.count, lane.nbytes, lane.checksums, lane.proof, tuple(lane.deltas))
            for rank, lane in sorted(self.lanes.items())
        )

    def total(self, field: str):
        """``field`` of every lane's report, summed."""
        return sum(getattr(lane, field) for lane in self.lanes.values())

    nbytes = property(lambda self: self.total("nbytes"))
    stage_s = property(lambda self: self.total("stage_s"))
    write_s = property(lambda self: self.total("write_s"))
    encode_s = property(lambda self: self.total("encode_s"))  # (of the staging, encoding delta rows)
    issue_s = property(lambda self: self.total("issue_s"))


def replay(conn: Connection, lane: CompiledLane, report: LaneReport, epoch: int) -> list[asyncio.Future]:
    """Issue the lane's compiled table on ``conn`` (one or a few host calls); its completions."""
    if lane.table is None:
        return []
    ops = list(conn.replay(lane.table, epoch))
    report.count += len(lane.rows)
    report.nbytes += lane.nbytes
    return ops


async def fingerprints(lane: CompiledLane) -> tuple[Sequence[int], list[int]]:
    """The ``fp64`` of a compiled lane's direct rows' sources, all in one pass: (their table indices, their
    fingerprints). The same rows every checked round of the lane, so their ``ManyPrints`` is worked out
    once and kept with it."""
    if lane.prints is None:
        lane.prints = ([r.index for r in lane.rows], ManyPrints([r.src for r in lane.rows]))
    indices, many = lane.prints
    return indices, await many.values_async()


async def prints(rows: Sequence[tuple[int, torch.Tensor]]) -> tuple[list[int], list[int]]:
    """The ``fp64`` of each (table index, bytes), all in one pass (the loop polls for it), computed on each
    device's current stream as the loop sees it (the producer's: the weights are final there; staged
    copies are complete before they are listed): (the indices, the fingerprints)."""
    values = await ManyPrints([v for _, v in rows]).values_async()
    return [index for index, _ in rows], values


def submit_written(conn: Connection, lane: CompiledLane, report: LaneReport, epoch: int,
                    launched: Mapping) -> list[asyncio.Future]:
    """Hand ``conn`` the lane's rows written in place, one call per source device (ordered after that
    device's last quantization launch); their completions."""
    ops = []
    for device, count, nbytes, region, offset in lane.written_totals:
        ops.append(conn.submit_written(device, region, offset, nbytes, epoch, launched.get(device), count=count))
        report.count += count
        report.nbytes += nbytes
    return ops


def issued(report: LaneReport, t: Transfer, staged: Staged) -> None:
    """What the lane reports is counted as writes are issued (a failed write fails the whole run)."""
    report.count += 1
    if staged.target is not None:
        report.nbytes += staged.tensor.numel()
        report.deltas.append(DeltaRow(t.index, staged.tensor.numel(), *staged.delta))
    else:
        report.nbytes += t.nbytes
    if staged.checksum is not None:
        report.add_checksums((t.index,), (staged.checksum,))


class Seals:
    """Counts lanes down to sealed; calls ``done`` once, when the last one is."""

    def __init__(self, lanes: int, done: Callable[[], None]) -> None:
        self.left = lanes
        self.done: Optional[Callable[[], None]] = done

    def one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.all()

    def all(self) -> None:
        done, self.done = self.done, None
        if done is not None:
            done()


WRITTEN_CHECKSUMS = ("fp64",)  # checksums the launches writing in place compute themselves (``fp8_kernel``)


class WrittenPrints:
    """The fingerprints of a round's rows written in place, read once for every lane: per device the
    launches' last event is awaited (polled: ``cuda_rt.wait_event``), then every launch's ``fp8.Prints``
    is read -> table index -> ``fp64``."""

    def __init__(self, launches: list, launched: Mapping) -> None:
        self.launches, self.launched = launches, launched
        self._task: Optional[asyncio.Future] = None

    def values(self) -> asyncio.Future:
        if self._task is None:
            self._task = asyncio.ensure_future(self._read())
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (a failed round's lanes
        return asyncio.shield(self._task)  #                                      may not all be there to see it)

    async def _read(self) -> dict[int, int]:
        from .checksums import fp64

        for event in self.launched.values():
            if event is not None:
                from ..cuda import cuda_rt

                await cuda_rt.wait_event(event)
        out: dict[int, int] = {}
        for prints, pairs in self.launches:
            for (weight, scales), (w, s) in zip(pairs, prints.values(fp64)):
                out[weight], out[scales] = w, s
        return out
