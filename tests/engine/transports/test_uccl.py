"""The UCCL transport's logic on CPU, over a stand-in endpoint that completes writes before they land
(as UCCL's tcp mode does): side-channel pairing, descriptors, mailbox fences, per-round counters,
transfer ids polled exactly once, and a whole update round through the public API."""

from __future__ import annotations

import asyncio

import pytest
import torch

import fake_uccl
from transport_helpers import connect_while_closing
from weightsync.engine.errors import RegistrationError
from weightsync.engine.transport import BACKENDS, TransportOptions, connect_authorized, register_backend
from weightsync.engine.transports import uccl, uccl_connection
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender
from weightsync.wire import PeerInfo

WATCHDOG = 30


@pytest.fixture(autouse=True)
def fake_backend():
    register_backend("uccl_fake", "fake_uccl:FakeUcclTransport")
    fake_uccl.problems.clear()
    yield
    BACKENDS.pop("uccl_fake", None)
    assert fake_uccl.problems == []


async def _target(nbytes: int = 4096):
    dst = fake_uccl.FakeUcclTransport(TransportOptions())
    info = await dst.start(1)
    region = torch.zeros(nbytes, dtype=torch.uint8)
    return dst, info, region, dst.register(0, region)


async def _initiator(rank: int, info, rinfo, dst):
    src = fake_uccl.FakeUcclTransport(TransportOptions())
    await src.start(rank)
    return src, await asyncio.wait_for(connect_authorized(src, dst, PeerInfo(1, info, (rinfo,))), WATCHDOG)


async def test_writes_land_only_through_the_fence_and_are_counted_per_round():
    dst, info, region, rinfo = await _target()
    src, conn = await _initiator(0, info, rinfo, dst)
    data = torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    await conn.write(data[:600], 0, 100, 7)
    await conn.write(data[600:], 0, 700, 7)
    await conn.write(torch.empty(0, dtype=torch.uint8), 0, 0, 7)
    await conn.fence()  # waits at the target for the bytes, which land LATENCY_S per write after sending
    assert torch.equal(region[100:1100], data)
    assert (dst.counters(7)[0].count, dst.counters(7)[0].nbytes) == (3, 1000) and dst.counters(8) == {}
    await conn.write(data[:10], 0, 0, 8)  # the next round counts from zero
    await conn.fence()
    assert (dst.counters(8)[0].count, dst.counters(8)[0].nbytes) == (1, 10)
    assert len(conn.blobs) == 3 and "descriptors=3" in repr(conn)  # one per destination range, cached
    dst.close_epoch(8)
    assert dst.counters(8) == {}
    assert src.ep.outstanding() == [] and dst.ep.outstanding() == []
    for t in (conn, src, dst):
        await t.close()


async def test_out_of_bounds_destination_is_refused_by_the_target(monkeypatch):
    dst, info, region, rinfo = await _target(64)
    src, conn = await _initiator(0, info, rinfo, dst)
    with pytest.raises(RegistrationError, match="refused region 0 bytes 60.*receiver/1"):
        await conn.write(torch.ones(10, dtype=torch.uint8), 0, 60, 1)
    monkeypatch.setattr(uccl_connection, "CHUNK", 16)  # large writes go in pieces (UCCL sizes are u32)
    await conn.write(torch.arange(50, dtype=torch.uint8), 0, 0, 2)
    await conn.fence()
    assert torch.equal(region[:50], torch.arange(50, dtype=torch.uint8)) and len(conn.blobs) == 4
    for t in (conn, src, dst):
        await t.close()


async def test_concurrent_initiators_are_paired_by_handshake_not_timing():
    dst, info, region, rinfo = await _target()
    pairs = await asyncio.gather(*(_initiator(rank, info, rinfo, dst) for rank in (3, 5, 9)))
    for rank, (_, conn) in zip((3, 5, 9), pairs):
        await conn.write(torch.full((rank,), rank, dtype=torch.uint8), 0, rank * 100, 1)
        await conn.fence()
    assert {src: c.count for src, c in dst.counters(1).items()} == {3: 1, 5: 1, 9: 1}
    assert all(int(region[r * 100:r * 100 + r].sum()) == r * r for r in (3, 5, 9))
    for src, conn in pairs:
        await conn.close()
        await src.close()
    await dst.close()


async def test_a_cancelled_write_is_still_polled_to_the_end():
    dst, info, region, rinfo = await _target()
    src, conn = await _initiator(0, info, rinfo, dst)
    polled, real_poll = asyncio.Event(), src.ep.poll_async

    def poll(tid):
        polled.set()  # the transfer id exists and its poll task runs
        return real_poll(tid)

    src.ep.poll_async = poll
    task = asyncio.ensure_future(conn.write(torch.ones(8, dtype=torch.uint8), 0, 0, 1))
    await asyncio.wait_for(polled.wait(), WATCHDOG)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await conn.close()  # waits for the shielded poll
    assert src.ep.outstanding() == [] and "polling=0" in repr(conn)
    await src.close()
    await dst.close()


async def test_full_rounds_through_the_public_api_over_uccl_semantics():
    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=5.0, checksum="crc32")
    tensors, targets = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        async with WeightSender(ctl.address, tensors, rank=0, options=SenderOptions(transport="uccl_fake")) as snd, \
                WeightReceiver(ctl.address, targets, rank=0, options=ReceiverOptions(transport="uccl_fake")) as rcv:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            for v in (1, 2):
                update_in_place(tensors, v)
                await asyncio.wait_for(await snd.push(v), WATCHDOG)
                assert (await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)).ok
                assert rcv.version == v and mismatches(targets, v) == []


async def test_the_side_channel_front_door_times_out_and_bounds_strangers():
    """Strangers on the side channel: the oldest over the cap is closed at once, the rest at the
    handshake deadline; a planned initiator still pairs and its writes land."""
    dst = fake_uccl.FakeUcclTransport(TransportOptions(handshake_timeout_s=0.5, max_unauthenticated=4))
    info = await dst.start(1)
    region = torch.zeros(64, dtype=torch.uint8)
    rinfo = dst.register(0, region)
    host, _, port = info.address.rpartition(":")
    strangers = [await asyncio.open_connection(host, int(port)) for _ in range(10)]
    try:
        src, conn = await _initiator(0, info, rinfo, dst)
        await conn.write(torch.full((8,), 5, dtype=torch.uint8), 0, 0, 1)
        await asyncio.wait_for(conn.fence(), WATCHDOG)
        assert region[:8].tolist() == [5] * 8
        for reader, _ in strangers:  # each is closed by the target: the challenge, then end of stream
            assert len(await asyncio.wait_for(reader.read(), WATCHDOG)) == uccl.FRAME.size
        assert dst.guard.refused >= 10 and not dst._waiting
        await conn.close()
        await src.close()
    finally:
        for _, writer in strangers:
            writer.close()
        await dst.close()


@pytest.mark.parametrize("turns", range(5))
async def test_a_side_channel_connection_accepted_as_the_transport_closes_hears_its_end(turns):
    """Initiators connect while the target closes, ``turns`` loop turns after the kernel took their
    connections: each hears a reset or an end of stream at once, never silence (``engine.transports.listen``)."""
    dst, info, _, _ = await _target()
    await connect_while_closing(info.address, dst.close, turns)
