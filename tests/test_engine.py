"""Engine units: async primitives, transports, staging, the pipeline and the registration cache."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from engine.aio import ByteBudget, Channel, ChannelClosed, run_all
from engine.errors import ConfigError, ConnectionClosed, RegistrationError, StagingError, TransportError
from engine.pipeline import Pipeline, PipelineOptions
from engine.registry import Deregister, Register, RegistrationCache
from engine.staging import SourceSet, StagingPool
from engine.tensors import FlatBuffer, aligned_layout, byte_view, find_ties, named_tensors
from engine.transport import connect_authorized, create_transport
from wire import PeerInfo, Slice, Transfer

WATCHDOG = 20


async def _one_loop_iteration() -> None:
    """Let every ready task run once (a future resolved by the loop itself; no timing involved)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut


# --- aio ------------------------------------------------------------------------------------------


async def test_byte_budget_bounds_and_admits_oversized_alone():
    budget = ByteBudget(100)
    await budget.acquire(60)
    waiter = asyncio.ensure_future(budget.acquire(50))
    await _one_loop_iteration()  # the waiter parks
    assert not waiter.done() and budget.in_use == 60
    budget.release(60)
    await asyncio.wait_for(waiter, WATCHDOG)
    assert budget.in_use == 50
    budget.release(50)
    await budget.acquire(1000)  # larger than the budget: admitted when nothing else is in flight
    assert budget.in_use == 1000


async def test_byte_budget_cancelled_waiter_gives_nothing_away():
    budget = ByteBudget(10)
    await budget.acquire(10)
    waiter = asyncio.ensure_future(budget.acquire(5))
    await _one_loop_iteration()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    budget.release(10)
    assert budget.in_use == 0 and "0 waiting" in repr(budget)


async def test_channel_close_drains_then_ends_and_fail_breaks_both_ends():
    ch: Channel = Channel(2)
    await ch.send(1)
    await ch.send(2)
    ch.close()
    assert [x async for x in ch] == [1, 2]
    with pytest.raises(ChannelClosed):
        await ch.send(3)
    broken: Channel = Channel(1)
    broken.fail(ValueError("boom"))
    with pytest.raises(ValueError):
        await broken.receive()
    with pytest.raises(ValueError):
        await broken.send(1)


async def test_channel_receive_nowait_takes_only_what_is_queued():
    ch: Channel = Channel(3)
    assert ch.receive_nowait() is None
    await ch.send(1)
    await ch.send(2)
    assert [ch.receive_nowait(), ch.receive_nowait(), ch.receive_nowait()] == [1, 2, None]
    ch.close()  # (queues a wake-up marker: never handed out as an item)
    assert ch.receive_nowait() is None
    with pytest.raises(ChannelClosed):
        await ch.receive()
    broken: Channel = Channel(1)
    broken.fail(ValueError("boom"))
    with pytest.raises(ValueError):
        broken.receive_nowait()


async def test_run_all_cancels_siblings_on_first_error():
    cancelled = asyncio.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def fail():
        raise RuntimeError("first")

    with pytest.raises(RuntimeError, match="first"):
        await asyncio.wait_for(run_all([forever(), fail()]), WATCHDOG)
    assert cancelled.is_set()


# --- tensors --------------------------------------------------------------------------------------


def test_byte_view_zero_copy_and_odd_dtypes():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    v = byte_view(t)
    assert len(v) == 12
    v[0] = 0xFF
    assert t.view(torch.uint8)[0, 0] == 0xFF  # same memory
    assert len(byte_view(torch.empty(0, 5))) == 0 and len(byte_view(torch.tensor(3, dtype=torch.int64))) == 8
    with pytest.raises(ConfigError, match="contiguous"):
        byte_view(t.t())


def test_ties_and_layout():
    w = torch.randn(4, 4)
    named = {"a": w, "b": w, "c": torch.randn(3), "d": w.t()}
    ties = find_ties(named)
    assert ties == {"b": "a"}  # same memory, but d has other strides: not a tie
    offsets, total = aligned_layout(named, ties)
    assert offsets["b"] == offsets["a"] and all(o % 256 == 0 for o in offsets.values())
    buf = FlatBuffer(total)
    assert buf.view(offsets["c"], torch.float32, (3,)).shape == (3,)
    module = torch.nn.Linear(2, 3)
    assert set(named_tensors(module)) == {"weight", "bias"}
    with pytest.raises(ConfigError, match="params"):
        named_tensors([1, 2])


# --- staging --------------------------------------------------------------------------------------


def _t(index, name, nbytes, slice_=None, dst=0, offset=0, transform=""):
    return Transfer(index, name, slice_, dst, name, 0, offset, nbytes, transform)


async def test_staging_views_copies_and_errors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sources = SourceSet({"w": base, "wt": base.t()})
    pool = StagingPool()
    rows = await sources.stage(_t(0, "w", 2 * 6 * 4, Slice(0, 1, 3)), pool, "crc32")
    assert not rows.pooled and rows.tensor.data_ptr() == base[1].data_ptr()  # a view: zero copy
    cols = await sources.stage(_t(1, "w", 4 * 2 * 4, Slice(1, 2, 4)), pool, "")
    assert cols.pooled and torch.equal(cols.tensor, base[:, 2:4])  # another dim: staged copy
    nc = await sources.stage(_t(2, "wt", 24 * 4), pool, "")
    assert nc.pooled and torch.equal(nc.tensor, base.t())
    pool.give(cols.buffer)
    pool.give(nc.buffer)
    again = await sources.stage(_t(3, "w", 4 * 2 * 4, Slice(1, 0, 2)), pool, "")
    assert pool.reused == 1 and torch.equal(again.tensor, base[:, 0:2])
    with pytest.raises(StagingError, match="does not hold"):
        await sources.stage(_t(4, "nope", 4), pool, "")
    with pytest.raises(StagingError, match="the table says"):
        await sources.stage(_t(5, "w", 7), pool, "")
    with pytest.raises(StagingError, match="unknown transform"):
        await sources.stage(_t(6, "w", 96, transform="fp8"), pool, "")


async def test_sharded_source_uses_local_coordinates():
    from wire import ShardSpec

    shard = torch.arange(8, dtype=torch.float32).reshape(4, 2)  # rows 4:8 of an (8, 2) tensor
    sources = SourceSet({"w": shard}, {"w": ShardSpec((8, 2), 0, 4, 8)})
    staged = await sources.stage(_t(0, "w", 2 * 2 * 4, Slice(0, 5, 7)), StagingPool(), "")
    assert torch.equal(staged.tensor, shard[1:3])
    with pytest.raises(StagingError, match="outside the rows"):
        await sources.stage(_t(1, "w", 16, Slice(0, 2, 4)), StagingPool(), "")


# --- transports -----------------------------------------------------------------------------------


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


@contextlib.asynccontextmanager
async def tcp_pair(nbytes: int = 64):
    """A TCP initiator connected to a target with one registered region of ``nbytes``."""
    src, dst = create_transport("tcp"), create_transport("tcp")
    info = await dst.start(1)
    await src.start(0)
    rinfo = dst.register(0, torch.zeros(nbytes, dtype=torch.uint8))
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (rinfo,)))
    try:
        yield src, dst, conn
    finally:
        await conn.close()
        await src.close()
        await dst.close()


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


# --- pipeline -------------------------------------------------------------------------------------


class RecordingConnection:
    """Counts bytes in flight across all connections (writes park until released by the test)."""

    def __init__(self, peer, shared) -> None:
        self.peer = peer
        self.shared = shared
        self.fenced = 0

    async def write(self, src, dst_region, dst_offset, epoch):
        n = src.numel() * src.element_size()
        self.shared["inflight"] += n
        self.shared["peak"] = max(self.shared["peak"], self.shared["inflight"])
        self.shared["order"].append((self.peer, dst_offset))
        await _one_loop_iteration()  # other lanes run while this write is "in flight"
        self.shared["inflight"] -= n
        if self.shared.get("fail_at") == len(self.shared["order"]):
            raise TransportError("injected", peer=self.peer)

    async def fence(self):
        self.fenced += 1

    async def close(self):
        pass


def _table(n_dst, per_dst, nbytes):
    transfers, i = [], 0
    for k in range(per_dst):
        for d in range(n_dst):
            transfers.append(Transfer(i, f"p{d}_{k}", None, d, f"p{d}_{k}", 0, k * nbytes, nbytes, ""))
            i += 1
    return transfers


@pytest.mark.parametrize("copies", [True, False])
async def test_pipeline_keeps_lane_order_budget_and_fences(copies):
    # copies: non-contiguous sources need staging copies, which the byte budget bounds; views are
    # bounded by depth alone (2 per lane, 3 lanes)
    make = (lambda: torch.zeros(8, 8, dtype=torch.uint8).t()) if copies else (lambda: torch.zeros(64, dtype=torch.uint8))
    sources = SourceSet({f"p{d}_{k}": make() for d in range(3) for k in range(5)})
    shared = {"inflight": 0, "peak": 0, "order": []}
    conns = {d: RecordingConnection(d, shared) for d in range(3)}
    pipe = Pipeline(sources, PipelineOptions(max_inflight_bytes=128, depth=2, checksum="crc32"))
    report = await asyncio.wait_for(pipe.run(_table(3, 5, 64), conns, epoch=1), WATCHDOG)
    assert shared["peak"] <= (128 if copies else 3 * 2 * 64)
    assert shared["peak"] > 128 or copies  # without copies the budget does not hold writes back
    for d in range(3):
        assert [off for peer, off in shared["order"] if peer == d] == [k * 64 for k in range(5)]
        assert conns[d].fenced == 1
        lane = report.lanes[d]
        assert (lane.count, lane.nbytes, len(lane.checksums)) == (5, 320, 5)
    assert [s.peer_rank for s in report.summaries()] == [0, 1, 2]
    assert pipe.budget.in_use == 0 and "runs=1" in repr(pipe)


async def test_pipeline_failure_cancels_lanes_and_returns_budget():
    sources = SourceSet({f"p{d}_{k}": torch.zeros(64, dtype=torch.uint8) for d in range(2) for k in range(6)})
    shared = {"inflight": 0, "peak": 0, "order": [], "fail_at": 4}
    conns = {d: RecordingConnection(d, shared) for d in range(2)}
    pipe = Pipeline(sources, PipelineOptions(max_inflight_bytes=1 << 20, depth=2))
    with pytest.raises(TransportError, match="injected"):
        await asyncio.wait_for(pipe.run(_table(2, 6, 64), conns, epoch=1), WATCHDOG)
    assert len(shared["order"]) < 12 and pipe.budget.in_use == 0


class SubmittingConnection:
    """A connection that queues writes (``submit``) and completes them later, oldest first; one may fail."""

    depth = 3

    def __init__(self, fail_at: int = -1) -> None:
        self.peer = "receiver/0"
        self.queued: list[tuple[int, asyncio.Future]] = []
        self.most_queued = 0
        self.fail_at = fail_at
        self.fenced = 0

    def submit(self, src, dst_region, dst_offset, epoch, after=None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.queued.append((dst_offset, fut))
        self.most_queued = max(self.most_queued, sum(not f.done() for _, f in self.queued))
        asyncio.get_running_loop().call_soon(self._complete_oldest)
        return fut

    def _complete_oldest(self) -> None:
        offset, fut = next((o, f) for o, f in self.queued if not f.done())
        if offset == self.fail_at:
            fut.set_exception(TransportError("injected completion failure", peer=self.peer))
        else:
            fut.set_result(None)

    async def write(self, *args, **kwargs) -> None:
        raise AssertionError("the pipeline drives a submitting connection through submit")

    async def fence(self) -> None:
        self.fenced += 1

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True], ids=["all-complete", "one-fails"])
async def test_pipeline_drives_submitting_connections_at_their_depth(fail):
    sources = SourceSet({f"p0_{k}": torch.zeros(8, 8, dtype=torch.uint8).t() for k in range(8)})  # staged copies
    conn = SubmittingConnection(fail_at=5 * 64 if fail else -1)
    pipe = Pipeline(sources, PipelineOptions(max_inflight_bytes=4 * 64))
    run = pipe.run(_table(1, 8, 64), {0: conn}, epoch=1)
    if fail:
        with pytest.raises(TransportError, match="injected completion failure"):
            await asyncio.wait_for(run, WATCHDOG)
    else:
        report = await asyncio.wait_for(run, WATCHDOG)
        assert (report.lanes[0].count, report.nbytes, conn.fenced) == (8, 8 * 64, 1)
    assert [o for o, _ in conn.queued][:6] == [k * 64 for k in range(6)] and conn.most_queued <= conn.depth
    assert pipe.budget.in_use == 0  # every completion (and the failed one) gave its staging bytes back


class BatchingConnection(SubmittingConnection):
    """Takes runs of rows through ``submit_many`` (one completion for the run, as cuda_ipc's) and
    single rows through ``submit``; records each call's row count."""

    depth = 4
    batch = 3

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def submit_many(self, rows, epoch) -> list:
        assert len(rows) > 1, "a single row goes through submit"
        self.calls.append(len(rows))
        futs = [SubmittingConnection.submit(self, src, region, offset, epoch, after) for src, region, offset, after in rows]
        return [futs[-1]] * len(rows)

    def submit(self, src, dst_region, dst_offset, epoch, after=None) -> asyncio.Future:
        self.calls.append(1)
        return super().submit(src, dst_region, dst_offset, epoch, after)


@pytest.mark.parametrize("batch", [None, 1, 8])
async def test_pipeline_hands_batching_connections_the_rows_staged_meanwhile(batch):
    sources = SourceSet({f"p0_{k}": torch.full((64,), k, dtype=torch.uint8) for k in range(11)})  # views
    conn = BatchingConnection()
    pipe = Pipeline(sources, PipelineOptions(batch=batch))
    report = await asyncio.wait_for(pipe.run(_table(1, 11, 64), {0: conn}, epoch=1), WATCHDOG)
    limit = batch or conn.batch
    assert sum(conn.calls) == 11 and max(conn.calls) <= limit and (max(conn.calls) > 1) == (limit > 1)
    assert conn.calls[0] == 1  # the first row goes at once, not when the channel is full
    assert [o for o, _ in conn.queued] == [k * 64 for k in range(11)]  # lane order kept across batches
    assert conn.most_queued <= conn.depth + limit - 1  # a batch may overshoot depth until it completes
    assert (report.lanes[0].count, report.nbytes, conn.fenced) == (11, 11 * 64, 1) and pipe.budget.in_use == 0


async def test_pipeline_gives_back_a_batch_that_cannot_be_queued():
    sources = SourceSet({f"p0_{k}": torch.zeros(8, 8, dtype=torch.uint8).t() for k in range(6)})  # staged copies
    src, dst = create_transport("memory"), create_transport("memory")
    info = await dst.start(1)
    await src.start(0)
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (dst.register(0, torch.zeros(4 * 64, dtype=torch.uint8)),)))
    pipe = Pipeline(sources, PipelineOptions(max_inflight_bytes=1 << 20))
    with pytest.raises(RegistrationError, match="out of bounds"):  # rows 4 and 5 lie past the region
        await asyncio.wait_for(pipe.run(_table(1, 6, 64), {0: conn}, epoch=1), WATCHDOG)
    assert pipe.budget.in_use == 0 and conn.sent_count < 6  # the refused batch holds nothing
    await conn.close()
    await src.close()
    await dst.close()


async def test_pipeline_options_are_validated():
    with pytest.raises(ConfigError, match="depth"):
        PipelineOptions(depth=0)
    with pytest.raises(ConfigError, match="batch"):
        PipelineOptions(batch=0)
    with pytest.raises(ConfigError, match="checksum"):
        PipelineOptions(checksum="md5")
    with pytest.raises(ConfigError, match="no connection"):
        await Pipeline(SourceSet({})).run(_table(1, 1, 8), {}, epoch=1)


# --- registration cache ---------------------------------------------------------------------------


def test_registration_cache_plans_then_acts():
    cache = RegistrationCache()
    a, b = torch.zeros(128, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)
    actions = cache.plan({0: a})
    assert [type(x) for x in actions] == [Register]
    transport = create_transport("memory")
    cache.apply(actions, transport)
    assert cache.plan({0: a}) == [] and cache.hits == 1  # reused across rounds
    swap = cache.plan({0: b})  # the region now lives in another allocation (a shadow swap)
    assert [type(x) for x in swap] == [Deregister, Register]
    cache.apply(swap, transport)
    assert transport.regions[0] is b
    cache.apply(cache.evict([0, 5]), transport)
    assert 0 not in transport.regions and "evictions=2" in repr(cache)


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
