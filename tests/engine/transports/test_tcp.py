"""TCP specifics: mirrors, whole frames, payloads drained when their region closes (engine/transports/tcp.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.engine.errors import TransportError
from transport_helpers import tcp_pair

WATCHDOG = 20


async def test_tcp_settle_uploads_only_regions_tcp_wrote():
    """Under ``auto`` another transport may fill a device buffer directly: a TCP mirror that saw no
    write must not be copied over it (checked here with the mirror bookkeeping on CPU)."""
    async with tcp_pair() as (src, dst, conn):
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)
        await conn.fence()
        assert dst._dirty == {0}
        await dst.settle()  # no mirrors on CPU: nothing to upload, and the dirty set is consumed
        assert dst._dirty == set()


async def test_a_write_cancelled_mid_frame_leaves_the_stream_whole():
    """An aborted round cancels its writes; a frame already half on the wire must still be finished,
    or the target would read the next frame as the rest of this payload (and land garbage)."""
    big = 64 << 20
    async with tcp_pair(big + 64) as (src, dst, conn):
        on_the_wire = asyncio.Event()
        real = conn._writable

        async def writable():
            on_the_wire.set()  # part of the frame is sent; the socket is full
            await real()

        conn._writable = writable
        first = torch.full((big,), 3, dtype=torch.uint8)
        task = asyncio.ensure_future(conn.write(first, 0, 0, 1))
        await asyncio.wait_for(on_the_wire.wait(), WATCHDOG)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await conn.write(torch.full((64,), 9, dtype=torch.uint8), 0, big, 1)
        await asyncio.wait_for(conn.fence(), WATCHDOG)  # both frames whole: counts agree
        region = dst.regions[0]
        assert bytes(region[big:big + 64]) == bytes([9]) * 64 and region[big - 1] == 3


async def test_a_payload_still_arriving_when_its_region_closes_is_drained_not_landed():
    """A shadow buffer becomes live at commit: the rest of a write already under way into it must not
    land there (its target was fixed when its header arrived)."""
    big = 32 << 20
    async with tcp_pair(big) as (src, dst, conn):
        (agent,) = dst._agents
        arriving = asyncio.Event()
        real = agent.buffer_updated

        def updated(n):
            real(n)
            if agent.state == "payload" and agent.pos > 0:
                arriving.set()

        agent.buffer_updated = updated
        write = asyncio.ensure_future(conn.write(torch.full((big,), 5, dtype=torch.uint8), 0, 0, 1))
        await asyncio.wait_for(arriving.wait(), WATCHDOG)
        landed_before = agent.pos
        dst.guard.open_regions(())  # the region stops being writable mid-payload
        await asyncio.wait_for(write, WATCHDOG)
        with pytest.raises(TransportError, match="stopped mid-payload"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        region = dst.regions[0]
        assert landed_before < big and region[big - 1] == 0  # the rest never landed
        assert bytes(region[landed_before:]).count(0) == big - landed_before
