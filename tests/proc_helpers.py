"""Deterministic weight sets and child-process entry points for end-to-end tests.

Every tensor's values are a pure function of (name, version), so a receiver can check bit-exactness on
its own. Each child reports to the parent on its own pipe (``out.send``): ("joined" | "committed" |
"aborted" | "blocked" | "error", role, rank, data). One pipe per child, because a child killed while
writing to a shared multiprocessing.Queue would leave its lock held and silence every other child.
"""

from __future__ import annotations

import asyncio
import os
import traceback

import torch

# name -> (shape, dtype, how the sender holds it)
SPEC = {
    "embed.weight": ((37, 16), torch.float32, "plain"),
    "lm_head.weight": ((37, 16), torch.float32, "tied:embed.weight"),
    "blocks.0.attn.w": ((16, 48), torch.bfloat16, "plain"),
    "blocks.0.mlp.w": ((48, 16), torch.float32, "transposed"),  # a non-contiguous source
    "blocks.0.norm": ((16,), torch.bfloat16, "plain"),
    "blocks.0.odd": ((3, 5, 7), torch.float32, "plain"),
    "empty": ((0, 4), torch.float32, "plain"),
    "scalar": ((), torch.float32, "plain"),
    "step": ((), torch.int64, "plain"),
    "counts": ((11,), torch.int64, "plain"),
    "big": ((512, 256), torch.float32, "plain"),
}

# a MoE-shaped set: the above plus many per-expert tensors (a compiled round's many rows, no checksum needed)
MOE_SPEC = {**SPEC, **{f"layers.{layer}.mlp.experts.{e}.{proj}.weight": (shape, torch.bfloat16, "plain")
                       for layer in range(2) for e in range(64)
                       for proj, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96)))}}
SPECS = {"default": SPEC, "moe": MOE_SPEC}


def value(name: str, shape, dtype, version: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash_name(name) * 1000 + version)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def hash_name(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 100_003


def sender_tensors(version: int, spec=SPEC, device: str = "cpu") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype, how) in spec.items():
        if how.startswith("tied:"):
            out[name] = out[how.split(":", 1)[1]]
        elif how == "transposed":
            base = value(name, shape, dtype, version).t().contiguous().to(device)  # stored transposed ...
            out[name] = base.t()  # ... so the logical tensor is a non-contiguous view
        else:
            out[name] = value(name, shape, dtype, version).to(device)
    return out


async def push(sender, tensors: dict[str, torch.Tensor], version: int, watchdog: float = 30) -> int:
    """Write version's values into the sender's tensors, push them and wait for the commit."""
    update_in_place(tensors, version)
    handle = await asyncio.wait_for(sender.push(version), watchdog)
    return await asyncio.wait_for(handle, watchdog)


def update_in_place(tensors: dict[str, torch.Tensor], version: int, spec=SPEC) -> None:
    """Write version's values into the sender's existing tensors (as an optimizer step would)."""
    for name, (shape, dtype, how) in spec.items():
        if not how.startswith("tied:"):
            tensors[name].copy_(value(name, shape, dtype, version).to(tensors[name].device))


def receiver_tensors(spec=SPEC, tie: bool = True, device: str = "cpu") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype, how) in spec.items():
        if how.startswith("tied:") and tie:
            out[name] = out[how.split(":", 1)[1]]
        else:
            out[name] = torch.full(shape, 7, dtype=dtype, device=device)
    return out


def mismatches(tensors: dict[str, torch.Tensor], version: int, spec=SPEC) -> list[str]:
    bad = []
    for name, (shape, dtype, how) in spec.items():
        source = how.split(":", 1)[1] if how.startswith("tied:") else name  # a tied name reads its target
        want = value(source, shape, dtype, version)
        got = tensors[name].cpu()
        if got.dtype != dtype or tuple(got.shape) != tuple(shape) or not torch.equal(got, want):
            bad.append(name)
    return bad


# --- child processes -----------------------------------------------------------------------------


def _options(cls, transport: str, uccl_tcp: bool):
    from weightsync.engine.transport import TransportOptions

    if uccl_tcp:
        os.environ.setdefault("UCCL_P2P_TRANSPORT", "tcp")  # a test child: UCCL reads it at import
    # a short rejoin deadline: when a test's controller goes away for good, its children end soon after
    return cls(transport=transport, transport_options=TransportOptions(uccl_tcp=uccl_tcp), rejoin_deadline_s=2.0)


def sender_main(addr: str, rank: int, versions: list[int], out, block_at: int = -1,
                transport: str = "tcp", device: str = "cpu", uccl_tcp: bool = False, spec: str = "default") -> None:
    try:
        asyncio.run(_sender(addr, rank, versions, out, block_at, transport, device, uccl_tcp, SPECS[spec]))
    except BaseException:
        out.send(("error", "sender", rank, traceback.format_exc()))


def _watchdog(device: str) -> None:
    """On GPU runs, dump every thread's stack if a child is stuck (diagnosis, not synchronisation)."""
    if device.startswith("cuda"):
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(45, repeat=False, file=sys.stderr)


async def _sender(addr, rank, versions, out, block_at, transport, device, uccl_tcp, spec=SPEC) -> None:
    from weightsync.roles import SenderOptions, WeightSender

    _watchdog(device)
    torch.set_num_threads(1)
    tensors = sender_tensors(0, spec, device=device)
    async with WeightSender(addr, tensors, rank=rank, options=_options(SenderOptions, transport, uccl_tcp)) as sender:
        out.send(("joined", "sender", rank, None))
        if block_at >= 0:
            _block_after_first_write(sender, block_at, out, rank)
        for v in versions:
            update_in_place(tensors, v, spec)
            try:
                handle = await sender.push(v)
                await handle
                out.send(("committed", "sender", rank, v))
            except Exception as exc:  # reported, not raised: the parent decides
                out.send(("aborted", "sender", rank, (v, repr(exc))))


def _block_after_first_write(sender, version: int, out, rank: int) -> None:
    """Make the round for ``version`` hang after its first transfer, and tell the parent (to kill us)."""
    real_stage = sender.sources.stage
    staged = {"n": 0}

    async def stage(t, *args):
        if sender._last_version == version:
            staged["n"] += 1
            if staged["n"] == 2:
                out.send(("blocked", "sender", rank, version))
                await asyncio.Event().wait()  # until SIGKILL
        return await real_stage(t, *args)

    sender.sources.stage = stage


def receiver_main(addr: str, rank: int, versions: list[int], out, mode: str = "shadow", tie: bool = True,
                  transport: str = "tcp", device: str = "cpu", uccl_tcp: bool = False, spec: str = "default") -> None:
    try:
        asyncio.run(_receiver(addr, rank, versions, out, mode, tie, transport, device, uccl_tcp, SPECS[spec]))
    except BaseException:
        out.send(("error", "receiver", rank, traceback.format_exc()))


async def _receiver(addr, rank, versions, out, mode, tie, transport, device, uccl_tcp, spec=SPEC) -> None:
    from weightsync.roles import ReceiverOptions, WeightReceiver

    _watchdog(device)
    torch.set_num_threads(1)
    tensors = receiver_tensors(spec, tie=tie, device=device)
    receiver = WeightReceiver(addr, tensors, rank=rank, mode=mode,
                              options=_options(ReceiverOptions, transport, uccl_tcp))

    def on_abort(version: int, why: str) -> None:
        current = receiver.version
        intact = current is None or not mismatches(tensors, current, spec)
        out.send(("aborted", "receiver", rank, (version, current, intact)))

    receiver.on_abort = on_abort
    async with receiver:
        out.send(("joined", "receiver", rank, None))
        for v in versions:
            await receiver.wait_for(v)
            out.send(("committed", "receiver", rank, (v, receiver.version, mismatches(tensors, receiver.version, spec))))
        out.send(("swaps", "receiver", rank, receiver.storage_swaps))  # commits made by exchanging memory
