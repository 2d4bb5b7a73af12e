"""The transport contract, on tcp and memory: bit-exact writes, per-epoch counts, bounds, closing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.engine.errors import ConfigError, ConnectionClosed, RegistrationError, TransportError
from weightsync.engine.transport import connect_authorized, create_transport
from transport_helpers import tcp_pair
from weightsync.wire import PeerInfo

WATCHDOG = 20


@pytest.fixture(params=["tcp", "memory"])
async def pair(request):
    src, dst = create_transport(request.param), create_transport(request.param)
    info = await dst.start(1)
    await src.start(0)
    region = torch.zeros(4096, dtype=torch.uint8)
    rinfo = dst.register(0, region)
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (rinfo,)))
    yield src, dst, conn, region
    await conn.close()
    await src.close()
    await dst.close()


async def test_writes_land_bit_exact_and_counted_per_epoch(pair):
    _, dst, conn, region = pair
    data = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    await conn.write(data[:600], 0, 100, 7)
    await conn.write(data[600:], 0, 700, 7)
    await conn.write(torch.empty(0, dtype=torch.uint8), 0, 0, 7)  # zero-size: counted, harmless
    await conn.fence()
    assert torch.equal(region[100:1100], data)
    c = dst.counters(7)[0]
    assert (c.count, c.nbytes) == (3, 1000) and dst.counters(8) == {}


async def test_submit_many_lands_rows_in_order_and_checks_them_all_first():
    src, dst = create_transport("memory"), create_transport("memory")
    info = await dst.start(1)
    await src.start(0)
    region = torch.zeros(256, dtype=torch.uint8)
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (dst.register(0, region),)))
    rows = [torch.full((n,), n, dtype=torch.uint8) for n in (10, 20, 30)]
    with pytest.raises(RegistrationError, match=r"region 0\+240"):  # the last row does not fit: none is queued
        conn.submit_many([(rows[0], 0, 0, None), (rows[1], 0, 10, None), (rows[2], 0, 240, None)], 5)
    assert conn.sent_count == 0
    ops = conn.submit_many([(r, 0, off, None) for r, off in zip(rows, (0, 10, 30))], 5)
    await asyncio.wait_for(asyncio.gather(*ops), WATCHDOG)
    await conn.fence()
    assert torch.equal(region[:60], torch.cat(rows)) and int(region[60:].sum()) == 0
    assert (dst.counters(5)[0].count, dst.counters(5)[0].nbytes, conn.sent_count) == (3, 60, 3)
    await conn.close()
    await src.close()
    await dst.close()


async def test_late_writes_of_closed_rounds_are_dropped(pair):
    _, dst, conn, region = pair
    dst.close_epoch(3)
    await conn.write(torch.full((10,), 9, dtype=torch.uint8), 0, 0, 3)
    await conn.fence()  # delivered (the fence accounts for it) but not applied
    assert int(region[:10].sum()) == 0 and dst.counters(3) == {}


async def test_out_of_bounds_write_is_reported_at_fence():
    async with tcp_pair() as (src, dst, conn):
        await conn.write(torch.ones(32, dtype=torch.uint8), 0, 40, 1)
        with pytest.raises(TransportError, match="out of bounds"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        await conn.write(torch.ones(8, dtype=torch.uint8), 5, 0, 1)  # no such region
        with pytest.raises(TransportError, match="region 5"):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)  # the connection still works
        await asyncio.wait_for(conn.fence(), WATCHDOG)


async def test_closed_target_fails_pending_and_later_operations():
    async with tcp_pair() as (src, dst, conn):
        await dst.close()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(conn.fence(), WATCHDOG)
        with pytest.raises(ConnectionClosed):
            await conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1)


async def test_connect_refused_is_typed():
    src = create_transport("tcp")
    await src.start(0)
    dead = create_transport("tcp")
    info = await dead.start(9)
    await dead.close()
    with pytest.raises(TransportError, match="cannot connect") as e:
        await src.connect(PeerInfo(9, info, ()))
    assert e.value.peer == "receiver/9"
    await src.close()
    with pytest.raises(ConfigError, match="unknown transport"):
        create_transport("carrier-pigeon")
