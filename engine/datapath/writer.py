"""A lane's writer: the staged rows handed over by its stager, issued as one-sided writes and completed.

How this works: ``Writer.run`` takes the rows from the lane's ``Channel`` in order and queues them on
the connection with up to ``depth`` in flight, completing them oldest first. A connection with
``submit`` (queue now, a future for the completion) is driven without a task per write; one with
``submit_many`` gets the rows staged meanwhile (up to ``batch``) in one call; rows written in place go
through ``submit_written`` with their launch's event. Each row is counted in the lane's report as it is
issued (``lanes.issued``) and given back (``give_back``: budget, source, buffer) the moment its write
completes or is cancelled. With ``seal``, the lane is sealed once its last write is issued
(``engine.datapath.pipeline``'s header says why).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Callable, Optional, Sequence

from weightsync.wire import Transfer

from ..aio import Channel
from ..transport import Connection
from .lanes import LaneReport, issued
from .staging import Staged

_Inflight = collections.deque  # of (completion future, row, staged, issue time), oldest first


class Writer:
    """One lane's writes on ``conn`` for round ``epoch`` into landing ``slot``."""

    def __init__(self, conn: Connection, report: LaneReport, epoch: int, slot: int,
                 give_back: Callable[[Transfer, Staged], None]) -> None:
        self.conn, self.report, self.epoch, self.slot, self.give_back = conn, report, epoch, slot, give_back

    async def run(self, channel: Channel, depth: int, batch: int, seal: Optional[Callable[[], Optional[bytes]]],
                  sealed: Callable[[], None]) -> None:
        """Issue writes in lane order with up to ``depth`` in flight; complete them oldest first."""
        inflight: _Inflight = collections.deque()
        try:
            async for item in channel:
                items = [item]
                while len(items) < batch and (more := channel.receive_nowait()) is not None:
                    items.append(more)
                self._issue(items, inflight)
                while len(inflight) >= depth:
                    await self._complete(*inflight.popleft())
            proof = seal() if seal is not None and self.report.count else None
            if proof:  # every write is issued and the target can wait for them itself
                self.report.proof = proof
                sealed()
            while inflight:
                await self._complete(*inflight.popleft())
        finally:
            for op, *_ in inflight:
                op.cancel()
            await asyncio.gather(*(op for op, *_ in inflight), return_exceptions=True)

    def _issue(self, items: list[tuple[Transfer, Staged]], inflight: _Inflight) -> None:
        """Queue ``items`` in order: rows written in place through ``submit_written``, runs of two or more
        other rows through ``submit_many`` (where the connection has it), single rows through ``submit``
        (or a task around ``write``). Rows not queued when something raises are given back."""
        t0 = time.perf_counter()
        queued, count = 0, len(items)
        try:
            while queued < count:
                end = queued + 1
                t, staged = items[queued]
                if staged.written is not None:  # (only on a connection that has it: ``Pipeline._resolver``)
                    ops = (self.conn.submit_written(staged.written, *self._target(t, staged), t.nbytes, self.epoch,
                                                    staged.event),)
                else:
                    while end < count and items[end][1].written is None:
                        end += 1
                    ops = self._submit(items, queued, end)
                for i, op in enumerate(ops, queued):
                    t, staged = items[i]
                    # what it holds goes back the moment it completes (or is cancelled), not when we look
                    op.add_done_callback(functools.partial(self._written, t, staged))
                    inflight.append((op, t, staged, t0))
                    issued(self.report, t, staged)
                queued = end
        except BaseException:
            for t, staged in items[queued:]:
                self.give_back(t, staged)
            raise
        finally:
            self.report.issue_s += time.perf_counter() - t0

    def _submit(self, items: list[tuple[Transfer, Staged]], start: int, end: int) -> Sequence[asyncio.Future]:
        """Completion futures of the copy rows ``items[start:end]``, queued in one call where the
        connection batches."""
        conn = self.conn
        if end - start == 1:
            t, s = items[start]
            if conn.abilities.submits:
                return (conn.submit(s.tensor, *self._target(t, s), self.epoch, s.event),)
            return (asyncio.ensure_future(self._write(t, s)),)
        return conn.submit_many([(s.tensor, *self._target(t, s), s.event) for t, s in items[start:end]],
                                self.epoch)  # (only where the connection has it: ``batch`` > 1)

    async def _write(self, t: Transfer, staged: Staged) -> None:
        if staged.event is None:
            await self.conn.write(staged.tensor, *self._target(t, staged), self.epoch)
        else:  # a side-stream transform may still be running: the transport orders the write after it
            await self.conn.write(staged.tensor, *self._target(t, staged), self.epoch, after=staged.event)

    async def _complete(self, op: asyncio.Future, t: Transfer, staged: Staged, t0: float) -> None:
        await op
        self.report.write_s += time.perf_counter() - t0

    def _written(self, t: Transfer, staged: Staged, op: asyncio.Future) -> None:
        self.give_back(t, staged)

    def _target(self, t: Transfer, staged: Staged) -> tuple[int, int]:
        """(region, offset) ``staged`` goes to: its row's in the landing slot, or the delta's window."""
        return staged.target if staged.target is not None else (t.dst_region + self.slot, t.dst_offset)
