"""The parts of bench/transfer_mn.py that set a run up: the case, the model and what every rank should
hold (plain torch, independent of the engine's part arithmetic), FSDP2 trainer modules, measured link
bandwidths, and the spawned processes that report on pipes."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing as mp
import socket
import statistics
import threading
import time
import traceback
import zlib
from typing import Optional

import torch

MAPPING = "qwen2"  # vLLM's fused qkv_proj / gate_up_proj names (engine.plan.mapping)
WATCHDOG_S = 900.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One run's shape: who holds what, where."""

    model: str
    senders: int
    receivers: int
    device: str  # "cpu" or "cuda"
    colocated: bool = False
    fp8: bool = False
    rounds: int = 3
    seed: int = 0
    profile: str = ""  # a folder: cProfile each sender, receiver and the controller there
    trace: str = ""  # a folder: torch.profiler (CPU and CUDA) each sender there
    spin: Optional[bool] = None  # processes poll their event loops while a round is open (None: the default)
    pitched_kernel: bool = True  # cuda_ipc: pitched rows in one descriptor-table launch (TransportOptions)
    peer_copies: str = "fastest"  # cuda_ipc: rows into another GPU by "kernel", "dma" or the "fastest" (TransportOptions)
    kernel_grid: Optional[tuple[float, float]] = None  # cuda_ipc copy kernels' programs per SM (None: TransportOptions')
    full_check_every: int = 8  # the controller's end-to-end checks (the product's default; 0: none, the data path alone)
    arm: bool = True  # the controller offers arms: each sender writes on its own push (ControllerOptions.arm_pushes)
    streams: bool = True  # sessions' messages on streams of their own (ControllerOptions.session_streams)
    one_gpu: bool = False  # every rank on GPU 0 (the empty model: M -> N's control path where one GPU is lent)

    def sender_device(self, rank: int) -> str:
        return "cpu" if self.device == "cpu" else f"cuda:{0 if self.one_gpu else rank}"

    def receiver_device(self, rank: int) -> str:
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{0 if self.one_gpu else rank if self.colocated else self.senders + rank}"

    @property
    def transport(self) -> str:
        return "tcp" if self.device == "cpu" else "cuda_ipc"

    def check(self) -> None:
        if self.one_gpu and (self.device != "cuda" or self.model != "empty" or not self.colocated):
            raise SystemExit("--one-gpu runs the empty model, colocated, on CUDA (its bound is no bytes)")
        if self.device == "cuda" and not self.one_gpu:
            need = max(self.senders, self.receivers) if self.colocated else self.senders + self.receivers
            if torch.cuda.device_count() < need:
                raise SystemExit(f"{self.senders} -> {self.receivers} ({'colocated' if self.colocated else 'disaggregated'}) "
                                 f"needs {need} GPUs; this machine has {torch.cuda.device_count()}")


# --- the model, the weights and what every rank should hold (plain torch) ----------------------------


@functools.lru_cache(maxsize=None)
def model_shapes(model: str):
    """The trainer's parameter names and shapes (built once per process: a meta model is slow to make)."""
    from weightsync.engine.models.shapes import bench_model, config_shapes, per_expert

    if model == "tiny-dense":
        from transformers import Qwen2Config

        return config_shapes(Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                         tie_word_embeddings=False))
    if model == "tiny-moe":
        from transformers import Qwen3MoeConfig

        return per_expert(config_shapes(Qwen3MoeConfig(
            hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
            vocab_size=512, tie_word_embeddings=False)))
    if model == "small-dense":  # ~140 MB in bf16: about a second over a 1 Gbit/s link (bench/cluster.py)
        from transformers import Qwen2Config

        return config_shapes(Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8192,
                                         tie_word_embeddings=False))
    if model == "small-moe":  # 64 experts a layer, one tensor each: ~800 tensors, ~90 MB
        from transformers import Qwen3MoeConfig

        return per_expert(config_shapes(Qwen3MoeConfig(
            hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=8, head_dim=64, num_experts=64, num_experts_per_tok=4,
            vocab_size=8192, tie_word_embeddings=False)))
    if model == "empty":  # one 64-value tensor: a round of control messages and nothing to move
        from weightsync.engine.models.shapes import ParamShape

        return (ParamShape("model.norm.weight", (64,), "bfloat16"),)
    return bench_model(model)


def full_tensor(name: str, shape, version: int, seed: int, device: str) -> torch.Tensor:
    """The trainer's full ``name`` at ``version``: seeded bf16 noise, plus 1 per training step."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    t = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.bfloat16)
    for _ in range(version):
        t.add_(1)
    return t


class Steps:
    """``full_tensor`` for versions that only grow (a process pushing or checking round after round):
    each tensor advanced from the last version asked for, one bf16 add a step, so the same values for
    O(steps) work instead of O(version) (rounds that follow each other at once reach versions in the
    thousands). Keeps one copy of each tensor: for small models."""

    def __init__(self) -> None:
        self.last: dict = {}  # (name, seed, device) -> (version, tensor)
        self.lock = threading.Lock()  # (callers run it on worker threads)

    def __call__(self, name: str, shape, version: int, seed: int, device: str) -> torch.Tensor:
        key = (name, seed, device)
        with self.lock:
            have = self.last.get(key)
            if have is None or have[0] > version or tuple(have[1].shape) != tuple(shape):
                have = (0, full_tensor(name, shape, 0, seed, device))
            start, t = have
            for _ in range(version - start):
                t.add_(1)
            self.last[key] = (version, t)
            return t.clone()


def receiver_layout(case: Case, rank: int):
    from weightsync.engine.transforms.layouts import FP8Policy, TensorParallel, receiver_layout as layout

    shapes = {p.name: (p.dtype, p.shape) for p in model_shapes(case.model)}
    return layout(shapes, MAPPING, tp=TensorParallel(rank, case.receivers), fp8=FP8Policy() if case.fp8 else None)


def fused_parts(name: str) -> tuple[str, ...]:
    """The trainer names a receiver tensor is made of, in order (one, unless the mapping fuses)."""
    from weightsync.engine.plan.mapping import get_mapping

    return get_mapping(MAPPING).recipe(name)[1]


def tp_part(full: torch.Tensor, entry, world: int, index: int) -> torch.Tensor:
    return full if entry.shard is None else full.chunk(world, entry.shard.dim)[index]


def expected(name: str, entry, sources: dict, world: int, index: int) -> torch.Tensor:
    """What TP rank ``index`` holds under ``name``: each fused part's own TP chunk, concatenated (vLLM)."""
    return torch.cat([tp_part(sources[s], entry, world, index) for s in fused_parts(name)])


def mismatches(case: Case, rank: int, state: dict, layout, version: int, device: str, source=None) -> list[str]:
    """The names in ``state`` (TP rank ``rank``'s tensors) that differ from the trainer's at ``version``
    (``source``: ``full_tensor`` or a ``Steps``)."""
    from weightsync.engine.transforms import within_fp8_bound

    shapes = {p.name: p.shape for p in model_shapes(case.model)}
    bad = []
    for entry in layout:
        if entry.name.endswith("_scale_inv"):
            continue
        sources = {s: (source or full_tensor)(s, shapes[s], version, case.seed, device) for s in fused_parts(entry.name)}
        want = expected(entry.name, entry, sources, case.receivers, rank)
        got = state[entry.name]
        if got.dtype == torch.float8_e4m3fn:
            good = within_fp8_bound(want, got, state[entry.name + "_scale_inv"])
        else:
            good = torch.equal(got, want)
        if not good:
            bad.append(entry.name)
    return bad


def trainer_module(shapes) -> torch.nn.Module:
    """An ``nn.Module`` with a parameter at each dotted name (meta device, no memory yet)."""
    root = torch.nn.Module()
    for p in shapes:
        *path, leaf = p.name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16, device="meta")))
    return root


def fsdp_model(case: Case, rank: int) -> torch.nn.Module:
    """This rank's FSDP2 shards of the model at version 0 (``torch.chunk`` rows of each full tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = case.sender_device(rank)
    shapes = model_shapes(case.model)
    model = trainer_module(shapes)
    fully_shard(model, mesh=init_device_mesh("cpu" if case.device == "cpu" else "cuda", (case.senders,)))
    model.to_empty(device=device)
    with torch.no_grad():
        shape_of = {p.name: p.shape for p in shapes}
        for name, param in model.named_parameters():
            local = param.to_local()
            want = full_tensor(name, shape_of[name], 0, case.seed, device).chunk(case.senders)
            want = want[rank] if rank < len(want) else want[0][:0]
            assert local.shape == want.shape, (name, local.shape, want.shape)
            local.copy_(want)
    return model


def _init_dist(case: Case, device: str, rank: int, world: int, port: int) -> None:
    """Join a process group of ``world`` (NCCL on GPUs, gloo on the CPU) from ``device``."""
    import torch.distributed as dist

    if case.device == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if case.device == "cpu" or case.one_gpu else "nccl"  # (NCCL refuses two ranks on one GPU)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _child(fn, *args) -> None:
    conn = args[-1]
    try:
        torch.set_num_threads(1 if args[0].device == "cpu" else torch.get_num_threads())
        fn(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def measured_link(case: Case):
    """The planner's link model with this machine's measured bandwidths (bytes/s)."""
    from weightsync.engine.plan import LinkModel

    if case.device == "cpu":
        from transfer_cpu import RawSocket

        nbytes = 256 << 20
        raw = RawSocket(nbytes, 4)
        try:
            bw = nbytes / statistics.median(raw.round() for _ in range(4))
        finally:
            raw.close()
        return LinkModel(host_bw=bw, local_bw=bw)
    from transfer_gpu import bound_seconds

    nbytes = 1 << 30
    local = nbytes / statistics.median(bound_seconds(nbytes, 5, dst=0))
    peer = nbytes / statistics.median(bound_seconds(nbytes, 5, dst=1)) if torch.cuda.device_count() > 1 else local
    torch.cuda.empty_cache()
    return LinkModel(host_bw=peer, local_bw=local)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Spawned children, each reporting on its own pipe; an ``error`` report raises; all reaped."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.pipes: list = []

    def start(self, target, *args) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, args=(target, *args, writer), daemon=True)
        p.start()
        writer.close()
        self.procs.append(p)
        self.pipes.append(reader)

    async def reports(self, n: int) -> list:
        """The first report of each of ``n`` children; a child's ``error`` report (or death) raises."""
        from multiprocessing.connection import wait

        loop = asyncio.get_running_loop()
        out, pending = [], list(self.pipes)
        deadline = time.monotonic() + WATCHDOG_S
        while len(out) < n:
            ready = await loop.run_in_executor(None, wait, pending, 0.5)
            if not ready and time.monotonic() > deadline:
                raise TimeoutError(f"{n - len(out)} of {n} processes did not report within {WATCHDOG_S:.0f} s")
            for conn in ready:
                pending.remove(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    raise RuntimeError("a benchmark process died without reporting") from None
                if msg[0] == "error":
                    raise RuntimeError(f"a benchmark process failed:\n{msg[1]}")
                out.append(msg)
        return out

    @staticmethod
    async def guard(work, watch: "asyncio.Future"):
        """``await work``, unless ``watch`` (the children's reports) fails first: then that error."""
        task = asyncio.ensure_future(asyncio.wait_for(work, WATCHDOG_S))
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and watch.exception() is not None:
            task.cancel()
            raise watch.exception()
        return await task

    def close(self) -> None:
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.pipes:
            c.close()
