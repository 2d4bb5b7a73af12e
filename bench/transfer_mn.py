"""M -> N transfer benchmark: FSDP2 trainer processes -> tensor-parallel inference processes, side by side.

M trainer processes hold the model sharded by FSDP2 (``fully_shard`` over a 1-D device mesh: every
parameter a DTensor, dim-0 shards); N receiver processes each hold a vLLM-style tensor-parallel slice
(TP = N: fused qkv / gate_up, column- and row-parallel layers; ``--fp8``: the block-FP8 receiver layout).
One process per GPU (``--device cuda``): disaggregated, trainers on GPUs 0..M-1 and receivers on
M..M+N-1; ``--colocated``, trainer i and receiver i share GPU i. On the CPU (``--device cpu``) every
process is a CPU process and the data plane is loopback TCP: the same code path, small models.

Rows, measured in one run:
- **bound**: the planner's lower bound (``engine.plan.model.lower_bound``: the busiest port's bytes,
  with every port class of a receiver running at once) with the bandwidths measured here: one NVLink
  peer copy GPU 0 -> 1 (across GPUs), one device-to-device copy on GPU 0 (the colocated share), or one
  loopback TCP stream (CPU). A receiver must take in its slice; a trainer must send what only it holds.
- **quantize bound** (``--fp8`` on CUDA): the least time the busiest sender needs to quantize its share on its GPU,
  reading the bf16 source and writing the FP8 weight at the measured device copy rate
  (``quantize_bound``): ``bound`` counts only the FP8 bytes that move.
- **predicted**: the planner's modeled makespan of the routing table the controller installed, under
  the same measured bandwidths.
- **learned**: the controller's own prediction of each measured round, made before it from the
  rounds before (``roles.costs``: the plan's makespan with the per-row host cost the senders reported,
  plus the per-round cost the model missed so far): ``learned_predicted_ms``, ``learned_over_engine_ratio``
  (median of prediction / round) and ``learned_worst_error`` (the worst |prediction / round - 1|).
- **engine**: full rounds through the public API (Controller in this process; WeightSender on each
  FSDP2 rank; WeightReceiver on each TP rank; begin -> commit acknowledged), median (``engine_ms``) and
  mean (``engine_mean_ms``) of the rounds after the first two (each landing slot's first: it registers,
  opens and compiles; ``first_rounds_ms``), with the product's checks (``--full-check-every 8``: every
  8th round reads the model on both sides; ``checked_rounds`` counts them; ``checked_ms_all`` are the
  steady checked rounds, ``first_checks_ms`` each landing slot's first check, which builds its
  fingerprint tables; ``period_over_unchecked_ratio``: a check period's mean round over the unchecked
  median, what the default checks cost on average). Bit-exact against tensors built here with plain
  torch (cat, chunk) from the same seeds; FP8 weights within the block-FP8 error bound.
- **broadcast**: what verl / slime do: trainer rank 0 broadcasts every full tensor, one collective per
  tensor, to every inference rank (NCCL on GPUs, gloo on the CPU), which keeps its TP slice (a copy).
  Rank 0 is handed full tensors for free (no FSDP gather is timed): the baseline's best case. With
  ``--colocated`` the broadcaster also serves receiver 0 by a local copy (NCCL refuses two ranks of one
  communicator on one GPU; colocated frameworks share that process). **bucketed**: the same, the
  tensors packed into 512 MiB buckets first, one broadcast a bucket (verl and slime's way). With
  ``--fp8`` each inference rank then quantizes the bf16 it was sent into its block-FP8 weights, as
  vLLM does on load, inside the timed round, and is checked like the engine's receivers.
- **checkpoint-engine** (``--ckpt``, CUDA): the peer a vLLM user picks, on the receivers' GPUs in
  broadcast mode, plain torch inference processes receiving through its ``update_weights_from_ipc``
  (bench/peer_ckpt.py): ``ckpt_step_ms`` (copying the new weights into its pinned buffers, then
  ``update``) and ``ckpt_update_ms``; ``engine_over_ckpt_ratio`` is the engine's round over its step.

Every run also measures the back-to-back control round trip between two processes
(bench/diagnostics/control_hops.py): ``control_rtt_ms`` and ``engine_over_rtt``; with ``--model empty``
(one 64-value tensor: a round of control messages, nothing to move) that is ``empty_round_over_rtt``.
``--one-gpu`` puts every rank of such a colocated empty round on GPU 0 (gloo for the trainers' group): an
M -> N round's control path measured where one GPU is lent.

Models: ``tiny-dense`` / ``tiny-moe`` (Qwen2 / Qwen3-MoE configs small enough for a CPU), ``qwen2.5-0.5b``,
``qwen2.5-7b`` and ``qwen3-30b-a3b`` (12 layers, per-expert tensors; engine.models.shapes.bench_model).
``--json`` prints the figures as one JSON object on the last line (paired ratios under ``*ratio*``).

    .venv/bin/python bench/transfer_mn.py --device cpu --senders 2 --receivers 2 --model tiny-dense --json
    python3 bench/transfer_mn.py --senders 4 --receivers 4 --model qwen2.5-7b            (x8: GPUs 0-3 -> 4-7)
    python3 bench/transfer_mn.py --senders 2 --receivers 2 --colocated --model qwen2.5-7b --ckpt
    python3 bench/transfer_mn.py --senders 8 --receivers 8 --colocated --model qwen3-30b-a3b --fp8
    python3 bench/transfer_mn.py --senders 2 --receivers 2 --colocated --model empty --one-gpu --no-broadcast
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Optional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from mn_setup import (  # noqa: E402  (the case, the model and its oracle, processes: bench/mn_setup.py)
    MAPPING, WATCHDOG_S, Case, Procs, _init_dist, free_port, fsdp_model, full_tensor, fused_parts, measured_link,
    mismatches, model_shapes, receiver_layout, tp_part,
)
from transfer_gpu import write_profile  # noqa: E402

BUCKET = 512 << 20  # the bucketed broadcast's bucket (verl, slime)
WARM_ROUNDS = 2  # rounds not counted: each landing slot's first
PROFILE: Optional[cProfile.Profile] = None  # (--profile: this process's, on while the counted rounds run)


def _steady(on: bool) -> None:
    """The counted rounds start (``on``) or are over: this process's profile, if any, runs meanwhile."""
    if PROFILE is not None:
        PROFILE.enable() if on else PROFILE.disable()


@contextlib.contextmanager
def _profiling(path: str):
    """With ``path``: this process's profile (``PROFILE``), on while the counted rounds run (``_steady``),
    its hottest functions written there at the end."""
    global PROFILE
    if not path:
        yield
        return
    PROFILE = cProfile.Profile()
    try:
        yield
    finally:
        PROFILE.disable()
        write_profile(PROFILE, path)


def _profiled(main, path: str):
    """Run ``main()`` on a new loop, under ``_profiling(path)``."""
    with _profiling(path):
        return asyncio.run(main())


# --- engine processes ------------------------------------------------------------------------------


def _settled(ready) -> None:
    """This process's background start-up work is done (the compiled CPU delta kernels loading, which
    holds the GIL: rounds in its ~0.5 s run slower, ``delta_cpu.warmed``), and every engine process's is:
    ``ready`` is a barrier of them all. The counted rounds measure steady rounds, not a member's start."""
    from weightsync.engine.transforms import delta_cpu

    delta_cpu.warmed(WATCHDOG_S)
    ready.wait(WATCHDOG_S)


def _engine_sender(case: Case, rank: int, addr: str, port: int, ready, conn) -> None:
    import torch.distributed as dist

    from weightsync.engine.aio import install_uvloop
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import SenderOptions, WeightSender
    from weightsync.roles.timeline import push_wait

    install_uvloop()
    _init_dist(case, case.sender_device(rank), rank, case.senders, port)
    model = fsdp_model(case, rank)
    opts = SenderOptions(transport=case.transport, spin=case.spin, transport_options=TransportOptions(
        device=case.sender_device(rank), pitched_kernel=case.pitched_kernel, peer_copies=case.peer_copies,
        **({"kernel_grid": case.kernel_grid} if case.kernel_grid is not None else {})))

    trying: dict[int, bool] = {}

    async def main():
        async with WeightSender(addr, model, rank=rank, options=opts) as sender:
            await asyncio.to_thread(_settled, ready)
            for v in range(1, case.rounds + 1):
                if v == WARM_ROUNDS + 1:
                    _steady(True)
                with torch.no_grad():
                    for p in model.parameters():  # a training step: every rank updates its own shards
                        p.to_local().add_(1)
                if case.device == "cuda":
                    torch.cuda.synchronize()
                with torch.profiler.record_function(f"round v{v}"):  # (marks the round in --trace; no cost otherwise)
                    await (await sender.push(v))
                trying[v] = bool(getattr(sender.transport, "trying", ()))  # ways still timed (engine.cuda.fastest)
            _steady(False)
            g = sender.sources.gatherer
            marks = {v: sender.timeline.of(v) for v in range(2, case.rounds + 1)}
            # seconds from pipeline start to every write issued (sealed), per measured round
            issue = [m.get("pipeline:sealed", m["pipeline:end"]) - m["pipeline:start"] for m in marks.values()
                     if "pipeline:start" in m]  # (a sender with no rows to send runs no pipeline)
            rows = len(sender.table.transfers)
            # what the trainer waits per round: its push (armed or not) until it holds the commit
            waits = [push_wait(m) for m in marks.values() if "recv:commit" in m]
            return {"gathered": g.gathered // case.rounds if g else 0, "rows": rows, "marks": marks,
                    "push_to_commit_s": waits, "armed_pushes": sender.early.pushes,
                    "host_us_per_row": statistics.median(issue) / rows * 1e6 if rows and issue else None,
                    "compiles": sender.pipeline.compiler.compiles, "trying": trying,
                    "peer_copies": {link: {"chosen": t.chosen, "ms": {w: [round(x * 1e3, 3) for x in ms]
                                                                      for w, ms in t.seconds.items()}}
                                    for link, t in getattr(sender.transport, "choices", {}).items()}}
    try:
        stats = (_traced(main, f"{case.trace}/sender{rank}") if case.trace else
                 _profiled(main, f"{case.profile}/sender{rank}.txt" if case.profile else ""))
        gathers = [] if case.one_gpu else full_tensor_seconds(model, case)  # (for the broadcasts, which --one-gpu skips)
        conn.send(("sender", rank, {**stats, "full_tensor_s": gathers}))
    finally:
        dist.destroy_process_group()


def _traced(main, stem: str):
    """Run ``main()`` on a new loop under torch.profiler (CPU and CUDA); write ``stem.txt`` (operators
    and kernels by device time and by host time) and ``stem.json.gz`` (the Chrome trace); -> its result."""
    import gzip
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = asyncio.run(main())
    averages = prof.key_averages()
    pathlib.Path(stem).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(f"{stem}.txt").write_text(averages.table(sort_by="self_device_time_total", row_limit=30) + "\n"
                                           + averages.table(sort_by="self_cpu_time_total", row_limit=30))
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(f"{stem}.json.gz", "wb") as dst:
            dst.write(src.read())
    return result


def full_tensor_seconds(model: torch.nn.Module, case: Case) -> list[float]:
    """Seconds to gather every parameter's full tensor (``DTensor.full_tensor``, one all-gather each):
    the stage a broadcast from rank 0 needs first, with FSDP trainers."""
    import torch.distributed as dist

    times = []
    for _ in range(case.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for p in model.parameters():
            p.full_tensor()
        if case.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _engine_receiver(case: Case, rank: int, addr: str, ready, conn) -> None:
    from weightsync.engine.aio import install_uvloop
    from weightsync.engine.transforms.layouts import allocate
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import ReceiverOptions, WeightReceiver

    install_uvloop()
    device = case.receiver_device(rank)
    if case.device == "cuda":
        torch.cuda.set_device(device)
    layout = receiver_layout(case, rank)
    tensors, shards = allocate(layout, device)
    opts = ReceiverOptions(transport=case.transport, spin=case.spin, transport_options=TransportOptions(device=device))

    async def main():
        async with WeightReceiver(addr, tensors, rank=rank, shards=shards, options=opts) as receiver:
            await asyncio.to_thread(_settled, ready)
            await receiver.wait_for(WARM_ROUNDS)
            _steady(True)
            await receiver.wait_for(case.rounds)
            _steady(False)
            marks = {v: receiver.timeline.of(v) for v in range(2, case.rounds + 1)}
            conn.send(("receiver", rank, (mismatches(case, rank, tensors, layout, case.rounds, device), marks)))
    _profiled(main, f"{case.profile}/receiver{rank}.txt" if case.profile else "")


async def engine(case: Case, link) -> dict:
    """Full rounds through the public API; -> round seconds, the plan's predicted makespan and bound."""
    from weightsync.engine.plan import build_pieces, lower_bound, makespan
    from weightsync.roles import Controller, ControllerOptions
    from weightsync.roles.admission import participants

    options = ControllerOptions(timeout_s=300.0, mapping=MAPPING, link=link, delta="off", spin=case.spin,
                                full_check_every=case.full_check_every,  # (8 by default: the product's checks)
                                arm_pushes=case.arm, session_streams=case.streams)
    procs = Procs()
    try:
        async with Controller(senders=case.senders, receivers=case.receivers, options=options) as ctl:
            port = free_port()
            ready = procs.ctx.Barrier(case.senders + case.receivers)
            for r in range(case.senders):
                procs.start(_engine_sender, case, r, ctl.address, port, ready)
            for r in range(case.receivers):
                procs.start(_engine_receiver, case, r, ctl.address, ready)
            watch = asyncio.ensure_future(procs.reports(case.senders + case.receivers))

            async def rounds():
                first = [await ctl.wait_round(1)] + [await ctl.wait_round(v) for v in range(2, WARM_ROUNDS + 1)]
                _steady(True)
                # read while all are still joined: once the last round commits, members leave and the
                # controller drops the plan they made
                joined, routing = participants(p.hello for p in ctl.peers.values()), ctl.plan
                counted = [await ctl.wait_round(v) for v in range(WARM_ROUNDS + 1, case.rounds + 1)]
                _steady(False)
                return first + counted, joined, routing
            reports, (senders, receivers), routing = await procs.guard(rounds(), watch)
            done = await watch
            timeline = _timeline(ctl, done, case)
    finally:
        procs.close()
    pieces, _ = build_pieces(senders, receivers, mapping=MAPPING)
    by_sender = {r: got for kind, r, got in done if kind == "sender"}
    by_receiver = {r: got for kind, r, got in done if kind == "receiver"}  # (mismatched names, marks)
    bad = {f"receiver {r}": got[0] for r, got in sorted(by_receiver.items()) if got[0]}
    # rounds whose every link into another GPU ran its chosen way (none still timed after the round before)
    # (the first two rounds are each landing slot's first: registration, IPC opening, compiling, 0.05-0.5 s)
    counted = reports[WARM_ROUNDS:]
    settled = [r for r in counted if not any(s["trying"].get(r.version - 1, False) for s in by_sender.values())]
    return {
        "round_s": [r.seconds for r in (settled or counted)],
        "first_rounds_ms": [round(r.seconds * 1e3, 3) for r in reports[:WARM_ROUNDS]],
        # (each made by the controller before its round, from the rounds before: roles.costs)
        "learned_s": [(r.predicted_s, r.seconds) for r in (settled or counted) if r.predicted_s > 0],
        "rounds_timing_ways": len(counted) - len(settled),
        "ok": all(r.ok for r in reports) and not bad,
        "armed_rounds": sum(1 for r in counted if r.armed),
        "checked_rounds": sum(1 for r in reports if r.checksum),
        **checks(reports, WARM_ROUNDS),
        "mismatches": bad,
        "nbytes": reports[-1].nbytes,
        "transfers": routing.transfer_count,
        "timeline_ms": timeline,
        "push_to_commit_s": [max(ws) for ws in zip(*(s["push_to_commit_s"] for s in by_sender.values()))][WARM_ROUNDS - 1:],
        "senders": {f"sender {r}": {k: v for k, v in by_sender[r].items()
                                    if k not in ("full_tensor_s", "marks", "trying", "push_to_commit_s")}
                    for r in sorted(by_sender)},
        "full_tensor_s": by_sender[0]["full_tensor_s"],
        "predicted_s": makespan(routing.senders, senders, receivers, link),
        "bound_s": lower_bound(pieces, senders, receivers, link),
        "quantize_bound_s": quantize_bound(routing.senders, link),
    }


def checks(reports: list, warm: int) -> dict:
    """The counted rounds (after the first ``warm``) checked end to end (``RoundReport.checksum``) apart from
    the others: each landing slot's first check (versions alternate slots; it builds that slot's
    fingerprint tables, once per plan), the steady checks after it, and the unchecked rounds."""
    seen, first, steady = set(), [], []
    for i, r in enumerate(reports):
        if r.checksum:
            if i >= warm:
                (steady if r.version % 2 in seen else first).append(r.seconds)
            seen.add(r.version % 2)
    return {"first_checks_s": first, "checked_s": steady,
            "unchecked_s": [r.seconds for r in reports[warm:] if not r.checksum]}


def quantize_bound(tables, link) -> float:
    """The least time the busiest sender needs to quantize its share into block FP8 on its GPU: each
    quantization reads its bf16 source (2 bytes a value) and writes the FP8 weight (1 byte a value), all
    at the device's copy rate (``link.local_bw`` bytes copied a second: one read and one write each).
    ``lower_bound`` counts only the FP8 bytes written; this counts what the sender must read too."""
    def seconds(table) -> float:
        weights = {(t.name, t.slice): t.nbytes for t in table.transfers if t.transform.rpartition(",")[2].startswith("fp8w")}
        return 3 * sum(weights.values()) / (2 * link.local_bw)
    return max((seconds(t) for t in tables.values()), default=0.0)


def _timeline(ctl, done: list, case: Case) -> list:
    """Each event's median milliseconds since the controller started the round, over the measured
    rounds: the controller's, every sender's and every receiver's marks on one clock (one host)."""
    from weightsync.roles.timeline import medians, merge

    rounds = []
    for v in range(2, case.rounds + 1):
        marks = ctl.timeline.of(v)
        if "round:start" not in marks:
            continue  # (timelines keep the last 16 versions)
        roles = {"controller": marks}
        for kind, r, got in done:
            roles[f"{kind} {r}"] = (got["marks"] if kind == "sender" else got[1]).get(v, {})
        rounds.append(merge(marks["round:start"], roles))
    return [(event, round(ms, 3)) for event, ms in medians(rounds)]


# --- the broadcast baseline ------------------------------------------------------------------------


def _broadcaster(case: Case, rank: int, port: int, bucket: int, conn) -> None:
    """Rank 0 of 1 + N (1 + N - 1 colocated): every full tensor, one broadcast each (``bucket`` bytes > 0:
    packed into buckets of that size first, one broadcast a bucket, as verl and slime do); ranks >= 1
    keep their TP slice of it; colocated, rank 0 also keeps receiver 0's slice."""
    import torch.distributed as dist

    from weightsync.engine.transforms.fp8 import quantize_blocks
    from weightsync.engine.transforms.layouts import allocate

    first = 1 if case.colocated else 0  # the receiver rank that process 1 plays
    world = case.receivers + (0 if case.colocated else 1)
    serves = [0] if (rank == 0 and case.colocated) else ([] if rank == 0 else [rank - 1 + first])
    device = case.sender_device(0) if rank == 0 else case.receiver_device(rank - 1 + first)
    _init_dist(case, device, rank, world, port)
    layouts = {r: {e.name: e for e in receiver_layout(dataclasses.replace(case, fp8=False), r)} for r in serves}
    mine = {r: allocate(list(layouts[r].values()), device)[0] for r in serves}
    shapes = model_shapes(case.model)
    full = {p.name: (full_tensor(p.name, p.shape, 1, case.seed, device) if rank == 0
                     else torch.empty(p.shape, dtype=torch.bfloat16, device=device)) for p in shapes}
    where = _slices(layouts, case)

    def keep(name: str, t: torch.Tensor) -> None:
        for r, entry, at in where.get(name, ()):
            part = tp_part(t, entry, case.receivers, r)
            mine[r][entry.name].narrow(0, at, part.shape[0]).copy_(part)

    groups = _buckets(full, bucket) if bucket else [[name] for name in full]
    flat = torch.empty(max(sum(full[n].numel() for n in g) for g in groups), dtype=torch.bfloat16, device=device)

    def one_round():
        for names in groups:
            if not bucket:
                dist.broadcast(full[names[0]], src=0)
                keep(names[0], full[names[0]])
                continue
            sizes = [full[n].numel() for n in names]
            packed = flat[:sum(sizes)]
            if rank == 0:
                torch.cat([full[n].reshape(-1) for n in names], out=packed)
            dist.broadcast(packed, src=0)
            for n, part in zip(names, packed.split(sizes)):
                keep(n, part.view(full[n].shape))

    served = {r: list(layouts[r].values()) for r in serves}
    if case.fp8:  # FP8 receivers quantize the bf16 they were sent (as vLLM does on load): counted in the round
        served = {r: receiver_layout(case, r) for r in serves}
        state = {r: allocate(served[r], device)[0] for r in serves}

    def quantize() -> None:
        for r in serves:
            for e in served[r]:
                if str(e.dtype).endswith("float8_e4m3fn"):
                    q, scale_inv = quantize_blocks(mine[r][e.name])
                    state[r][e.name].copy_(q)
                    state[r][e.name + "_scale_inv"].copy_(scale_inv)
                elif not e.name.endswith("_scale_inv"):
                    state[r][e.name] = mine[r][e.name]

    times = []
    for _ in range(case.rounds):
        dist.barrier()
        if case.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_round()
        if case.fp8:
            quantize()
        if case.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    bad = [f"receiver {r}: {n}" for r in serves
           for n in mismatches(case, r, state[r] if case.fp8 else mine[r], served[r], 1, device)]
    conn.send(("broadcast", rank, (times[1:], bad)))
    dist.destroy_process_group()


def _buckets(full: dict[str, torch.Tensor], nbytes: int) -> list[list[str]]:
    """Tensor names in order, grouped into buckets of at most ``nbytes`` (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in full.items():
        if out[-1] and size + t.numel() * t.element_size() > nbytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += t.numel() * t.element_size()
    return out


def _slices(layouts: dict, case: Case) -> dict[str, list]:
    """source name -> [(receiver, its layout entry, row offset of this part in the fused tensor)]."""
    out: dict[str, list] = {}
    shapes = {p.name: p.shape for p in model_shapes(case.model)}
    for r, entries in layouts.items():
        for name, e in entries.items():
            at = 0
            for src in fused_parts(name):
                out.setdefault(src, []).append((r, e, at))
                rows = shapes[src][0]
                at += rows // case.receivers if e.shard is not None and e.shard.dim == 0 else rows
    return out


async def broadcast(case: Case, bucket: int = 0) -> dict:
    procs = Procs()
    port = free_port()
    try:
        world = case.receivers + (0 if case.colocated else 1)
        for r in range(world):
            procs.start(_broadcaster, case, r, port, bucket)
        done = await procs.reports(world)
    finally:
        procs.close()
    times = next(t for _, r, (t, _) in done if r == 0)
    bad = [b for _, _, (_, bs) in done for b in bs]
    return {"round_s": times, "ok": not bad, "mismatches": bad}


def _learned(pairs: list[tuple[float, float]]) -> dict:
    """The controller's own predictions (learned costs, ``roles.costs``) beside the rounds they preceded."""
    if not pairs:
        return {}
    ratios = [p / s for p, s in pairs]
    return {"learned_predicted_ms": round(statistics.median(p for p, _ in pairs) * 1e3, 3),
            "learned_over_engine_ratio": round(statistics.median(ratios), 3),
            "learned_worst_error": round(max(abs(r - 1) for r in ratios), 3), "learned_rounds": len(pairs)}


def _period(case: Case, eng: dict) -> dict:
    """Checked rounds beside unchecked ones: their medians, each landing slot's first check apart, and a
    check period's mean over the unchecked median (``full_check_every`` - 1 unchecked rounds and one
    steady checked one): what the product's default checks cost a round on average."""
    ms = lambda xs: [round(x * 1e3, 3) for x in xs]  # noqa: E731
    out = {"first_checks_ms": ms(eng["first_checks_s"]), "checked_ms_all": ms(eng["checked_s"])}
    checked, plain, every = eng["checked_s"], eng["unchecked_s"], case.full_check_every
    if checked and plain and every > 1:
        c, u = statistics.median(checked), statistics.median(plain)
        out.update(checked_median_ms=round(c * 1e3, 3), unchecked_median_ms=round(u * 1e3, 3),
                   period_over_unchecked_ratio=round(((every - 1) * u + c) / every / u, 3))
    return out


def summary(case: Case, link, eng: dict, bc: dict, bucketed: Optional[dict] = None, peer: Optional[dict] = None) -> dict:
    med = statistics.median
    engine_s = med(eng["round_s"])
    mean_s = statistics.mean(eng["round_s"])  # (checked rounds included)
    out = {
        "case": f"{case.senders} -> {case.receivers} {'colocated' if case.colocated else 'disaggregated'}",
        "model": case.model, "device": case.device, "transport": case.transport, "fp8": case.fp8, "spin": {None: "auto", True: "on", False: "off"}[case.spin],
        "full_check_every": case.full_check_every, "checked_rounds": eng["checked_rounds"], "arm": case.arm, "streams": case.streams,
        "first_rounds_ms": eng["first_rounds_ms"],
        "rounds_measured": len(eng["round_s"]), "rounds_timing_ways": eng["rounds_timing_ways"],
        "bytes_per_round": eng["nbytes"], "transfers": eng["transfers"],
        "bandwidth_gbps": {"across": round(link.host_bw / 1e9, 2), "local": round(link.local_bw / 1e9, 2)},
        "bound_ms": round(eng["bound_s"] * 1e3, 6),
        "predicted_ms": round(eng["predicted_s"] * 1e3, 3),
        "engine_ms": round(engine_s * 1e3, 3),
        "engine_ms_all": [round(s * 1e3, 3) for s in eng["round_s"]],
        # the slowest sender's push until it holds the commit (an armed push writes before the round's start)
        "push_to_commit_ms": round(med(eng["push_to_commit_s"]) * 1e3, 3) if eng["push_to_commit_s"] else None,
        "armed_rounds": eng["armed_rounds"],
        "engine_mean_ms": round(mean_s * 1e3, 3),
        "engine_over_bound_ratio": round(engine_s / eng["bound_s"], 3),
        "engine_mean_over_bound_ratio": round(mean_s / eng["bound_s"], 3),
        **_period(case, eng),
        **({"quantize_bound_ms": round(eng["quantize_bound_s"] * 1e3, 3),
            "engine_over_quantize_bound_ratio": round(engine_s / eng["quantize_bound_s"], 3)}
           if case.fp8 and case.device == "cuda" and eng["quantize_bound_s"] else {}),
        "predicted_over_engine_ratio": round(eng["predicted_s"] / engine_s, 3),
        **_learned(eng["learned_s"]),
        "senders": {k: {"gathered_per_round": v["gathered"], "rows": v["rows"], "compiles": v["compiles"],
                        "host_us_per_row": v["host_us_per_row"] and round(v["host_us_per_row"], 2),
                        **({"peer_copies": v["peer_copies"]} if v["peer_copies"] else {})}
                    for k, v in eng["senders"].items()},
        "bit_exact": eng["ok"], "mismatches": eng["mismatches"],
        "timeline_ms": eng["timeline_ms"],
    }
    if bc:
        bc_s = med(bc["round_s"])
        gather_s = med(eng["full_tensor_s"])
        out.update({"broadcast_ms": round(bc_s * 1e3, 3), "engine_over_broadcast_ratio": round(engine_s / bc_s, 3),
                    "full_tensor_gather_ms": round(gather_s * 1e3, 3),
                    "broadcast_with_gather_ms": round((bc_s + gather_s) * 1e3, 3),
                    "engine_over_broadcast_with_gather_ratio": round(engine_s / (bc_s + gather_s), 3),
                    "broadcast_bit_exact": bc["ok"], "broadcast_mismatches": bc["mismatches"][:10]})
    if bucketed:
        bk_s = med(bucketed["round_s"])
        out.update({"broadcast_bucketed_ms": round(bk_s * 1e3, 3), "broadcast_bucket_mib": BUCKET >> 20,
                    "engine_over_broadcast_bucketed_ratio": round(engine_s / bk_s, 3),
                    "broadcast_bucketed_bit_exact": bucketed["ok"]})
    if peer:
        out.update({"ckpt_step_ms": peer["step_ms"], "ckpt_update_ms": peer["update_ms"],
                    "ckpt_step_ms_all": [round(s * 1e3, 3) for s in peer["step_s"]],
                    "engine_over_ckpt_ratio": round(engine_s * 1e3 / peer["step_ms"], 4),
                    "engine_over_ckpt_update_ratio": round(engine_s * 1e3 / peer["update_ms"], 4),
                    "ckpt_bit_exact": peer["ok"], "ckpt_mismatches": peer["mismatches"][:10]})
    return out


def show(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{s['case']}: {s['model']} over {s['transport']}"
                        f"{' (FP8 receivers)' if s['fp8'] else ''}, {s['bytes_per_round'] / 1e6:.1f} MB a round")
    for col in ("row", "ms", "x bound", "x engine"):
        table.add_column(col, justify="right" if col != "row" else "left")
    rows = [("bound (measured bandwidths)", s["bound_ms"]), ("planner's prediction", s["predicted_ms"]),
            *([("controller's prediction (learned costs)", s["learned_predicted_ms"])] if "learned_predicted_ms" in s else []),
            ("engine", s["engine_ms"])]
    if "broadcast_ms" in s:
        rows += [("broadcast from rank 0, per tensor (full tensors given)", s["broadcast_ms"]),
                 ("  + FSDP full_tensor gather first", s["broadcast_with_gather_ms"])]
    if "broadcast_bucketed_ms" in s:
        rows += [(f"broadcast from rank 0, {s['broadcast_bucket_mib']} MiB buckets", s["broadcast_bucketed_ms"])]
    if "ckpt_step_ms" in s:
        rows += [("checkpoint-engine step (pinned copy + update)", s["ckpt_step_ms"]),
                 ("  its update alone", s["ckpt_update_ms"])]
    for label, ms in rows:
        over_bound = f"{ms / s['bound_ms']:.2f}" if s["bound_ms"] else "-"
        table.add_row(label, f"{ms:.2f}", over_bound, f"{ms / s['engine_ms']:.2f}")
    Console(stderr=True).print(table)


async def control_rtt_ms() -> float:
    """The median back-to-back control round trip between two processes here (pyzmq on uvloop, 100-byte
    messages: bench/diagnostics/control_hops.py), what a round's control hops are measured against."""
    from diagnostics.control_hops import round_trips

    return statistics.median(await round_trips(0.0, False)) * 1e3


async def run(case: Case, with_broadcast: bool = True, with_ckpt: bool = False) -> dict:
    case.check()
    link = measured_link(case)
    rtt = await control_rtt_ms()
    eng = await _controller_profiled(engine(case, link), case.profile)
    bc = await broadcast(case) if with_broadcast else {}
    bucketed = await broadcast(case, BUCKET) if with_broadcast else {}
    peer = {}
    if with_ckpt:
        from peer_ckpt import ckpt

        peer = await ckpt(case)
    out = summary(case, link, eng, bc, bucketed, peer)
    out["control_rtt_ms"] = round(rtt, 4)
    out["engine_over_rtt"] = round(out["engine_ms"] / rtt, 2)
    if case.model == "empty":
        out["empty_round_over_rtt"] = out["engine_over_rtt"]
    return out


async def _controller_profiled(coro, folder: str):
    """``await coro``; with ``folder``, under cProfile while the counted rounds run (this process: the
    controller's side), written to ``controller.txt`` there like the workers' profiles."""
    with _profiling(str(pathlib.Path(folder, "controller.txt")) if folder else ""):
        return await coro


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", type=int, default=2, help="FSDP2 trainer processes (M)")
    ap.add_argument("--receivers", type=int, default=2, help="tensor-parallel inference processes (N = TP)")
    ap.add_argument("--model", default="qwen2.5-7b", choices=("empty", "tiny-dense", "tiny-moe", "qwen2.5-0.5b",
                                                                 "qwen2.5-7b", "qwen3-30b-a3b"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--colocated", action="store_true", help="trainer i and receiver i share GPU i")
    ap.add_argument("--fp8", action="store_true", help="receivers hold the block-FP8 layout")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the first (plan, registration) is not counted")
    ap.add_argument("--no-broadcast", action="store_true", help="skip the broadcast baselines")
    ap.add_argument("--no-pitched-kernel", action="store_true",
                    help="pitched rows as a cudaMemcpy2DAsync each, not one descriptor-table launch")
    ap.add_argument("--peer-copies", default="fastest", choices=("fastest", "kernel", "dma"),
                    help="rows into another GPU: a kernel storing into its memory, the copy engines, or the faster "
                         "of both timed on the first rounds (rounds still timing are not counted)")
    ap.add_argument("--kernel-grid", default="", metavar="SAME,OTHER",
                    help="cuda_ipc copy kernels' programs per SM, into the same GPU and into another (0: a program "
                         "per piece; default: TransportOptions.kernel_grid)")
    ap.add_argument("--spin", default="auto", choices=("auto", "on", "off"),
                    help="processes poll their event loops while a round is open (ControllerOptions / WorkerOptions.spin; "
                         "auto, the default: where tensors are on a GPU)")
    ap.add_argument("--ckpt", action="store_true", help="run checkpoint-engine beside it (bench/peer_ckpt.py; CUDA)")
    ap.add_argument("--full-check-every", type=int, default=8, metavar="N",
                    help="end-to-end checks every N rounds, as ControllerOptions.full_check_every (default 8, the "
                         "product's; 0: none, the data path alone)")
    ap.add_argument("--no-arm", action="store_true",
                    help="the controller offers no arms: each sender waits for its begin (ControllerOptions."
                         "arm_pushes=False; by default an armed push stands for its begin, roles.arms)")
    ap.add_argument("--no-streams", action="store_true",
                    help="sessions keep their messages on ZeroMQ (ControllerOptions.session_streams=False; by default "
                         "each goes to a TCP stream of its own after welcome, roles.channel_stream)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="every rank on GPU 0: M -> N's control path (--model empty --colocated) where one GPU is lent")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object on the last line")
    ap.add_argument("--profile", default="", help="a folder: cProfile each sender, receiver and the controller there while the counted rounds run (diagnostics)")
    ap.add_argument("--trace", default="", help="a folder: torch.profiler each sender there, CPU and CUDA (diagnostics)")
    args = ap.parse_args(argv)
    if args.rounds <= WARM_ROUNDS:
        ap.error(f"--rounds must be more than {WARM_ROUNDS} (each landing slot's first round is not counted)")
    case = Case(args.model, args.senders, args.receivers, args.device, args.colocated, args.fp8, args.rounds,
                profile=args.profile, trace=args.trace, spin={"auto": None, "on": True, "off": False}[args.spin], pitched_kernel=not args.no_pitched_kernel, peer_copies=args.peer_copies,
                kernel_grid=tuple(float(x) for x in args.kernel_grid.split(",")) if args.kernel_grid else None,
                full_check_every=args.full_check_every, arm=not args.no_arm, one_gpu=args.one_gpu,
                streams=not args.no_streams)
    if args.one_gpu and not args.no_broadcast:
        ap.error("--one-gpu needs --no-broadcast (NCCL refuses two ranks on one GPU)")
    if args.ckpt and (args.device != "cuda" or args.fp8):
        ap.error("--ckpt runs on CUDA receivers without --fp8 (checkpoint-engine hands vLLM full tensors)")
    from weightsync.engine.aio import install_uvloop

    install_uvloop()  # the controller on uvloop, as `weightsync controller` runs it (the workers install it too)
    result = asyncio.run(run(case, not args.no_broadcast, args.ckpt))
    result["command"] = "bench/transfer_mn.py " + " ".join(sys.argv[1:] if argv is None else argv)
    show(result)
    if args.json:
        print(json.dumps(result))
    ok = all(result.get(k, True) for k in ("bit_exact", "broadcast_bit_exact", "broadcast_bucketed_bit_exact",
                                            "ckpt_bit_exact"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
