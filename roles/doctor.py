"""``weightsync doctor``: check this machine and say what to fix. Probes; never aborts the process.

Checks: Python and package versions; CUDA GPUs and peer access between each pair; RDMA devices;
whether ``uccl`` is installed and importable (imported in a child process: a bad install must not take
the doctor down) and which transport ``auto`` would pick; NCCL; that a loopback port can be bound; and,
given a controller address, that it answers a status request.
"""

from __future__ import annotations

import asyncio
import importlib.util
import platform
import socket
import subprocess
import sys
from typing import Optional

import torch

from weightsync.engine.transport import TransportOptions
from weightsync.engine.transports.auto import available_kinds
from weightsync.engine.transports.uccl import rdma_devices, uccl_unavailable_reason

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _check_gpus() -> list[tuple[str, str, str]]:
    if not torch.cuda.is_available():
        return [(WARN, "gpus", "no CUDA GPU: transports tcp and memory only (fine for CPU runs)")]
    n = torch.cuda.device_count()
    rows = [(OK, "gpus", f"{n} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")]
    for a in range(n):
        for b in range(n):
            if a < b:
                peer = torch.cuda.can_device_access_peer(a, b)
                rows.append((OK if peer else WARN, f"peer access {a}<->{b}",
                             "yes" if peer else "no: same-host copies between them go through host memory"))
    try:
        rows.append((OK, "nccl", ".".join(map(str, torch.cuda.nccl.version()))))
    except Exception as exc:  # NCCL missing from this torch build
        rows.append((WARN, "nccl", f"unavailable: {exc}"))
    return rows


def _check_uccl(uccl_tcp: bool) -> list[tuple[str, str, str]]:
    nics = rdma_devices()
    rows = [(OK if nics else WARN, "rdma devices", ", ".join(nics) if nics else
             "none in /sys/class/infiniband: uccl cannot build an RDMA endpoint here")]
    if importlib.util.find_spec("uccl") is None:
        rows.append((WARN, "uccl", "not installed (pip install 'weightsync[rdma]' on Python >= 3.12, x86-64)"))
        return rows
    probe = subprocess.run([sys.executable, "-c", "from uccl import p2p"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        rows.append((FAIL, "uccl", f"installed but does not import: {probe.stderr.strip().splitlines()[-1:]}"))
    else:
        reason = uccl_unavailable_reason(TransportOptions(device="cuda:0", uccl_tcp=uccl_tcp))
        rows.append((OK if reason is None else WARN, "uccl", "importable" + (f"; not usable: {reason}" if reason else "")))
    return rows


def _check_port() -> tuple[str, str, str]:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return OK, "loopback port", f"can bind (e.g. {s.getsockname()[1]})"
    except OSError as exc:
        return FAIL, "loopback port", f"cannot bind on 127.0.0.1: {exc}"


async def _check_controller(addr: str, auth_key: Optional[bytes]) -> tuple[str, str, str]:
    from weightsync.wire import messages as m

    from .daemon import request

    try:
        env = await request(addr, m.StatusRequest(False), timeout_s=5.0, auth_key=auth_key)
    except asyncio.TimeoutError:
        return FAIL, "controller", f"{addr} did not answer within 5 s (not running, wrong address, or auth key)"
    peers = env.body.status.get("peers", []) if isinstance(env.body.status, dict) else []
    return OK, "controller", f"{addr} answers: {len(peers)} peers joined"


def run_checks(controller: Optional[str] = None, auth_key: Optional[bytes] = None,
               uccl_tcp: bool = False) -> list[tuple[str, str, str]]:
    rows = [(OK, "python", f"{platform.python_version()} on {platform.machine()}"),
            (OK, "torch", torch.__version__)]
    rows += _check_gpus()
    rows += _check_uccl(uccl_tcp)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    rows.append((OK, "auto transport", " > ".join(available_kinds(TransportOptions(device=device, uccl_tcp=uccl_tcp)))))
    rows.append(_check_port())
    if controller:
        rows.append(asyncio.run(_check_controller(controller, auth_key)))
    return rows


def report(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(name) for _, name, _ in rows)
    return "\n".join(f"[{status:>4}] {name:<{width}}  {detail}" for status, name, detail in rows)
