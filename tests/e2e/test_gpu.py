"""GPU data plane, end to end in processes: each transport that can run here, bit-exact.

Run on a CUDA machine (the 2-GPU one for cross-GPU cases); skipped cleanly without CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from children import Children
from weightsync.engine.transport import TransportOptions, connect_authorized, create_transport
from weightsync.engine.transports.uccl import uccl_unavailable_reason
from proc_helpers import receiver_main, sender_main
from weightsync.roles import Controller, ControllerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WATCHDOG = 120.0
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
UCCL_TCP = TransportOptions(device="cuda:0", uccl_tcp=True)


def _cases(kinds=("cuda_ipc", "auto", "tcp"), same_gpu=("cuda_ipc", "auto", "tcp")):
    """(transport, sender device, receiver device): ``same_gpu`` on GPU 0; ``kinds`` (and uccl, where it
    runs) from GPU 0 to GPU 1 when there are two."""
    cases = [(kind, "cuda:0", "cuda:0") for kind in same_gpu]
    if TWO_GPUS:
        cases += [(kind, "cuda:0", "cuda:1") for kind in kinds]
        if uccl_unavailable_reason(UCCL_TCP) is None:
            cases.append(("uccl", "cuda:0", "cuda:1"))
    return cases


async def _three_rounds(transport: str, src: str, dst: str, mode: str, checksum: str = "", spec: str = "default"):
    """A sender and a receiver process; versions 1-3, each committed bit-exact on the receiver."""
    versions = [1, 2, 3]
    kids = Children()
    uccl_tcp = transport == "uccl"
    opts = ControllerOptions(heartbeat_s=0.2, timeout_s=30.0, checksum=checksum)
    try:
        async with Controller(senders=1, receivers=1, options=opts) as ctl:
            kids.start("sender", 0, sender_main, ctl.address, 0, versions, transport=transport, device=src,
                       uccl_tcp=uccl_tcp, spec=spec)
            kids.start("receiver", 0, receiver_main, ctl.address, 0, versions, mode=mode, transport=transport,
                       device=dst, uccl_tcp=uccl_tcp, spec=spec)
            await kids.expect("joined", 2)
            for v in versions:
                for _, role, _, data in await kids.expect("committed", 2):
                    if role == "receiver":
                        assert data == (v, v, []), f"{transport} {src}->{dst} {mode}: {data}"
                assert (await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)).ok
            [(_, _, _, swaps)] = await kids.expect("swaps")
            if mode == "shadow" and transport in ("cuda_ipc", "uccl"):  # regions that are their memory: every
                assert swaps == len(versions)  # commit exchanges the GPU buffers' memory, none rebinds
    finally:
        kids.close()


@pytest.mark.parametrize("transport,src,dst", _cases())
@pytest.mark.parametrize("mode", ["shadow", "inplace"])
async def test_gpu_round_trip_bit_exact(transport, src, dst, mode):
    """With checksums: every row staged (checksums need the bytes on the sender)."""
    await _three_rounds(transport, src, dst, mode, checksum="sum64")


@pytest.mark.parametrize("transport,src,dst", _cases(kinds=("cuda_ipc", "auto"), same_gpu=("cuda_ipc", "tcp")))
@pytest.mark.parametrize("mode", ["shadow", "inplace"])
async def test_moe_shaped_compiled_rounds_bit_exact(transport, src, dst, mode):
    """Hundreds of per-expert tensors and the odd ones (unaligned, empty, scalar, a non-contiguous view
    staged beside them), no checksum: the compiled replay (one copy kernel launch on one GPU, batch calls
    across GPUs, frames over TCP), three versions."""
    await _three_rounds(transport, src, dst, mode, spec="moe")


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "ipc-shared"])
def test_gpu_storages_exchange_memory(shared):
    """On this torch (with or without the binding) two CUDA storages exchange memory: views see the
    other's bytes, IPC-shared storages (their DataPtr wrapped for torch's IPC reference counts) too, and
    both blocks free cleanly afterwards."""
    from weightsync.engine.datapath.exchange import memory_exchange

    do = memory_exchange(torch.device("cuda:0"))
    assert do is not None, "no way to exchange CUDA storages: a shadow receiver would rebind per tensor"
    a = torch.full((1 << 20,), 1.0, device="cuda:0")
    b = torch.full((1 << 20,), 2.0, device="cuda:0")
    if shared:
        a.untyped_storage()._share_cuda_()
        b.untyped_storage()._share_cuda_()
    view = a[-4:]
    pa, pb = a.data_ptr(), b.data_ptr()
    do(a.untyped_storage(), b.untyped_storage())
    assert a.data_ptr() == pb and b.data_ptr() == pa and view.tolist() == [2.0] * 4
    a.add_(1)
    assert b[0].item() == 1.0 and view.tolist() == [3.0] * 4
    del a, b, view
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


async def test_forced_transport_that_cannot_run_says_what_is_missing():
    if uccl_unavailable_reason(TransportOptions(device="cuda:0")) is not None:
        with pytest.raises(Exception, match="uccl"):
            create_transport("uccl", TransportOptions(device="cuda:0"))


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
async def test_ipc_write_in_process_and_out_of_bounds():
    from weightsync.wire import PeerInfo

    tgt, src = create_transport("cuda_ipc", TransportOptions(device="cuda:1")), create_transport("cuda_ipc")
    info = await tgt.start(1)
    await src.start(0)
    region = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:1")
    rinfo = tgt.register(0, region)
    conn = await connect_authorized(src, tgt, PeerInfo(1, info, (rinfo,)))
    data = torch.randint(0, 255, (4096,), dtype=torch.uint8, device="cuda:0")
    await conn.write(data, 0, 512, 1)
    await conn.fence()
    assert torch.equal(region[512:512 + 4096].cpu(), data.cpu())
    with pytest.raises(Exception, match="out of bounds"):
        await conn.write(data, 0, (1 << 20) - 10, 1)
    await conn.close()
    await src.close()
    await tgt.close()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
async def test_ipc_connections_copy_on_their_own_streams_and_prove_with_their_own_events():
    """A colocated sender's two connections (its own GPU's receiver, the other GPU's) queue on streams of
    their own, and each seal's proof is its lane's event: a proof completes once its own copies have."""
    from weightsync.engine.transports.cuda_ipc import PROOF
    from weightsync.wire import PeerInfo

    src = create_transport("cuda_ipc", TransportOptions(device="cuda:0"))
    await src.start(0)
    targets, conns, regions = [], [], []
    for rank, device in ((1, "cuda:0"), (2, "cuda:1")):
        tgt = create_transport("cuda_ipc", TransportOptions(device=device))
        info = await tgt.start(rank)
        regions.append(torch.zeros(64 << 20, dtype=torch.uint8, device=device))
        conns.append(await connect_authorized(src, tgt, PeerInfo(rank, info, (tgt.register(0, regions[-1]),))))
        targets.append(tgt)
    a, b = conns
    assert a.lane != b.lane
    streams = src.copies.stream
    assert {id(streams(0, a.lane, i)) for i in (0, 1)}.isdisjoint({id(streams(0, b.lane, i)) for i in (0, 1)})
    data = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    done = [a.submit(data, 0, 0, 1), b.submit(data, 0, 0, 1)]
    proofs = [conn.seal() for conn in conns]
    assert PROOF.unpack(proofs[0])[3] != PROOF.unpack(proofs[1])[3]  # (two events, one per lane)
    for tgt, rank, proof in zip(targets, (1, 2), proofs):
        assert await tgt.await_proofs({0: proof}, 30) == {}  # (checked by the target that opens the event)
    await asyncio.gather(*done)
    for region in regions:
        assert torch.equal(region.cpu(), data.cpu())
    for conn in conns:
        await conn.close()
    for t in (src, *targets):
        await t.close()


PEER_MODES = {  # (pitched_kernel, peer_copies) -> the launch a pitched block gets (same GPU, another GPU)
    (True, "kernel"): ("PitchedKernel", "PitchedKernel"),
    (True, "dma"): ("PitchedKernel", "PitchedCopies"),
    (True, "fastest"): ("PitchedKernel", "FastestLaunch"),
    (False, "fastest"): ("PitchedCopies", "PitchedCopies"),
}


@pytest.mark.parametrize("dst", ["cuda:0", "cuda:1"])
@pytest.mark.parametrize("mode", list(PEER_MODES), ids=["kernel", "dma", "fastest", "cudaMemcpy2DAsync"])
async def test_ipc_pitched_rows_land_back_to_back(dst, mode):
    """Compiled pitched rows (blocks: some columns of a rank's rows) beside a dense row, on the same GPU
    and into another, each way cuda_ipc copies them (a descriptor-table kernel, into another GPU storing
    into its mapped memory; the copy engines; the faster of both, timed on the replays; a
    cudaMemcpy2DAsync each), replayed until "fastest" has chosen: the columns land back to back,
    bit-exact, every time; an odd-width block (not 4-byte aligned) goes as a 2-D copy."""
    from weightsync.engine.datapath.compiled import CopyRow, pitch_of
    from weightsync.wire import PeerInfo

    if dst == "cuda:1" and not TWO_GPUS:
        pytest.skip("needs two GPUs")
    tgt = create_transport("cuda_ipc", TransportOptions(device=dst))
    src = create_transport("cuda_ipc", TransportOptions(device="cuda:0", pitched_kernel=mode[0], peer_copies=mode[1]))
    info = await tgt.start(1)
    await src.start(0)
    region = torch.zeros(1 << 20, dtype=torch.uint8, device=dst)
    conn = await connect_authorized(src, tgt, PeerInfo(1, info, (tgt.register(0, region),)))
    full = torch.randn(960, 2000, device="cuda:0", dtype=torch.bfloat16)
    block, dense, odd = full[10:170, 40:1104], full[800:810], full[200:240, 3:70]
    blocks = [(block, 65536), (odd, 65536 + block.numel() * 2)]  # (after the dense row's 40,000 bytes)
    rows = [CopyRow(n, b, 0, at, b.numel() * 2, *pitch_of(b)) for n, (b, at) in zip("wo", blocks)]
    table = conn.compile([*rows, CopyRow("d", dense, 0, 0, dense.numel() * 2)])
    expected = PEER_MODES[mode][dst != "cuda:0"]
    assert type(table.launches[0][1]).__name__ == expected, table.launches
    for epoch in range(1, 9):
        region.zero_()
        full.add_(1)  # new bytes each replay
        await asyncio.gather(*conn.replay(table, epoch))
        await conn.fence()
        for b, at in blocks:
            got = region[at:at + b.numel() * 2].view(torch.bfloat16).view(b.shape)
            assert torch.equal(got.cpu(), b.cpu()), (epoch, [launch for _, launch in table.launches])
        assert torch.equal(region[:dense.numel() * 2].cpu(), dense.contiguous().view(torch.uint8).flatten().cpu())
    if expected == "FastestLaunch":
        chosen = {launch.link: launch.choice for _, launch in table.launches}
        assert all(c in ("kernel", "dma") for c in chosen.values()), chosen
        assert set(src.choices) == set(chosen), (src.choices, chosen)
    await conn.close()
    await src.close()
    await tgt.close()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
@pytest.mark.parametrize("one_call", [True, False], ids=["cudaMemcpyBatchAsync", "one-by-one"])
async def test_ipc_batch_of_rows_lands_bit_exact(monkeypatch, one_call):
    from weightsync.engine.cuda import cuda_rt
    from weightsync.wire import PeerInfo

    if one_call and not cuda_rt.batch_copies():
        pytest.skip(f"CUDA runtime {cuda_rt.runtime_version()} has no cudaMemcpyBatchAsync")
    monkeypatch.setattr(cuda_rt, "_batch_refused", not one_call)
    tgt, src = create_transport("cuda_ipc", TransportOptions(device="cuda:1")), create_transport("cuda_ipc")
    info = await tgt.start(1)
    await src.start(0)
    region = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:1")
    conn = await connect_authorized(src, tgt, PeerInfo(1, info, (tgt.register(0, region),)))
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    sizes, offsets, at = (1, 7, 4096, 0, 300_001, 513), [], 3
    for n in sizes:  # odd sizes at odd offsets, a zero-byte row among them
        offsets.append(at)
        at += n + 5
    rows = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0", generator=gen) for n in sizes]
    with pytest.raises(Exception, match="out of bounds"):  # checked before anything is queued
        conn.submit_many([(rows[0], 0, 0, None), (rows[1], 0, (1 << 20) - 3, None)], 1)
    assert conn.sent_count == 0
    ops = conn.submit_many([(r, 0, off, None) for r, off in zip(rows, offsets)], 1)
    await asyncio.wait_for(asyncio.gather(*ops), WATCHDOG)
    got = region.cpu()
    assert all(torch.equal(got[off:off + r.numel()], r.cpu()) for r, off in zip(rows, offsets))
    assert int(got[:3].sum()) == 0 and (conn.sent_count, conn.sent_bytes) == (len(rows), sum(sizes))
    await conn.close()
    await src.close()
    await tgt.close()


def test_fp64_fingerprints_of_many_rows_in_one_launch_equal_each_row_s():
    """``fp64_many``'s kernel (engine.cuda.fp64_kernel) on dense, pitched, odd-length and unaligned rows,
    small and past one chunk, on each GPU and from a worker thread as receivers call it: each equals the
    torch reference row by row, bit for bit, and the kernel ran (no fallback)."""
    import concurrent.futures

    from weightsync.engine.datapath import checksums

    gen = torch.Generator().manual_seed(11)
    views = []
    for device in ["cuda:0", "cuda:1"] if TWO_GPUS else ["cuda:0"]:
        flat = torch.randint(0, 256, (3 * 1024 * 1024 + 5,), generator=gen, dtype=torch.uint8).to(device)
        grid = flat[:1000 * 3000].view(1000, 3000)
        views += [flat, flat[1:], flat[3:70001], flat[:3], grid[:, 7:1007], grid[::2, :100], grid[5:6, 1:2999],
                  grid.view(torch.int32)[:, 3:500], flat[:0]]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        got = pool.submit(checksums.fp64_many, views).result()
    assert not checksums._KERNEL_FAILED, checksums._KERNEL_FAILED
    assert got == [checksums.fp64(v.contiguous().reshape(-1).view(torch.uint8)) for v in views]
    assert checksums.fp64_many(views) == got  # (again: the prepared launch, kept)


def test_fp64_launches_on_two_streams_read_late_each_give_their_own_sums():
    """A prepared ``Fingerprints`` keeps its partial sums, sums and host buffers: two launches on two
    streams, the first read only after the second was queued (and the data changed between them), each
    give the sums of the bytes they were launched over; a third launch reuses a buffer read before."""
    from weightsync.engine.cuda.fp64_kernel import Fingerprints
    from weightsync.engine.datapath.checksums import _bytes, _range, fp64

    gen = torch.Generator().manual_seed(12)
    rows = [torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32).to("cuda:0")
            for n in (5, 70000, 3 * 1024 * 1024)]
    prints = Fingerprints(tuple(_range(r) for r in rows), torch.device("cuda:0"))
    first_stream, second_stream = torch.cuda.Stream(0), torch.cuda.Stream(0)
    first_stream.wait_stream(torch.cuda.current_stream(0))
    before = [fp64(_bytes(r)) for r in rows]
    first = prints.launch(first_stream)
    with torch.cuda.stream(first_stream):  # (after the first launch on its stream, before the second)
        for r in rows:
            r.add_(1)
    second_stream.wait_stream(first_stream)
    second = prints.launch(second_stream)
    torch.cuda.synchronize()
    after = [fp64(_bytes(r)) for r in rows]
    assert before != after
    assert prints.values(second[0]) == after and prints.values(first[0]) == before
    assert prints.run() == after and prints._free  # (a read buffer is used again)


def test_fp8_quantization_on_gpu_within_the_reference_bound():
    from weightsync.engine.transforms import quantize_blocks, within_fp8_bound

    g = torch.Generator(device="cuda:0").manual_seed(3)
    x = (torch.randn(1000, 777, generator=g, device="cuda:0") * 3).to(torch.bfloat16)
    q, s = quantize_blocks(x)
    q_cpu, s_cpu = quantize_blocks(x.cpu())
    assert torch.allclose(s.cpu(), s_cpu, rtol=2e-7, atol=0)  # the GPU's division may differ in the last bit
    assert within_fp8_bound(x, q, s)


def test_fp8_kernel_quantizes_many_strided_tensors_in_one_launch():
    from weightsync.engine.transforms import Quantizer, quantize_blocks, within_fp8_bound

    g = torch.Generator(device="cuda:0").manual_seed(4)
    base = (torch.randn(700, 390, generator=g, device="cuda:0") * 2).to(torch.bfloat16)
    xs = [base, base.t(), base[100:356, 7:300], torch.zeros(3, 5, dtype=torch.bfloat16, device="cuda:0"),
          (torch.randn(256, 128, generator=g, device="cuda:0") * 1e-4).to(torch.bfloat16)]
    quantizer = Quantizer()
    got = quantizer.many(xs, 128)
    assert quantizer.fallback is None and quantizer.launches == 1, quantizer.fallback
    for x, (q, s) in zip(xs, got):
        q_ref, s_ref = quantize_blocks(x)
        assert q.shape == x.shape and q.is_contiguous() and s.shape == s_ref.shape
        assert torch.allclose(s, s_ref, rtol=2e-7, atol=0)
        assert within_fp8_bound(x, q, s)
        assert (q.float() == q_ref.float()).float().mean() > 0.999  # (the division may round differently)
    for round_ in range(2):  # a group quantized every round: prepared once, then only launched
        base.mul_(1.5)  # new values in the same storage
        again = quantizer.many(xs, 128, reuse="group")
        for x, (q, s) in zip(xs, again):
            assert torch.allclose(s, quantize_blocks(x)[1], rtol=2e-7, atol=0) and within_fp8_bound(x, q, s)
    assert len(quantizer._batches) == 1 and quantizer.launches == 3 and quantizer.fallback is None


@pytest.mark.parametrize("dst", ["cuda:0", "cuda:1"] if TWO_GPUS else ["cuda:0"])
def test_fp8_kernel_writes_its_outputs_to_given_addresses(dst):
    """A batch made with destinations stores there (here a peer GPU's tensors when there are two):
    the same bytes as the buffered batch, nothing returned."""
    from weightsync.engine.cuda import cuda_rt
    from weightsync.engine.transforms.fp8_kernel import Batch

    g = torch.Generator(device="cuda:0").manual_seed(5)
    base = (torch.randn(700, 390, generator=g, device="cuda:0") * 3).to(torch.bfloat16)
    xs = [base, base.t(), base[100:356, 7:300], torch.randn(256, 512, generator=g, device="cuda:0").to(torch.bfloat16)]
    want = Batch(xs, 128).run()
    if dst != "cuda:0":
        assert cuda_rt.enable_peer_access(0, torch.device(dst).index)
    qs = [torch.full(q.shape, 7, dtype=torch.uint8, device=dst) for q, _ in want]
    ss = [torch.full(s.shape, -1.0, dtype=torch.float32, device=dst) for _, s in want]
    batch = Batch(xs, 128, [(q.data_ptr(), s.data_ptr()) for q, s in zip(qs, ss)])
    assert batch.run() == [] and batch.q_total == 0
    torch.cuda.synchronize(0)
    for (q_want, s_want), q, s in zip(want, qs, ss):
        assert torch.equal(q.cpu(), q_want.view(torch.uint8).cpu()) and torch.equal(s.cpu(), s_want.cpu())


async def test_cpu_held_sources_are_quantized_on_the_gpu():
    """CPU-offloaded trainer weights with ``quantize_on``: each source slice is copied to the GPU and
    quantized there by the kernel (not eagerly on the CPU), within the FP8 bound at the receiver."""
    from weightsync.engine.transforms.layouts import FP8Policy, allocate, receiver_layout
    from weightsync.engine.dtypes import dtype_name
    from layout_oracle import check_fp8_receiver, expected_qwen2, qwen2_state
    from weightsync.roles import ReceiverOptions, SenderOptions, WeightReceiver, WeightSender

    src = {k: v.to(torch.bfloat16) for k, v in qwen2_state().items()}  # on the CPU
    shapes = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in src.items()}
    layout = receiver_layout(shapes, "qwen2", fp8=FP8Policy())
    dst = "cuda:1" if TWO_GPUS else "cuda:0"
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=30.0, mapping="qwen2")
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        sender = WeightSender(ctl.address, src, rank=0,
                              options=SenderOptions(transport="cuda_ipc", quantize_on="cuda:0"))
        receiver = WeightReceiver(ctl.address, allocate(layout, dst)[0], rank=0,
                                  options=ReceiverOptions(transport="cuda_ipc"))
        async with sender, receiver:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            await asyncio.wait_for(await sender.push(1), WATCHDOG)
            await asyncio.wait_for(receiver.wait_for(1), WATCHDOG)
            state = {k: v.cpu() for k, v in receiver.state_dict().items()}
            assert check_fp8_receiver(state, lambda n: expected_qwen2(src, n))
            quantizer = sender.sources.transforms.quantizer
            assert quantizer.fallback is None and quantizer.launches > 0  # the kernel ran: on the GPU
            assert all(v.device.type == "cpu" for v in sender.tensors.values())
            assert sender.pipeline.budget.in_use == 0  # the copies to the GPU were charged and given back


@pytest.mark.parametrize("checksum", ["crc32", "", "fp64"], ids=["checksums", "device-ordered", "fingerprinted"])
@pytest.mark.parametrize("dst", ["cuda:0", "cuda:1"] if TWO_GPUS else ["cuda:0"])
async def test_fused_tp_and_fp8_transforms_on_the_sender_gpu(dst, checksum):
    from weightsync.engine.transforms.layouts import FP8Policy, TensorParallel, receiver_layout
    from weightsync.engine.dtypes import dtype_name
    from layout_oracle import check_fp8_receiver, expected_qwen2, qwen2_state

    src = {k: v.to("cuda:0") for k, v in qwen2_state().items()}
    shapes = {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in src.items()}
    tp = TensorParallel(1, 2)
    layouts = [receiver_layout(shapes, "qwen2", tp=tp), receiver_layout(shapes, "qwen2", fp8=FP8Policy())]
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=30.0, checksum=checksum, mapping="qwen2")
    async with Controller(senders=1, receivers=2, options=opts) as ctl:
        async with _over_cuda_ipc(ctl, src, layouts, dst) as (sender, receivers):
            for version in (1, 2):  # the second round reuses the prepared launches (written in place too)
                if version == 2:
                    for v in src.values():
                        v.mul_(-1.5)
                await asyncio.wait_for(await sender.push(version), WATCHDOG)
                for r in receivers:
                    await asyncio.wait_for(r.wait_for(version), WATCHDOG)
                cpu_src = {k: v.cpu() for k, v in src.items()}
                for name, got in receivers[0].state_dict().items():
                    assert torch.equal(got.cpu(), expected_qwen2(cpu_src, name, tp)), name
                state = {k: v.cpu() for k, v in receivers[1].state_dict().items()}
                assert check_fp8_receiver(state, lambda n: expected_qwen2(cpu_src, n))
            written = sender.sources.transforms.written  # stored in the receiver, checked (fp64) or not; crc32
            assert (written > 0) == (checksum != "crc32"), written  # needs the bytes on the sender: staged
            assert sender.sources.transforms.quantizer.fallback is None  # (the kernel ran, every variant)


@pytest.mark.parametrize("dests", [False, True], ids=["buffer", "in-place"])
def test_the_fp8_kernel_stores_and_fingerprints_what_it_quantizes_on_the_gpu(dests):
    """``fp8_kernel.Batch(fingerprint=True)`` compiled, as tests/engine/transforms/test_fp8_prints.py checks
    it under Triton's interpreter: it stores exactly the bytes the plain kernel does (the reference
    quantizer's), and its fingerprints of each FP8 weight and scales row equal ``fp64`` of the bytes it
    wrote. (On an H200 with Triton 3.6, a kernel fingerprinting its FP8 registers bitcast to bytes broke
    both, for 16-aligned tensors: the kernel reads what it stored back instead.)"""
    from weightsync.engine.datapath.checksums import _bytes, fp64
    from weightsync.engine.transforms import fp8_kernel, quantize_blocks

    g = torch.Generator(device="cuda:0").manual_seed(0)
    xs = [(torch.randn(*shape, generator=g, device="cuda:0") * 0.02).to(torch.bfloat16)
          for shape in [(512, 512), (1024, 512), (512, 1024), (300, 260), (3584, 3584)]]
    outs = [(torch.zeros(x.shape, dtype=torch.float8_e4m3fn, device="cuda:0"),
             torch.zeros(-(-x.shape[0] // 128), -(-x.shape[1] // 128), device="cuda:0")) for x in xs]
    batch = fp8_kernel.Batch(xs, 128, [(q.data_ptr(), s.data_ptr()) for q, s in outs] if dests else None,
                             fingerprint=True)
    out = batch.run() or outs
    plain = fp8_kernel.Batch(xs, 128).run()
    torch.cuda.synchronize()
    for (q, s), (q0, s0), x in zip(out, plain, xs):
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0), x.shape
        assert torch.equal(q.view(torch.uint8), quantize_blocks(x)[0].view(torch.uint8)), x.shape
    want = [(fp64(_bytes(q.contiguous())), fp64(_bytes(s.contiguous()))) for q, s in out]
    assert fp8_kernel.fingerprints(batch.prints) == want


async def test_fused_experts_quantized_matrix_by_matrix_by_the_kernel():
    """Stacks of expert matrices (vLLM's fused MoE w13 / w2) into block-FP8 receivers over cuda_ipc, an
    expert-parallel one (experts 2:4) and one holding rows 128:256 of every w13 matrix (a strided
    source): the kernel quantizes them as their 2-D views, each matrix on its own grid, within the FP8
    bound and with the reference quantizer's scales, and stores them straight into the receivers."""
    from weightsync.engine.transforms import quantize_blocks
    from weightsync.engine.transforms.layouts import LayoutEntry
    from weightsync.wire import ShardSpec
    from layout_oracle import check_fp8_receiver

    g = torch.Generator(device="cuda:0").manual_seed(8)
    src = {"experts.w13_weight": (torch.randn(4, 256, 384, generator=g, device="cuda:0") * 2).to(torch.bfloat16),
           "experts.w2_weight": torch.randn(4, 128, 256, generator=g, device="cuda:0").to(torch.bfloat16)}
    fp8, f32 = "float8_e4m3fn", "float32"

    def stack(name, full, dim, start, stop):
        shard = ShardSpec(full, dim, start, stop)
        *lead, rows, cols = shard.local_shape()
        return [LayoutEntry(name, fp8, shard.local_shape(), shard),
                LayoutEntry(name + "_scale_inv", f32, (*lead, rows // 128, -(-cols // 128)), None)]

    layouts = [stack("experts.w13_weight", (4, 256, 384), 0, 2, 4) + stack("experts.w2_weight", (4, 128, 256), 0, 2, 4),
               stack("experts.w13_weight", (4, 256, 384), 1, 128, 256)
               + stack("experts.w2_weight", (4, 128, 256), 0, 0, 4)]
    wants = [lambda n: src[n][2:4].cpu(), lambda n: src[n][:, 128:256].cpu() if "w13" in n else src[n].cpu()]
    dst = "cuda:1" if TWO_GPUS else "cuda:0"
    # (no end-to-end check either: a checked round reads the bytes on the sender, so it stages them)
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=30.0, full_check_every=0)
    async with Controller(senders=1, receivers=2, options=opts) as ctl:
        async with _over_cuda_ipc(ctl, src, layouts, dst) as (sender, receivers):
            await asyncio.wait_for(await sender.push(1), WATCHDOG)
            for r in receivers:
                await asyncio.wait_for(r.wait_for(1), WATCHDOG)
            for r, want in zip(receivers, wants):
                state = {k: v.cpu() for k, v in r.state_dict().items()}
                assert sorted(check_fp8_receiver(state, want)) == ["experts.w13_weight", "experts.w2_weight"]
                for name in ("experts.w13_weight", "experts.w2_weight"):
                    assert torch.allclose(state[name + "_scale_inv"], quantize_blocks(want(name))[1], rtol=2e-7, atol=0)
            transforms = sender.sources.transforms
            assert transforms.quantizer.fallback is None and transforms.quantizer.launches > 0  # the kernel ran
            fp8_rows = sum("fp8" in t.transform for t in sender.table.transfers)
            assert transforms.written == fp8_rows  # no checksums: stored straight into the receivers


@contextlib.asynccontextmanager
async def _over_cuda_ipc(ctl, src: dict, layouts: list, dst: str):
    """A sender of ``src`` (rank 0) and a receiver per layout on ``dst``, over cuda_ipc, all joined."""
    from weightsync.engine.transforms.layouts import allocate
    from weightsync.roles import ReceiverOptions, SenderOptions, WeightReceiver, WeightSender

    async with contextlib.AsyncExitStack() as stack:
        sender = await stack.enter_async_context(
            WeightSender(ctl.address, src, rank=0, options=SenderOptions(transport="cuda_ipc")))
        receivers = [await stack.enter_async_context(WeightReceiver(
            ctl.address, allocate(lay, dst)[0], rank=r, shards=allocate(lay)[1],
            options=ReceiverOptions(transport="cuda_ipc"))) for r, lay in enumerate(layouts)]
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        yield sender, receivers


@pytest.mark.parametrize("dst", ["cuda:0", "cuda:1"])
async def test_back_to_back_rounds_into_a_two_slot_receiver_serve_every_version_bit_exact(dst):
    """A two-slot receiver with a delta region (the defaults) whose GPU is busy serving (100 ms of work
    queued on its stream before each push), 1 GiB of weights changed whole every step, two rounds pushed
    back to back: the version it serves after the second is the trainer's, bit for bit. Into another GPU
    nothing orders the second round's writes after the receiver's stream, so a receiver that wrote its
    landing slot at commit (a copy queued behind the serving work) would overwrite the second round's
    bytes with the first's; on one GPU the sender's copies wait for that stream anyway."""
    from weightsync.roles import ReceiverOptions, SenderOptions, WeightReceiver, WeightSender

    if dst == "cuda:1" and not TWO_GPUS:
        pytest.skip("needs two GPUs")
    g = torch.Generator(device="cuda:0").manual_seed(5)
    src = {f"layers.{i}.w": torch.randn(4096, 16384, generator=g, device="cuda:0").to(torch.bfloat16)
           for i in range(8)}  # 8 x 128 MiB
    held = {name: torch.zeros_like(t, device=dst) for name, t in src.items()}
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=30.0, full_check_every=0)
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        receiver = WeightReceiver(ctl.address, held, rank=0, options=ReceiverOptions(
            transport="cuda_ipc", transport_options=TransportOptions(device=dst)))
        sender = WeightSender(ctl.address, src, rank=0, options=SenderOptions(
            transport="cuda_ipc", transport_options=TransportOptions(device="cuda:0")))
        async with receiver, sender:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            for version in range(1, 7):
                with torch.cuda.device(dst):
                    torch.cuda._sleep(200_000_000)  # the receiver's GPU serving: ~100 ms on its stream
                for t in src.values():
                    t.mul_(-1.0078125)  # every value changes
                await asyncio.wait_for(await sender.push(version), WATCHDOG)
                if version % 2 == 0:  # (the odd round's commit, and this round's writes, behind us)
                    torch.cuda.synchronize(dst)
                    for name, t in receiver.state_dict().items():
                        assert torch.equal(t, src[name].to(dst)), (version, name)
            await asyncio.wait_for(receiver.wait_for(6), WATCHDOG)
