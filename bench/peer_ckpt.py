"""checkpoint-engine (PyPI ``checkpoint-engine`` 0.4.2), the peer a vLLM user picks, on the same case as
bench/transfer_mn.py: its ``ParameterServer`` ranks on the receivers' GPUs in broadcast mode
(``update(..., ranks=[])``) and plain torch inference processes receiving through
``checkpoint_engine.worker.update_weights_from_ipc``, each keeping its tensor-parallel slice (what vLLM's
``load_weights`` does with the full tensors it is handed). Bit-exact against the same oracle.

How this works: parameter-server rank r runs on receiver r's GPU and owns every N-th trainer tensor
(full tensors: checkpoint-engine takes whole tensors; the FSDP gather it would need first is not timed,
the peer's best case). It registers them once (``register_checkpoint``: pinned host buffers),
``gather_metas`` once, and keeps its process group (``auto_pg=False``: the faster use; the default
re-creates NCCL communicators every update). Every step, as its user sees it: the new weights (on
the GPU, made untimed) are copied into the registered pinned buffers, then ``ps.update`` runs until
every rank's barrier (``update`` returns once its worker acknowledged the last bucket).
``ckpt_step_s`` is both, ``ckpt_update_s`` the update alone, median of the steps after the first.
``req_func`` hands each inference process the ZeroMQ handle of its GPU over a pipe; the inference
process then calls ``update_weights_from_ipc`` with a ``run`` that copies its slices.

Import checkpoint_engine only in the children (CUDA hosts with its wheels: ``make gpu-wheels``).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from mn_setup import Case, Procs, free_port, full_tensor, mismatches, model_shapes, receiver_layout, tp_part

NAME = "bench"


def _pinned(ps, name: str) -> dict[str, torch.Tensor]:
    """Each registered tensor's bytes in the parameter server's pinned buffers (its layout: metas in
    order, each ``aligned_size`` long)."""
    out = {}
    for buf in ps._get_memory_pool(name):
        at = 0
        for meta in buf.metas:
            nbytes = meta.dtype.itemsize * meta.shape.numel()
            out[meta.name] = buf.buffer[at:at + nbytes].view(meta.dtype).view(meta.shape)
            at += meta.aligned_size
    return out


def _only_gpu(case: Case, rank: int) -> str:
    """Receiver ``rank``'s GPU as this process's only one (checkpoint-engine takes its GPU from its rank
    modulo the GPUs it sees; its worker must see the same): "cuda:0"."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(torch.device(case.receiver_device(rank)).index)
    torch.cuda.set_device("cuda:0")
    return "cuda:0"


def _server(case: Case, rank: int, port: int, pair, conn) -> None:
    world = case.receivers
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = _only_gpu(case, rank)
    from checkpoint_engine.ps import ParameterServer

    ps = ParameterServer(rank=rank, world_size=world, auto_pg=False, master_addr="127.0.0.1", master_port=port)
    owned = [p for i, p in enumerate(model_shapes(case.model)) if i % world == rank]
    new = {p.name: full_tensor(p.name, p.shape, 0, case.seed, device) for p in owned}
    ps.register_checkpoint(NAME, named_tensors={n: t.cpu() for n, t in new.items()})
    ps.init_process_group()
    ps.gather_metas(NAME)
    pinned = _pinned(ps, NAME)

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        pair.send(dict(socket_paths))

    steps = []
    for _ in range(case.rounds):
        for t in new.values():  # a training step, as full_tensor makes versions (untimed: the trainer's)
            t.add_(1)
        torch.cuda.synchronize()
        ps.store_based_barrier()
        t0 = time.perf_counter()
        for n, t in new.items():
            pinned[n].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ps.update(NAME, req_func, ranks=[])
        t2 = time.perf_counter()
        steps.append((t2 - t0, t2 - t1))
    pair.send(None)
    conn.send(("ckpt-server", rank, steps[1:]))
    ps.unregister_checkpoint(NAME)


def _worker(case: Case, rank: int, pair, conn) -> None:
    import zmq

    from transfer_mn import _slices

    from weightsync.engine.transforms.layouts import allocate

    device = _only_gpu(case, rank)
    from checkpoint_engine.worker import update_weights_from_ipc

    layout = {e.name: e for e in receiver_layout(case, rank)}
    tensors = allocate(list(layout.values()), device)[0]
    where = _slices({rank: layout}, case)
    uuid = f"GPU-{torch.cuda.get_device_properties(torch.device(device)).uuid!s}"
    ctx = zmq.Context()

    def run(weights: list[tuple[str, torch.Tensor]]) -> None:  # what vLLM's load_weights does with them
        for name, full in weights:
            for r, entry, at in where.get(name, ()):
                keep = tp_part(full, entry, case.receivers, r)
                tensors[entry.name].narrow(0, at, keep.shape[0]).copy_(keep)

    try:
        while (handles := pair.recv()) is not None:
            update_weights_from_ipc(ctx, handles[uuid], device_id=0, run=run)
        conn.send(("ckpt-worker", rank, mismatches(case, rank, tensors, list(layout.values()), case.rounds, device)))
    finally:
        ctx.term()


async def ckpt(case: Case) -> dict:
    """checkpoint-engine's steps on ``case`` (FP8 receivers excluded: vLLM quantizes in load_weights)."""
    procs = Procs()
    port = free_port()
    try:
        for r in range(case.receivers):
            mine, theirs = procs.ctx.Pipe()
            procs.start(_worker, case, r, theirs)
            procs.start(_server, case, r, port, mine)
        done = await procs.reports(2 * case.receivers)
    finally:
        procs.close()
    steps = next(got for kind, r, got in done if kind == "ckpt-server" and r == 0)
    bad = [f"receiver {r}: {n}" for kind, r, got in done if kind == "ckpt-worker" for n in got]
    return {"step_s": [s for s, _ in steps], "update_s": [u for _, u in steps], "ok": not bad, "mismatches": bad,
            "step_ms": round(statistics.median(s for s, _ in steps) * 1e3, 3),
            "update_ms": round(statistics.median(u for _, u in steps) * 1e3, 3)}
