"""GPU transfer benchmark: a bf16 state dict, GPU 0 -> GPU 1 (or GPU 0 -> GPU 0), side by side in one run.

Models (``--model``): ``qwen2.5-7b`` (dense, 339 tensors, 15.2 GB) and ``qwen3-30b-a3b`` (MoE with
per-expert tensors, 12 of its 48 layers: 4,719 tensors, 16.2 GB). ``--colocated``: the sender and
receiver processes share GPU 0 (trainer and inference on one GPU); the bound is then one
device-to-device copy of the same bytes and there is no NCCL row (NCCL refuses two ranks on one GPU).
Rows: the bound (one peer copy of the same byte count, one process); the same tensors copied one by
one; NCCL broadcast, one call per tensor; NCCL broadcast of 512 MiB buckets with pack and unpack (the
usual RL-framework way); UCCL ``write_ipc`` of 1 GiB buffers (bench/uccl_ipc.py); and each engine
transport through the public API (Controller, WeightSender on GPU 0 in one process, WeightReceiver on
GPU 1 in another; full rounds begin -> commit acknowledged) with its stage breakdown. ``--fp8`` adds a
bf16 trainer -> vLLM-layout block-FP8 receiver (fused qkv / gate_up, 128x128 scales made on GPU 0 on
a side stream) and quantization alone. Median of N rounds after a warm-up. Each engine row also gives
the sender's host time per tensor per round (pipeline start -> every write issued, over the tensor
count). Prints a table, writes JSON (--out); ``--json`` prints the headline figures (ratios to the
bound and the peers, paired: this run's) as one JSON object on the last line. Shapes come from the
transformers config (no download).

    python3 bench/transfer_gpu.py --rounds 5 --transports cuda_ipc,auto --fp8 --out t.json
    python3 bench/transfer_gpu.py --model qwen3-30b-a3b --colocated --transports cuda_ipc --json
    python3 bench/transfer_gpu.py --rounds 5 --transports uccl --uccl-tcp --baselines "" --out u.json   (UCCL tcp mode)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from weightsync.engine.aio import install_uvloop  # noqa: E402  (the engine processes run on uvloop, as the CLI does)
from weightsync.roles.timeline import medians  # noqa: E402

BUCKET = 512 << 20


def make_state(device: str, seed: int = 0, model: str = "qwen2.5-7b") -> dict[str, torch.Tensor]:
    from weightsync.engine.models.shapes import bench_model

    gen = torch.Generator(device=device).manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=gen, device=device, dtype=torch.bfloat16)
            for p in bench_model(model)}


# --- the bound -----------------------------------------------------------------------------------


def _timed(fn, rounds: int) -> list[float]:
    """Seconds per call of ``fn`` with both GPUs idle before and after, after one warm-up call."""
    times = []
    devices = range(torch.cuda.device_count())
    for _ in range(rounds + 1):
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        fn()
        for d in devices:
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _released(times: list[float]) -> list[float]:
    """Give the measured tensors' memory back to the driver (the engine processes need it)."""
    torch.cuda.empty_cache()
    return times


def bound_seconds(nbytes: int, rounds: int, dst: int = 1) -> list[float]:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    return _timed(lambda: b.copy_(a), rounds)  # a and b die with this frame


def per_tensor_copy_seconds(rounds: int, model: str = "qwen2.5-7b", dst_device: int = 1) -> list[float]:
    """The same state dict copied tensor by tensor on one stream: what per-tensor granularity costs."""
    src = make_state("cuda:0", model=model)
    dst = {k: torch.empty_like(v, device=f"cuda:{dst_device}") for k, v in src.items()}

    def copy_all():
        with torch.cuda.device(0):
            for k, v in src.items():
                dst[k].copy_(v, non_blocking=True)
    return _timed(copy_all, rounds)


def peer_copies(src: dict[str, torch.Tensor], dst_device: int = 1) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
    """Destinations on GPU ``dst_device`` for ``src`` (on GPU 0), peer access on, and the pointer copies
    ``(dst, src, nbytes)`` that fill them, in state-dict order."""
    from weightsync.engine.cuda import cuda_rt

    dst = {k: torch.empty_like(v, device=f"cuda:{dst_device}") for k, v in src.items()}
    if dst_device != 0:
        cuda_rt.enable_peer_access(0, dst_device)
    return dst, [(dst[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size()) for k, v in src.items()]


def pointer_copies(pairs: list[tuple[int, int, int]], streams: list[torch.cuda.Stream], batch: int = 1,
                   dst_device: int = 1):
    """A function issuing ``pairs`` from GPU 0 to GPU ``dst_device``, ``batch`` per call (one
    ``cudaMemcpyAsync`` each at 1, else ``cudaMemcpyBatchAsync``), the calls taking ``streams`` in turn."""
    from weightsync.engine.cuda import cuda_rt

    calls = [pairs[i:i + batch] for i in range(0, len(pairs), batch)]
    return lambda: [cuda_rt.memcpy_batch_async(c, streams[i % len(streams)], 0, dst_device) for i, c in enumerate(calls)]


def pointer_copy_seconds(rounds: int, streams: int = 2, batch: int = 1, model: str = "qwen2.5-7b",
                         dst_device: int = 1) -> list[float]:
    """The same tensors as raw pointer copies issued from GPU 0 on ``streams`` streams, round robin:
    one call per tensor, or (``batch`` > 1) ``batch`` tensors per ``cudaMemcpyBatchAsync`` call, a
    stream per call: the copy patterns of the engine's cuda_ipc writes without the engine (floors)."""
    src = make_state("cuda:0", model=model)
    dst, pairs = peer_copies(src, dst_device)  # (dst lives as long as the copies are timed)
    return _timed(pointer_copies(pairs, [torch.cuda.Stream(device=0) for _ in range(streams)], batch, dst_device),
                  rounds)


def quantize_seconds(rounds: int, kernel: bool) -> list[float]:
    """Block-FP8 quantization of every weight the FP8 receiver takes, alone on GPU 0 (no transfer):
    the engine's Triton kernel over the groups a round makes, or eager ``quantize_blocks`` one by one."""
    from weightsync.engine.transforms.layouts import FP8Policy
    from weightsync.engine.transforms import Quantizer, plan_quant_groups
    from weightsync.wire import Transfer

    policy = FP8Policy()
    src = {k: v for k, v in make_state("cuda:0").items() if policy.wants(k, v.dim())}
    rows = [Transfer(i, k, None, 0, k, 0, 0, v.numel(), "fp8w:128") for i, (k, v) in enumerate(src.items())]
    planned = plan_quant_groups(rows, lambda r: src[r.name]) if kernel else {}
    groups = [[view for _, view in g] for g in {id(g): g for g in planned.values()}.values()]
    grouped = {r.name for g in planned.values() for r, _ in g}
    groups += [[v] for k, v in src.items() if k not in grouped]  # the launches a round makes
    quantizer = Quantizer(use_kernel=kernel)

    def quantize_all():
        with torch.cuda.device(0):
            for group in groups:
                quantizer.many(group, 128)
    times = _timed(quantize_all, rounds)
    if kernel and quantizer.fallback:
        raise RuntimeError(f"the FP8 kernel fell back to eager: {quantizer.fallback}")
    return times


# --- NCCL baselines ------------------------------------------------------------------------------


def _nccl_rank(rank: int, port: int, rounds: int, out, model: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    state = make_state(f"cuda:{rank}", seed=0 if rank == 0 else 1, model=model)
    tensors = list(state.values())
    bucket = torch.empty(BUCKET, dtype=torch.bfloat16, device=f"cuda:{rank}")

    def per_tensor():
        for t in tensors:
            dist.broadcast(t, src=0)

    def buckets():
        i = 0
        while i < len(tensors):
            group, used = [], 0
            while i < len(tensors) and (not group or used + tensors[i].numel() <= BUCKET):
                group.append(tensors[i])
                used += tensors[i].numel()
                i += 1
            flat = bucket[:used] if used <= BUCKET else torch.empty(used, dtype=torch.bfloat16, device=f"cuda:{rank}")
            if rank == 0:
                torch.cat([t.reshape(-1) for t in group], out=flat)
            dist.broadcast(flat, src=0)
            if rank != 0:
                at = 0
                for t in group:
                    t.view(-1).copy_(flat[at:at + t.numel()])
                    at += t.numel()

    results = {}
    for name, fn in (("nccl_per_tensor", per_tensor), ("nccl_512mib_buckets", buckets)):
        times = []
        for _ in range(rounds + 1):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        results[name] = times[1:]
    if rank == 1:
        ok = all(torch.equal(t, s) for t, s in zip(tensors, make_state("cuda:1", seed=0, model=model).values()))
        out.send((results, ok))
    dist.destroy_process_group()


def nccl_baselines(rounds: int, model: str) -> tuple[dict, bool]:
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, rounds, writer, model)) for r in range(2)]
    for p in procs:
        p.start()
    results = reader.recv()
    for p in procs:
        p.join(120)
    return results


# --- the engine ----------------------------------------------------------------------------------


def fp8_layout():
    from weightsync.engine.transforms.layouts import FP8Policy, receiver_layout
    from weightsync.engine.models.shapes import state_dict_shapes

    shapes = {p.name: ("bfloat16", tuple(p.shape)) for p in state_dict_shapes("qwen2.5-7b")}
    return receiver_layout(shapes, "qwen2", fp8=FP8Policy())


def fp8_check(state: dict, want: dict) -> bool:
    """Fused names equal the concatenated sources; FP8 weights dequantize within the stated bound."""
    from weightsync.engine.plan.mapping import get_mapping
    from weightsync.engine.transforms import within_fp8_bound

    ok = True
    for name, got in state.items():
        if name.endswith("_scale_inv"):
            continue
        ref = torch.cat([want[p] for p in get_mapping("qwen2").recipe(name)[1]])
        if got.dtype == torch.float8_e4m3fn:
            ok &= within_fp8_bound(ref, got, state[name + "_scale_inv"])
        else:
            ok &= torch.equal(got, ref)
    return ok


def _engine_sender(addr: str, transport: str, rounds: int, uccl_tcp: bool, conn, profile: str = "",
                   pipeline=None, trace: str = "", spin: bool = False, model: str = "qwen2.5-7b") -> None:
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import SenderOptions, WeightSender

    install_uvloop()
    torch.cuda.set_device(0)
    state = make_state("cuda:0", model=model)
    opts = SenderOptions(transport=transport, transport_options=TransportOptions(device="cuda:0", uccl_tcp=uccl_tcp),
                         spin=spin)
    if pipeline is not None:
        opts = dataclasses.replace(opts, pipeline=pipeline)

    async def main():
        async with WeightSender(addr, state, rank=0, options=opts) as sender:
            for v in range(1, rounds + 1):
                handle = await sender.push(v)
                await handle
                pipeline_s.append(handle.report.seconds)
            timelines.update({v: sender.timeline.of(v) for v in range(2, rounds + 1)})
            written.append(sender.sources.transforms.written / rounds)
    pipeline_s: list[float] = []
    timelines: dict[int, dict] = {}
    written: list[float] = []  # rows a quantization stored straight into the receiver, per round
    _profiled(main, profile, trace)
    conn.send((pipeline_s[1:], timelines, written[0] if written else 0))


def _profiled(main, path: str, trace: str = ""):
    """Run ``main()`` on a new loop and return its result; with ``path``, under cProfile, writing the
    hottest functions there; with ``trace``, under torch.profiler (CPU and CUDA), writing a Chrome trace there."""
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = asyncio.run(main())
        prof.export_chrome_trace(trace)
        return result
    if not path:
        return asyncio.run(main())
    import cProfile

    prof = cProfile.Profile()
    result = prof.runcall(asyncio.run, main())
    write_profile(prof, path)
    return result


def write_profile(prof, path: str) -> None:
    """A cProfile's hottest functions, by own time and by cumulative time, into ``path``."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(text.getvalue())


def _engine_receiver(addr: str, transport: str, rounds: int, uccl_tcp: bool, conn, fp8: bool = False,
                     spin: bool = False, model: str = "qwen2.5-7b", device: int = 1, mode: str = "shadow") -> None:
    from weightsync.engine.transforms.layouts import allocate
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import ReceiverOptions, WeightReceiver

    install_uvloop()
    torch.cuda.set_device(device)
    here = f"cuda:{device}"
    state = allocate(fp8_layout(), here)[0] if fp8 else make_state(here, seed=1, model=model)
    opts = ReceiverOptions(transport=transport, transport_options=TransportOptions(device=here, uccl_tcp=uccl_tcp),
                           spin=spin)

    async def main():
        async with WeightReceiver(addr, state, rank=0, options=opts, mode=mode) as receiver:
            await receiver.wait_for(rounds)
            want = make_state(here, seed=0, model=model)
            ok = fp8_check(state, want) if fp8 else all(torch.equal(state[k], want[k]) for k in want)
            conn.send((ok, {v: receiver.timeline.of(v) for v in range(2, rounds + 1)}))
    asyncio.run(main())


async def engine_rounds(transport: str, rounds: int, uccl_tcp: bool, fp8: bool = False,
                        profile: str = "", pipeline=None, trace: str = "",
                        spin: bool = False, model: str = "qwen2.5-7b",
                        dst: int = 1, mode: str = "shadow") -> tuple[list, bool, list, list, float]:
    from weightsync.roles import Controller, ControllerOptions
    from weightsync.roles.timeline import merge

    ctx = mp.get_context("spawn")
    total = rounds + 1
    options = ControllerOptions(timeout_s=120.0, mapping="qwen2" if fp8 else "identity", spin=spin,
                                delta="off", full_check_every=0)  # dense rounds of the data path alone
    async with Controller(senders=1, receivers=1, options=options) as ctl:
        r_in, r_out = ctx.Pipe(duplex=False)
        s_in, s_out = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=_engine_sender, args=(ctl.address, transport, total, uccl_tcp, s_out, profile,
                                                          pipeline, trace, spin, model)),
                 ctx.Process(target=_engine_receiver, args=(ctl.address, transport, total, uccl_tcp, r_out, fp8, spin,
                                                            model, dst, mode))]
        for p in procs:
            p.start()
        reports = [await asyncio.wait_for(ctl.wait_round(v), 600) for v in range(1, total + 1)]
        ok, r_marks = await asyncio.get_running_loop().run_in_executor(None, r_in.recv)
        pipeline_s, s_marks, written = await asyncio.get_running_loop().run_in_executor(None, s_in.recv)
        for p in procs:
            p.join(120)
        timelines = []  # per measured round: [(ms since the controller started it, "role event")]
        for v in range(2, total + 1):
            marks = ctl.timeline.of(v)
            timelines.append(merge(marks["round:start"], {"controller": marks, "sender": s_marks.get(v, {}),
                                                          "receiver": r_marks.get(v, {})}))
    return reports[1:], ok, pipeline_s, timelines, written


def _pipeline(args):
    """The senders' PipelineOptions from the command line (None: the library's defaults)."""
    from weightsync.engine.datapath.pipeline import PipelineOptions

    if not args.budget_mib and not args.batch and not args.depth:
        return None
    return PipelineOptions(max_inflight_bytes=(args.budget_mib or 512) << 20, batch=args.batch or None,
                           depth=args.depth or None)


def _engine_rows(rows: dict, label: str, transport: str, args, fp8: bool = False) -> None:
    try:
        profile = f"{args.profile}/sender_{label.replace(' ', '_')}.txt" if args.profile else ""
        trace = f"{args.trace}/sender_{label.replace(' ', '_')}.json" if args.trace else ""
        reports, ok, pipeline_s, timelines, written = asyncio.run(engine_rounds(
            transport, args.rounds, args.uccl_tcp, fp8, profile, _pipeline(args), trace, args.spin, args.model, args.dst,
            args.receiver_mode))
    except Exception as exc:  # report a failing transport as such, keep measuring the others
        rows[label] = {"seconds": None, "ok": False, "error": repr(exc)[:300]}
        return
    med = statistics.median
    rows[f"{label}: full round"] = {"seconds": med(r.seconds for r in reports), "ok": ok,
                                    "bytes": med(r.nbytes for r in reports)}
    for stage in ("transfer", "fence", "commit", "sender_stage_max"):
        rows[f"{label}: {stage}"] = {"seconds": med(r.stages.get(stage, 0.0) for r in reports), "ok": ok,
                                     "stage": True}
    rows[f"{label}: sender pipeline (first stage to last write)"] = {"seconds": med(pipeline_s), "ok": ok,
                                                                     "stage": True}
    rows[f"{label}: full round"]["timeline_ms"] = medians(timelines)
    rows[f"{label}: full round"]["rounds_s"] = [r.seconds for r in reports]
    rows[f"{label}: full round"]["rows_written_in_place"] = written
    issue_ms = med(_issue_ms(rows) for rows in timelines)  # host work: the sender's pipeline until all is issued
    rows[f"{label}: sender host, pipeline start -> every write issued"] = {"seconds": issue_ms / 1e3, "ok": ok,
                                                                          "stage": True}
    rows[f"{label}: full round"]["host_us_per_tensor"] = issue_ms * 1e3 / args.tensors


def _issue_ms(timeline: list) -> float:
    """Milliseconds from the sender's pipeline start to its seal (every write issued), or to its end
    where it did not seal early."""
    at = {event: ms for ms, event in timeline}
    return at.get("sender pipeline:sealed", at["sender pipeline:end"]) - at["sender pipeline:start"]


def _baseline_rows(rows: dict, nbytes: int, args) -> float:
    bound = statistics.median(_released(bound_seconds(nbytes, args.rounds, args.dst)))
    rows["bound: one device copy" if args.colocated else "bound: one peer copy"] = {"seconds": bound, "ok": True}
    if args.bound_only:  # (a diagnostic run: a trace or a profile; no peers)
        return bound
    rows["copy_ per tensor, one stream"] = {
        "seconds": statistics.median(_released(per_tensor_copy_seconds(args.rounds, args.model, args.dst))), "ok": True}
    rows["pointer copies per tensor, 2 streams"] = {
        "seconds": statistics.median(_released(pointer_copy_seconds(args.rounds, model=args.model, dst_device=args.dst))),
        "ok": True}
    if args.colocated:  # (NCCL refuses two ranks on one GPU: the peers here are the copies above)
        return bound
    from weightsync.engine.cuda import cuda_rt
    from weightsync.engine.transports.cuda_ipc import CudaIpcConnection

    batch = args.batch or CudaIpcConnection.batch
    if cuda_rt.batch_copies() and batch > 1:
        rows[f"pointer copies, {batch} per batch call, 2 streams (engine floor)"] = {
            "seconds": statistics.median(_released(pointer_copy_seconds(args.rounds, batch=batch, model=args.model))),
            "ok": True}
    nccl, nccl_ok = nccl_baselines(args.rounds, args.model)
    for name, times in nccl.items():
        rows[name] = {"seconds": statistics.median(times), "ok": nccl_ok}
    return bound


def _uccl_row(rows: dict, nbytes: int, args) -> None:
    from uccl_ipc import write_ipc_seconds

    got = write_ipc_seconds(nbytes, args.rounds)
    rows["uccl write_ipc, 1 GiB buffers"] = (
        {"seconds": statistics.median(got["seconds"]), "ok": got["ok"]} if "seconds" in got
        else {"seconds": None, "ok": False, "error": got["error"]})


def _print(rows: dict, nbytes: int, bound: float, args) -> None:
    gb = nbytes / 1e9
    print(f"{args.model} bf16 state dict, {args.tensors} tensors, {gb:.2f} GB, GPU0 -> GPU{args.dst}"
          f"{' (colocated)' if args.colocated else ''}, median of {args.rounds} after a warm-up")
    print(f"  {'path':<44} {'ms':>9} {'GB/s':>7} {'x bound':>8}  correct")
    for name, row in rows.items():
        s = row["seconds"]
        if s is None:
            print(f"  {name:<44} {'-':>9} {'-':>7} {'-':>8}  failed: {row.get('error')}")
            continue
        if row.get("stage"):
            print(f"    {name:<42} {s * 1e3:9.2f}")
            continue
        moved = row.get("bytes", nbytes) / 1e9
        row["gbps"], row["over_bound"] = moved / s, s / bound
        print(f"  {name:<44} {s * 1e3:9.2f} {moved / s:7.1f} {s / bound:8.3f}  {'yes' if row['ok'] else 'NO'}")
    nccl = rows.get("nccl_per_tensor", {}).get("seconds")
    for name, row in rows.items():
        if nccl and row.get("seconds") and name.endswith("full round"):
            print(f"  {name}: {row['seconds'] / nccl:.3f} x NCCL per-tensor bf16 broadcast")
        if row.get("rows_written_in_place"):
            print(f"  {name}: {row['rows_written_in_place']:.0f} rows per round stored in place by the quantization")
        if row.get("host_us_per_tensor") is not None:
            print(f"  {name}: sender host time {row['host_us_per_tensor']:.2f} us per tensor per round")
    for name, row in rows.items():
        if row.get("timeline_ms"):
            print(f"  {name}, median timeline (ms since the controller started the round):")
            for event, ms in row["timeline_ms"]:
                print(f"    {ms:9.3f}  {event}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="qwen2.5-7b", help="qwen2.5-7b (dense) or qwen3-30b-a3b (MoE, per-expert "
                                                           "tensors, 12 layers: 4,719 tensors, 16.2 GB)")
    ap.add_argument("--colocated", action="store_true", help="sender and receiver processes on GPU 0; the bound is "
                                                             "one device-to-device copy of the same bytes")
    ap.add_argument("--receiver-mode", default="shadow", choices=("shadow", "inplace"),
                    help="the receiver's mode: shadow (a landing buffer, one rebinding per tensor at commit) or "
                         "inplace (writes into the live tensors between before_update and the commit)")
    ap.add_argument("--json", action="store_true", help="print the headline figures as one JSON object, last line")
    ap.add_argument("--transports", default="cuda_ipc,auto")
    ap.add_argument("--fp8", action="store_true", help="also: bf16 trainer -> fused block-FP8 receiver (cuda_ipc)")
    ap.add_argument("--baselines", default="uccl_write_ipc", help="extra baselines: uccl_write_ipc or ''")
    ap.add_argument("--uccl-tcp", action="store_true", help="run uccl in its tcp mode (no RDMA NIC here)")
    ap.add_argument("--out", default="")
    ap.add_argument("--budget-mib", type=int, default=0,
                    help="the senders' max_inflight_bytes in MiB (default: the library's, 512)")
    ap.add_argument("--batch", type=int, default=0,
                    help="rows per batch of copies (PipelineOptions.batch; default: the transport's own)")
    ap.add_argument("--depth", type=int, default=0,
                    help="writes in flight per connection (PipelineOptions.depth; default: the transport's own)")
    ap.add_argument("--profile", default="", help="a folder: cProfile each engine sender, top functions there")
    ap.add_argument("--trace", default="", help="a folder: torch.profiler Chrome trace of each engine sender")
    ap.add_argument("--bound-only", action="store_true", help="diagnostics: measure the bound but not the peers")
    ap.add_argument("--spin", action="store_true", help="controller, sender and receiver poll while a round runs "
                                                        "(ControllerOptions.spin / WorkerOptions.spin)")
    args = ap.parse_args(argv)
    if args.fp8 and args.model != "qwen2.5-7b":
        ap.error("--fp8 measures the qwen2.5-7b FP8 receiver layout: use it with --model qwen2.5-7b")
    if torch.cuda.device_count() < (1 if args.colocated else 2):
        print("needs two GPUs (one with --colocated)")
        return 0
    install_uvloop()
    from weightsync.engine.models.shapes import bench_model

    shapes = bench_model(args.model)
    args.dst, args.tensors = (0 if args.colocated else 1), len(shapes)
    nbytes = sum(2 * torch.Size(p.shape).numel() for p in shapes)
    rows: dict[str, dict] = {}
    bound = _baseline_rows(rows, nbytes, args)
    for transport in [t for t in args.transports.split(",") if t]:
        _engine_rows(rows, f"engine {transport}", transport, args)
    if args.fp8:
        for kernel in (False, True):
            label = "Triton kernel, grouped" if kernel else "eager, one by one"
            rows[f"fp8: quantize only, {label} (GPU 0)"] = {
                "seconds": statistics.median(_released(quantize_seconds(args.rounds, kernel))), "ok": True,
                "stage": True}
        _engine_rows(rows, "engine cuda_ipc fp8", "cuda_ipc", args, fp8=True)  # (qwen2.5-7b shapes)
    _print(rows, nbytes, bound, args)
    if "uccl_write_ipc" in args.baselines and not args.colocated:  # last: a UCCL hang must not cost the others
        _uccl_row(rows, nbytes, args)
        _print({k: v for k, v in rows.items() if k.startswith("uccl")}, nbytes, bound, args)
    summary = _summary(rows, bound, args)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"bytes": nbytes, "summary": summary, "rows": rows}, indent=1))
    if args.json:
        print(json.dumps(summary))
    return 0


def _summary(rows: dict, bound: float, args) -> dict:
    """The headline figures: each engine transport's full round against the bound and the peers (paired
    ratios: measured in this run), and its sender's host time per tensor."""
    out = {"bench": "transfer_gpu", "model": args.model, "tensors": args.tensors, "colocated": args.colocated,
           "receiver_mode": args.receiver_mode,
           "bound_ms": bound * 1e3}
    nccl = rows.get("nccl_per_tensor", {}).get("seconds")
    per_tensor = rows.get("copy_ per tensor, one stream", {}).get("seconds")
    for name, row in rows.items():
        if not name.endswith(": full round") or not row.get("seconds"):
            continue
        key = name[:-len(": full round")].replace("engine ", "").replace(" ", "_")
        out.update({f"{key}_ms": row["seconds"] * 1e3, f"{key}_over_bound_ratio": row["seconds"] / bound,
                    f"{key}_host_us_per_tensor": row.get("host_us_per_tensor"), f"{key}_ok": row["ok"]})
        if nccl:
            out[f"{key}_over_nccl_per_tensor_ratio"] = row["seconds"] / nccl
        if per_tensor:
            out[f"{key}_over_copy_per_tensor_ratio"] = row["seconds"] / per_tensor
    return out


if __name__ == "__main__":
    sys.exit(main())
