"""A delta lane's rows between the pipeline's stager and its writer (``engine.datapath.pipeline``).

How this works: each staged row of a delta lane becomes its delta where it may go as one
(``DeltaRound.stage``), else goes whole. Rows the batched kernels take are gathered into batches and
encoded together (``as_deltas``): CPU rows a few MiB a batch, in one compiled call on a worker thread
(it lets go of the GIL), the loop writing the rows before them meanwhile; GPU rows on the loop's
thread (a few launches and one wait per batch), each delta's write ordered after an event behind the
launches. Other rows go one by one (``as_delta``; large CPU ones on worker threads). The stager keeps what
is being encoded in a deque, in lane order; ``hand_over`` gives the oldest entry's rows to the writer
once encoded.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Optional

from weightsync.wire import Transfer

from ..aio import Channel
from .deltas import DELTA_REGION, DeltaRound
from .lanes import LaneReport
from .staging import Staged


async def as_delta(deltas: DeltaRound, t: Transfer, staged: Staged, report: LaneReport, t0: Optional[float] = None) -> None:
    """A row of a delta lane: its staged bytes become its delta where it may go as one; the encoding's
    seconds count into ``report.encode_s``. Large CPU rows (``off_loop``) are encoded on a worker
    thread, the event loop writing other rows meanwhile; their time from ``t0`` also counts into
    ``report.stage_s`` (the stager does not wait for them)."""
    await staged.wait()
    start = time.perf_counter()
    if deltas.off_loop(staged.tensor):
        out = await asyncio.to_thread(deltas.stage, t, staged.tensor)
    else:
        out = deltas.stage(t, staged.tensor)
    end = time.perf_counter()
    report.encode_s += end - start
    if t0 is not None:
        report.stage_s += end - t0
    _as_sent(staged, out)


async def as_deltas(deltas: DeltaRound, rows: list, report: LaneReport) -> None:
    """A batch of a delta lane's rows (``(t, staged, budget)``), encoded together
    (``DeltaRound.stage_many``). CPU rows: one compiled call on a worker thread (it lets go of the GIL;
    the loop writes meanwhile). GPU rows: on the loop's thread (a few launches and one wait, for the
    sizes; a worker thread would wait milliseconds for the GIL each time it needs it back from a polling
    loop), each delta's write waiting for an event behind the launches."""
    for _, staged, _ in rows:
        await staged.wait()
    start = time.perf_counter()
    pairs = [(t, staged.tensor) for t, staged, _ in rows]
    device = rows[0][1].tensor.device
    done = None
    if device.type == "cpu":
        outs = await asyncio.to_thread(deltas.stage_many, pairs)
    else:
        outs = deltas.stage_many(pairs, wait=False)
        if device.type == "cuda":
            from ..cuda import cuda_rt

            done = cuda_rt.recorded(device)
    took = time.perf_counter() - start
    report.encode_s += took
    report.stage_s += took  # (the stager did not wait for it: a row's encoding is part of its staging)
    for (_, staged, _), out in zip(rows, outs):
        _as_sent(staged, out)
        if out is not None:
            staged.event = done


def _as_sent(staged: Staged, out: Optional[tuple]) -> None:
    """A staged row goes as the delta ``DeltaRound.stage`` made of it (None: whole, as staged)."""
    if out is not None:
        staged.tensor, offset, change, changes = out
        staged.target, staged.delta = (DELTA_REGION, offset), (change, changes)


async def hand_over(encoding: collections.deque, channel: Channel) -> None:
    """The oldest rows being encoded, once they are, to the writer (each leaves its list as it is sent:
    on a failure, the stager's cleanup gives back the budget of those still in it)."""
    rows, encode = encoding[0]
    await encode
    while rows:
        await channel.send(rows[0][:2])
        rows.pop(0)
    encoding.popleft()
