"""The stage -> write pipeline: lane order, budget, depth, batches, failures (engine/datapath/pipeline.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.engine.datapath.pipeline import Pipeline, PipelineOptions
from weightsync.engine.datapath.staging import SourceSet
from weightsync.engine.errors import ConfigError, RegistrationError, TransportError
from weightsync.engine.transport import Abilities, connect_authorized, create_transport
from loop_helpers import one_loop_iteration
from weightsync.wire import PeerInfo, Transfer

WATCHDOG = 20


class RecordingConnection:
    """Counts bytes in flight across all connections (writes park until released by the test)."""

    abilities = Abilities()  # write, fence and close only
    generation = 0

    def __init__(self, peer, shared) -> None:
        self.peer = peer
        self.shared = shared
        self.fenced = 0

    async def write(self, src, dst_region, dst_offset, epoch):
        n = src.numel() * src.element_size()
        self.shared["inflight"] += n
        self.shared["peak"] = max(self.shared["peak"], self.shared["inflight"])
        self.shared["order"].append((self.peer, dst_offset))
        await one_loop_iteration()  # other lanes run while this write is "in flight"
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

    abilities = Abilities(depth=3, submits=True)
    generation = 0

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
    assert [o for o, _ in conn.queued][:6] == [k * 64 for k in range(6)] and conn.most_queued <= conn.abilities.depth
    assert pipe.budget.in_use == 0  # every completion (and the failed one) gave its staging bytes back


class BatchingConnection(SubmittingConnection):
    """Takes runs of rows through ``submit_many`` (one completion for the run, as cuda_ipc's) and
    single rows through ``submit``; records each call's row count."""

    abilities = Abilities(depth=4, submits=True, batch=3)

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
    limit = batch or conn.abilities.batch
    assert sum(conn.calls) == 11 and max(conn.calls) <= limit and (max(conn.calls) > 1) == (limit > 1)
    assert conn.calls[0] == 1  # the first row goes at once, not when the channel is full
    assert [o for o, _ in conn.queued] == [k * 64 for k in range(11)]  # lane order kept across batches
    assert conn.most_queued <= conn.abilities.depth + limit - 1  # a batch may overshoot depth until it completes
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
