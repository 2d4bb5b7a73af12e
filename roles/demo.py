"""``weightsync demo``: a real multi-process transfer on one machine, no GPU needed.

How this works: the parent runs the controller. It spawns N trainer processes, which form a gloo
process group, wrap a GPT-2 model (built from a transformers config, no download) in DDP and take real
AdamW steps on generated token data; after each step every trainer pushes the new version through its
routing table. M inference processes hold a GPT-2 model of their own (different initial weights) and
receive each version in shadow mode. Every transfer is checksummed (CRC-32 per transfer, verified by
the receiver after the fence), and each process also reports a digest of its whole state per version:
the demo succeeds only if every receiver's digest equals the trainers' for every round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
import zlib

from weightsync.engine.errors import WeightSyncError

from .controller import Controller, ControllerOptions
from .progress import RoundProgress


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    trainers: int = 2
    inference: int = 2
    size: str = "small"
    rounds: int = 5
    mode: str = "shadow"
    batch: int = 2
    seq: int = 64
    checksum: str = "crc32"
    json: bool = False
    timeout_s: float = 600.0
    lr: float = 3e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_digest(tensors: dict) -> int:
    """CRC-32 over every tensor's bytes, in name order (ties counted once)."""
    from weightsync.engine.datapath.tensors import byte_view, find_ties

    ties = find_ties(tensors)
    crc = 0
    for name in sorted(tensors):
        if name not in ties:
            crc = zlib.crc32(byte_view(tensors[name].detach().contiguous()), crc)
    return crc


def _model(size: str, seed: int):
    import torch
    from transformers import GPT2LMHeadModel

    from weightsync.engine.models.shapes import gpt2_config

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' notices would interleave with the demo's table
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(size))


# --- child processes ---------------------------------------------------------------------------------


def _trainer_main(rank: int, cfg: DemoConfig, addr: str, dist_port: int, out: mp.Queue) -> None:
    try:
        asyncio.run(_trainer(rank, cfg, addr, dist_port, out))
    except BaseException:
        out.put(("error", "trainer", rank, traceback.format_exc()))


async def _trainer(rank: int, cfg: DemoConfig, addr: str, dist_port: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from weightsync.engine.datapath.tensors import named_tensors

    from .sender import WeightSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=cfg.trainers)
    model = _model(cfg.size, seed=0)  # identical replicas; DDP keeps them identical
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    vocab = model.config.vocab_size
    # one fixed batch per rank, trained on every step: the model memorizes it, so the loss visibly falls
    tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(rank))
    try:
        async with WeightSender(addr, model, rank=rank) as sender:
            out.put(("joined", "trainer", rank, None))
            for version in range(1, cfg.rounds + 1):
                t0 = time.perf_counter()
                loss = await asyncio.to_thread(_train_step, ddp, opt, tokens)
                step_s = time.perf_counter() - t0
                handle = await sender.push(version)  # returns once the sources are free again
                released_s = time.perf_counter() - t0 - step_s
                await handle  # the global commit
                digest = state_digest(named_tensors(model))
                out.put(("pushed", "trainer", rank, {"version": version, "loss": loss, "step_s": step_s,
                                                     "push_s": released_s, "digest": digest}))
    finally:
        dist.destroy_process_group()


def _train_step(ddp, opt, tokens) -> float:
    opt.zero_grad(set_to_none=True)
    loss = ddp(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def _inference_main(rank: int, cfg: DemoConfig, addr: str, out: mp.Queue) -> None:
    try:
        asyncio.run(_inference(rank, cfg, addr, out))
    except BaseException:
        out.put(("error", "inference", rank, traceback.format_exc()))


async def _inference(rank: int, cfg: DemoConfig, addr: str, out: mp.Queue) -> None:
    import torch

    from .receiver import WeightReceiver

    torch.set_num_threads(1)
    model = _model(cfg.size, seed=100 + rank).eval()  # different weights until the first version lands
    async with WeightReceiver(addr, model, rank=rank, mode=cfg.mode) as receiver:
        out.put(("joined", "inference", rank, None))
        for version in range(1, cfg.rounds + 1):
            await receiver.wait_for(version)
            digest = state_digest(receiver.state_dict())
            out.put(("received", "inference", rank, {"version": version, "digest": digest}))


# --- the parent ---------------------------------------------------------------------------------------


class DemoFailed(WeightSyncError):
    pass


async def run_demo(cfg: DemoConfig) -> dict:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    progress = RoundProgress(total=cfg.rounds, enabled=sys.stderr.isatty(), quiet=cfg.json)
    progress.say(f"weightsync demo: gpt2-{cfg.size}, {cfg.trainers} trainer processes (DDP, gloo) -> "
                 f"{cfg.inference} inference processes, {cfg.rounds} rounds, {cfg.mode} mode; "
                 f"starting processes (each imports torch and builds its model: a few seconds)")
    options = ControllerOptions(checksum=cfg.checksum, timeout_s=30.0, heartbeat_s=0.5)
    procs: list = []
    async with Controller("tcp://127.0.0.1:0", senders=cfg.trainers, receivers=cfg.inference,
                          options=options, on_round=lambda r: progress.round_done(r)) as controller:
        port = _free_port()
        for r in range(cfg.trainers):
            procs.append(ctx.Process(target=_trainer_main, args=(r, cfg, controller.address, port, out), daemon=True))
        for r in range(cfg.inference):
            procs.append(ctx.Process(target=_inference_main, args=(r, cfg, controller.address, out), daemon=True))
        for p in procs:
            p.start()
        try:
            results = await _collect(cfg, out, procs, progress)
            await controller.wait_round(cfg.rounds)
        finally:
            progress.close()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        return _summary(cfg, controller, results)


async def _collect(cfg: DemoConfig, out: mp.Queue, procs: list, progress: RoundProgress) -> dict:
    """Gather the children's reports until every round was pushed and received, or one failed."""
    want = cfg.rounds * (cfg.trainers + cfg.inference)
    got: dict[tuple, dict] = {}
    deadline = time.monotonic() + cfg.timeout_s
    loop = asyncio.get_running_loop()
    while len(got) < want:
        if time.monotonic() > deadline:
            raise DemoFailed(f"timed out after {cfg.timeout_s}s with {len(got)}/{want} reports")
        try:
            kind, role, rank, data = await loop.run_in_executor(None, out.get, True, 1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise DemoFailed(f"a child process died (exit code {dead[0].exitcode})")
            continue
        if kind == "error":
            raise DemoFailed(f"{role} {rank} failed:\n{data}")
        if kind == "joined":
            progress.say(f"  {role} {rank} joined the controller")
        elif kind in ("pushed", "received"):
            got[(role, rank, data["version"])] = data
            if kind == "pushed" and rank == 0:
                progress.say(f"  round {data['version']}: trained (loss {data['loss']:.3f}), pushed and committed")
    return got


def _summary(cfg: DemoConfig, controller: Controller, results: dict) -> dict:
    rows = []
    all_ok = True
    for report in controller.reports:
        v = report.version
        digests = {results[("trainer", r, v)]["digest"] for r in range(cfg.trainers)}
        received = {results[("inference", r, v)]["digest"] for r in range(cfg.inference)}
        verified = report.ok and len(digests) == 1 and received == digests
        all_ok &= verified
        losses = [results[("trainer", r, v)]["loss"] for r in range(cfg.trainers)]
        rows.append({
            "version": v, "ok": report.ok, "bytes": report.nbytes, "seconds": round(report.seconds, 4),
            "gbps": round(report.gbps, 3), "transfer_s": round(report.stages.get("transfer", 0.0), 4),
            "fence_s": round(report.stages.get("fence", 0.0), 4), "commit_s": round(report.stages.get("commit", 0.0), 4),
            "loss": round(sum(losses) / len(losses), 4), "verified": verified,
        })
    all_ok &= len(rows) == cfg.rounds
    return {"ok": all_ok, "trainers": cfg.trainers, "inference": cfg.inference, "model": f"gpt2-{cfg.size}",
            "mode": cfg.mode, "checksum": cfg.checksum, "rounds": rows}


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weightsync demo: {summary['model']}, {summary['trainers']} trainers -> "
                        f"{summary['inference']} inference processes, {summary['mode']} mode, "
                        f"checksums {summary['checksum'] or 'off'}", title_justify="left")
    for name in ("round", "loss", "MB moved", "seconds", "GB/s", "transfer", "fence", "commit", "verified"):
        table.add_column(name, justify="left" if name == "verified" else "right")
    for r in summary["rounds"]:
        table.add_row(str(r["version"]), f"{r['loss']:.4f}", f"{r['bytes'] / 1e6:.1f}", f"{r['seconds']:.3f}",
                      f"{r['gbps']:.2f}", f"{r['transfer_s']:.3f}", f"{r['fence_s']:.3f}", f"{r['commit_s']:.3f}",
                      "yes" if r["verified"] else "NO")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)  # (piped: no truncation)
    console.print(table)
    console.print("all rounds verified bit-exact (loss: the trainers memorize one fixed batch each)"
                  if summary["ok"] else "VERIFICATION FAILED")


def main(cfg: DemoConfig) -> int:
    from weightsync.engine.aio import install_uvloop

    install_uvloop()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        summary = asyncio.run(run_demo(cfg))
    except WeightSyncError as exc:
        print(f"weightsync demo failed: {exc}", file=sys.stderr)
        if cfg.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    if not cfg.json:
        print_summary(summary)
    else:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1
