"""Compiled rounds (engine/datapath/compiled.py) and TCP's replay of them: tables, caching, coalesced frames."""

from __future__ import annotations

import asyncio

import pytest
import torch

from weightsync.engine.datapath.compiled import compile_lane
from weightsync.engine.datapath.pipeline import Pipeline, PipelineOptions
from weightsync.engine.datapath.staging import SourceSet
from weightsync.engine.errors import RoundAborted, StagingError, TransportError
from weightsync.engine.transport import connect_authorized, create_transport
from weightsync.engine.transports import tcp
from proc_helpers import MOE_SPEC, mismatches, receiver_tensors, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender
from weightsync.wire import PeerInfo, Slice, Transfer

WATCHDOG = 30


async def _pair(kind: str, *sizes: int):
    src, dst = create_transport(kind), create_transport(kind)
    info = await dst.start(1)
    await src.start(0)
    regions = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    infos = tuple(dst.register(i, r) for i, r in enumerate(regions))
    conn = await connect_authorized(src, dst, PeerInfo(1, info, infos))
    return src, dst, conn, regions


async def _close(src, dst, conn) -> None:
    await conn.close()
    await src.close()
    await dst.close()


def _table(tensors: dict[str, torch.Tensor], gaps: dict[str, int] = {}) -> tuple[Transfer, ...]:
    """One row per tensor (one half of ``odd``: a slice), packed into region 0 in order (plus gaps)."""
    rows, at = [], 0
    for i, (name, t) in enumerate(tensors.items()):
        piece = Slice(0, 0, 1) if name == "odd" else None
        nbytes = (t[:1] if piece else t).numel() * t.element_size()
        at += gaps.get(name, 0)
        rows.append(Transfer(i, name, piece, 0, name, 0, at, nbytes, ""))
        at += nbytes
    return tuple(rows)


SOURCES = {"a": torch.arange(12, dtype=torch.float32), "b": torch.arange(5, dtype=torch.uint8),
           "empty": torch.empty(0, dtype=torch.float32), "odd": torch.arange(6, dtype=torch.int16).view(2, 3),
           "t": torch.arange(6, dtype=torch.float32).view(2, 3).t()}  # non-contiguous: staged, not compiled


async def test_a_compiled_lane_is_the_per_row_plan_byte_for_byte():
    src, dst, conn, (region,) = await _pair("memory", 256)
    sources = SourceSet(SOURCES)
    table = _table(SOURCES)
    sources.begin(table)
    lane = compile_lane(table, sources, conn, slot=0, checksum="")
    assert [t.name for t in lane.staged] == ["t"]
    for row, t in zip(lane.rows, [t for t in table if t.name != "t"]):
        view = sources.view(t)
        assert (row.name, row.region, row.offset, row.nbytes) == (t.name, t.dst_region, t.dst_offset, t.nbytes)
        assert row.src.data_ptr() == view.data_ptr() and torch.equal(row.src, view)
    assert lane.nbytes == sum(t.nbytes for t in table if t.name != "t")
    assert compile_lane(table, sources, conn, 0, "crc32").rows == ()  # checksums: every row staged
    assert len(compile_lane(table, sources, conn, 0, "fp64").rows) == len(lane.rows)  # read from the sources
    await _close(src, dst, conn)


@pytest.mark.parametrize("algo", ["fp64", "crc32"])
async def test_a_checked_round_reports_every_row_s_checksum_compiled_or_staged(algo):
    """A round that checks ``fp64`` keeps its direct rows compiled and reads their fingerprints from the
    sources (``checksums.fp64_many``); other checksums stage every row. Either way every row's checksum
    is the one of the bytes that landed, and they land bit for bit."""
    from weightsync.engine.datapath.checksums import checksum

    src, dst, conn, (region,) = await _pair("memory", 256)
    table = _table(SOURCES)
    pipeline = Pipeline(SourceSet(SOURCES), PipelineOptions(checksum=algo))
    report = await asyncio.wait_for(pipeline.run(table, {0: conn}, 1), WATCHDOG)
    lane = pipeline.compiler.lanes(table, pipeline.sources, {0: conn}, {}, algo)[0]
    assert len(lane.rows) == (len(SOURCES) - 1 if algo == "fp64" else 0)  # ("t" is not dense: staged)
    got = {c.index: c.value for c in report.lanes[0].checksums}
    assert got == {t.index: checksum(region[t.dst_offset:t.dst_offset + t.nbytes], algo) for t in table}
    assert torch.equal(region[:48].view(torch.float32), SOURCES["a"])
    await _close(src, dst, conn)


@pytest.mark.parametrize("print_bytes", [256 << 20, 1])  # one pass for the lane; a pass after every row
async def test_staged_rows_fp64_is_taken_in_passes_before_the_lane_seals(monkeypatch, print_bytes):
    """Compiling off, every row is staged: those staged without a pool copy (contiguous sources) have their
    ``fp64`` taken together (``staging.LATER``), in passes of up to ``PRINT_BYTES``, the pooled copy's
    inline; every row still reports the checksum of the bytes that landed."""
    from weightsync.engine.datapath import lanes, pipeline as pipeline_mod
    from weightsync.engine.datapath.checksums import checksum

    passes = []
    real = lanes.prints

    async def counted(rows):
        passes.append(sorted(index for index, _ in rows))
        return await real(rows)

    monkeypatch.setattr(pipeline_mod, "prints", counted)
    monkeypatch.setattr(pipeline_mod, "PRINT_BYTES", print_bytes)
    src, dst, conn, (region,) = await _pair("memory", 256)
    table = _table(SOURCES)
    pipeline = Pipeline(SourceSet(SOURCES), PipelineOptions(checksum="fp64", compiled=False))
    report = await asyncio.wait_for(pipeline.run(table, {0: conn}, 1), WATCHDOG)
    got = {c.index: c.value for c in report.lanes[0].checksums}
    assert got == {t.index: checksum(region[t.dst_offset:t.dst_offset + t.nbytes], "fp64") for t in table}
    # ("t" is not dense: a pool copy, its fp64 taken at once; "empty", of no bytes, waits for the next row)
    assert passes == ([[0, 1, 2, 3]] if print_bytes > 1 else [[0], [1], [2, 3]])
    await _close(src, dst, conn)


async def test_a_lane_s_fingerprints_are_worked_out_once_and_read_the_sources_of_each_round(monkeypatch):
    """Checked rounds of the same compiled lane fingerprint its direct rows through one ``ManyPrints``
    made by the first (a 4,720-row lane spent 26 ms a checked round making streams and ranges per row),
    and every round's checksums are still those of the bytes that landed that round."""
    from weightsync.engine.datapath import checksums, lanes
    from weightsync.engine.datapath.checksums import checksum

    made = []

    class Counted(checksums.ManyPrints):
        def __init__(self, views):
            made.append(len(views))
            super().__init__(views)

    monkeypatch.setattr(lanes, "ManyPrints", Counted)
    sources = {k: v.clone() for k, v in SOURCES.items()}
    src, dst, conn, (region,) = await _pair("memory", 256)
    table = _table(sources)
    pipeline = Pipeline(SourceSet(sources), PipelineOptions(checksum="fp64"))
    for step in range(3):
        sources["a"].add_(1.0)  # (each round's bytes differ: a kept launch must read them again)
        report = await asyncio.wait_for(pipeline.run(table, {0: conn}, 1 + step), WATCHDOG)
        got = {c.index: c.value for c in report.lanes[0].checksums}
        assert got == {t.index: checksum(region[t.dst_offset:t.dst_offset + t.nbytes], "fp64") for t in table}
        assert torch.equal(region[:48].view(torch.float32), sources["a"])
    assert made == [len(SOURCES) - 1]  # (the lane's direct rows, once; "t" is staged)
    await _close(src, dst, conn)


def test_fp64_of_many_rows_equals_each_row_s_including_pitched_views():
    from weightsync.engine.datapath.checksums import fp64, fp64_many

    gen = torch.Generator().manual_seed(5)
    whole = torch.randint(-2**31, 2**31 - 1, (40, 37), generator=gen, dtype=torch.int32)
    views = [whole, whole[3:9, 5:20], whole.view(torch.uint8)[:, 1:7], whole.t(), whole[0, :0], whole.view(torch.uint8)[7]]
    assert fp64_many(views) == [fp64(v.contiguous().reshape(-1).view(torch.uint8)) for v in views]


async def test_slots_alternate_each_with_its_own_table_and_a_new_registration_recompiles():
    src, dst, conn, regions = await _pair("memory", 256, 256)
    sources = SourceSet(SOURCES)
    table = _table(SOURCES)
    pipeline = Pipeline(sources)
    for epoch in range(1, 7):  # a shadow receiver's two landing slots, in turn
        await asyncio.wait_for(pipeline.run(table, {0: conn}, epoch, slots={0: epoch % 2}), WATCHDOG)
        landed = regions[epoch % 2]
        assert torch.equal(landed[:48].view(torch.float32), SOURCES["a"])
        assert torch.equal(landed[48:53], SOURCES["b"])
    assert pipeline.compiler.compiles == 2  # once per slot; every other round replayed
    conn.reregistered()  # the target's registrations changed: stale tables must not be replayed
    await pipeline.run(table, {0: conn}, 7, slots={0: 1})
    assert pipeline.compiler.compiles == 3
    await _close(src, dst, conn)


async def test_a_fingerprinted_round_replays_the_unchecked_rounds_tables():
    """A full ``fp64`` check (every 8th round by default) compiles nothing: its direct rows are the
    unchecked rounds' (compiling a 2 GiB lane took 0.18 s inside a round on a busy GPU host); another
    checksum stages every row, so it has lanes of its own."""
    src, dst, conn, regions = await _pair("memory", 256, 256)
    table = _table(SOURCES)
    pipeline = Pipeline(SourceSet(SOURCES))
    for epoch, algo in enumerate(["", "", "fp64", "fp64", "", "crc32"], start=1):
        pipeline.options = PipelineOptions(checksum=algo)
        report = await asyncio.wait_for(pipeline.run(table, {0: conn}, epoch, slots={0: epoch % 2}), WATCHDOG)
        assert len(report.lanes[0].checksums) == (len(table) if algo else 0)
        assert torch.equal(regions[epoch % 2][:48].view(torch.float32), SOURCES["a"])
    assert pipeline.compiler.compiles == 3  # slot 1 and slot 0 once each, then crc32's own lane
    await _close(src, dst, conn)


async def test_compiling_can_be_turned_off_and_every_row_is_staged():
    src, dst, conn, (region,) = await _pair("memory", 256)
    pipeline = Pipeline(SourceSet(SOURCES), PipelineOptions(compiled=False))
    report = await asyncio.wait_for(pipeline.run(_table(SOURCES), {0: conn}, 1), WATCHDOG)
    assert pipeline.compiler.compiles == 1 and report.lanes[0].count == len(SOURCES)
    lane = pipeline.compiler.lanes(_table(SOURCES), pipeline.sources, {0: conn}, {}, "", False)[0]
    assert lane.rows == () and len(lane.staged) == len(SOURCES)
    assert torch.equal(region[:48].view(torch.float32), SOURCES["a"])
    await _close(src, dst, conn)


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_a_row_that_no_longer_fits_raises_a_typed_error_naming_the_parameter(kind):
    src, dst, conn, _ = await _pair(kind, 40)  # "a" alone is 48 bytes
    sources = SourceSet(SOURCES)
    table = _table(SOURCES)
    with pytest.raises(StagingError, match="'a'.*region 0\\+0 do not fit") as info:
        await Pipeline(sources).run(table, {0: conn}, 1)
    assert info.value.param == "a"
    await _close(src, dst, conn)


ODD = [0, 1, 3, 7, 0, 4097, 70_000, 5, 200_000, 0, 2]  # odd sizes, zero-byte rows, above DIRECT_MIN


@pytest.mark.parametrize("gap", [0, 3])
async def test_tcp_replays_coalesced_frames_bit_exact(gap):
    """Runs of back-to-back rows go as WRITE_RUN frames (gap 0), separate rows as WRITEs (gap 3); both
    land bit-exact, counted per row, over several rounds of one compiled table."""
    gen = torch.Generator().manual_seed(1)
    tensors = {f"r{i}": torch.randint(0, 255, (n,), generator=gen, dtype=torch.uint8) for i, n in enumerate(ODD)}
    total = sum(ODD) + gap * len(ODD)
    src, dst, conn, (region,) = await _pair("tcp", total)
    table = _table(tensors, {name: gap for name in tensors})
    pipeline = Pipeline(SourceSet(tensors))
    for epoch in (1, 2, 3):
        for t in tensors.values():
            t.add_(1)
        report = await asyncio.wait_for(pipeline.run(table, {0: conn}, epoch), WATCHDOG)
        for t in table:
            assert torch.equal(region[t.dst_offset:t.dst_offset + t.nbytes], tensors[t.name]), t.name
        c = dst.counters(epoch)[0]
        assert (c.count, c.nbytes) == (len(ODD), sum(ODD)) == (report.lanes[0].count, report.nbytes)
    frames = pipeline.compiler.lanes(table, pipeline.sources, {0: conn}, {}, "")[0].table
    assert len(frames.headers) == (1 if gap == 0 else len(ODD))
    await _close(src, dst, conn)


async def test_a_receiver_that_closes_mid_batch_aborts_the_round_and_nothing_is_applied(monkeypatch):
    """The receiver's end drops the connection 1 MiB into round 2 (inside a run of frames): the round
    aborts and the receiver stays on version 1, bit-exact. Which side tells first is a race: a sender
    that sees the drop aborts it with the transport error as its cause; one that had queued every
    frame before it (loopback buffers hold megabytes) seals, and the receiver's verdict aborts it, its
    arrivals short of what that sender wrote."""
    spec = MOE_SPEC
    sent, recv = sender_tensors(0, spec), receiver_tensors(spec)
    seen = {"bytes": 0}
    real = tcp._AgentProtocol.buffer_updated

    def buffer_updated(agent, nbytes):
        seen["bytes"] += nbytes
        if seen["bytes"] > 1 << 20:
            agent._close()
            return
        real(agent, nbytes)

    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0)
    async with Controller(senders=1, receivers=1, options=opts) as ctl, \
            WeightSender(ctl.address, sent, rank=0) as sender, \
            WeightReceiver(ctl.address, recv, rank=0) as receiver:
        update_in_place(sent, 1, spec)
        await asyncio.wait_for(await sender.push(1), WATCHDOG)
        assert receiver.version == 1 and mismatches(recv, 1, spec) == []
        monkeypatch.setattr(tcp._AgentProtocol, "buffer_updated", buffer_updated)
        update_in_place(sent, 2, spec)
        with pytest.raises(RoundAborted) as info:
            await asyncio.wait_for(await sender.push(2), WATCHDOG)
        aborted = info.value
        noticed = isinstance(aborted.__cause__, TransportError)
        short = aborted.culprit == "sender/0" and "from sender/0 landed" in str(aborted)
        assert noticed or short, repr(aborted)
        assert receiver.version == 1 and mismatches(recv, 1, spec) == []


async def test_blocks_of_a_ranks_own_rows_are_compiled_pitched_and_land_back_to_back():
    """A rank holding rows 2:6 of an (8, 6) tensor sends columns 1:4 of its rows as two blocks: where
    the connection copies pitched rows (memory, as cuda_ipc) they are direct rows with their pitch, and
    the bytes land back to back; over TCP (no pitched rows) they are staged; both bit-exact."""
    from weightsync.wire import ShardSpec

    full = torch.arange(48, dtype=torch.float32).view(8, 6)
    sources = SourceSet({"w": full[2:6].clone()}, {"w": ShardSpec((8, 6), 0, 2, 6)})
    table = (Transfer(0, "w", Slice(1, 1, 4, 2, 4), 0, "w", 0, 0, 2 * 3 * 4, ""),
             Transfer(1, "w", Slice(1, 1, 4, 4, 6), 0, "w", 0, 24, 2 * 3 * 4, ""))
    for kind in ("memory", "tcp"):
        src, dst, conn, (region,) = await _pair(kind, 64)
        sources.begin(table)
        lane = compile_lane(table, sources, conn, slot=0, checksum="")
        if kind == "memory":
            assert [(r.height, r.pitch, r.nbytes) for r in lane.rows] == [(2, 6 * 4, 24), (2, 6 * 4, 24)]
        else:
            assert lane.rows == () and [t.index for t in lane.staged] == [0, 1]
        await asyncio.wait_for(Pipeline(sources).run(table, {0: conn}, 1), WATCHDOG)
        assert torch.equal(region[:48].view(torch.float32).view(4, 3), full[2:6, 1:4]), kind
        await _close(src, dst, conn)


async def test_compiled_lanes_stay_bounded_however_many_tokens_come():
    """Lanes are cached per token (which rows are written in place depends on every lane's slot and
    connection): a sender whose lanes go in and out of delta mode sees many, and the cache keeps at most
    8 entries a lane, this round's always among them."""
    src, dst, conn, (region,) = await _pair("memory", 256)
    sources = SourceSet(SOURCES)
    table = _table(SOURCES)
    sources.begin(table)
    pipeline = Pipeline(sources)
    for token in range(40):
        lane = pipeline.compiler.lanes(table, sources, {0: conn}, {0: 0}, "", token=("t", token))[0]
        assert len(pipeline.compiler._cache) <= 8 and lane.rows
    assert pipeline.compiler.compiles == 40
    await _close(src, dst, conn)


def test_a_lane_s_checksums_go_out_as_columns_without_an_object_per_row():
    """``LaneReport`` keeps a lane's checksums as two lists and ``summaries`` hands them to the wire as
    ``Rows`` (protocol 3.0: ``WriteSummary.checksums`` is ``columns[Checksum]``): equal to the tuple of
    Checksums, encoded column by column, decoded back to the same values."""
    from weightsync.engine.datapath.lanes import LaneReport, PushReport
    from weightsync.wire import Envelope, decode, encode
    from weightsync.wire import messages as m
    from weightsync.wire.columns import Rows

    lane = LaneReport(count=3, nbytes=12)
    lane.add_checksums([0, 2], [5, 2**64 - 1])
    lane.add_checksums((7,), (0,))
    (summary,) = PushReport({1: lane}, 0.0).summaries()
    assert type(summary.checksums) is Rows
    assert summary.checksums == (m.Checksum(0, 5), m.Checksum(2, 2**64 - 1), m.Checksum(7, 0))
    env = decode(encode(Envelope(m.WritesDone(1, 1, (summary,), 0.0, 0.0), 1, "sender/0")))
    assert [(c.index, c.value) for c in env.body.receivers[0].checksums] == [(0, 5), (2, 2**64 - 1), (7, 0)]
