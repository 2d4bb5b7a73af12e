"""cuda_ipc's compiled tables: a plan's direct rows as the launches that replay them every round.

How this works. ``compile_table`` takes the rows of one connection with their sender GPU, target GPU
and mapped destination address, groups them by link (sender GPU, target GPU) and kind (dense rows, and
pitched ones: blocks of a rank's own rows, landing back to back), and builds each group's launch once:

| rows | same GPU (colocated) | into another GPU (``TransportOptions.peer_copies``) |
| --- | --- | --- |
| dense | one copy kernel launch (``engine.cuda.copy_kernel.CopyKernel``) | the kernel storing into the peer's mapped memory, or ``cudaMemcpyBatchAsync`` calls of ``chunk_rows`` rows on two copy streams (``Striped``), or the faster of both timed per link (``engine.cuda.fastest``) |
| pitched | one descriptor-table launch (``PitchedKernel``) | the same choice, with a ``cudaMemcpy2DAsync`` per row as the copy engines' way |

Without Triton every group goes the copy engines' way; with ``pitched_kernel`` off pitched rows do. The
kernels' grids are bounded where the sender also copies into another target (``TransportOptions.kernel_grid``
programs per SM, ``grid_per_sm``): the kernel into the colocated receiver and the one into another GPU,
on their connections' own streams, share the SMs and run at once.
A replay (``CudaIpcConnection.replay``) queues each launch on a copy stream of its sender GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import torch

from ..cuda import cuda_rt
from ..cuda.fastest import FastestLaunch

if TYPE_CHECKING:
    from ..datapath.compiled import CopyRow
    from .cuda_ipc import CudaIpcTransport

class IpcTable:
    """A compiled table for cuda_ipc: (sender device, a launch with ``launch(stream)``) in order."""

    def __init__(self, launches: list, count: int, nbytes: int) -> None:
        self.launches, self.count, self.nbytes = launches, count, nbytes

    def __repr__(self) -> str:
        return f"<cuda_ipc table {self.count} rows in {len(self.launches)} launches>"


def compile_table(placed: Sequence[tuple[CopyRow, int, int, int]], owner: CudaIpcTransport,
                  chunk_rows: int) -> IpcTable:
    """Each link's dense and pitched rows as one launch each (the module's table); ``placed``: each row
    with its sender GPU, its target GPU and its destination address."""
    dense: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    pitched: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
    for row, device, target, dst in placed:
        if row.pitch:
            pitched.setdefault((device, target), []).append((dst, row.src.data_ptr(), row.nbytes // row.height,
                                                             row.height, row.pitch))
        else:
            dense.setdefault((device, target), []).append((dst, row.src.data_ptr(), row.nbytes))
    launches = [(device, _pitched(copies, device, target, owner)) for (device, target), copies in sorted(pitched.items())]
    launches += [(device, _dense(copies, device, target, owner, chunk_rows))
                 for (device, target), copies in sorted(dense.items())]
    return IpcTable(launches, len(placed), sum(row.nbytes for row, *_ in placed))


def _pitched(copies: list, device: int, target: int, owner: "CudaIpcTransport"):
    kernels = copy_kernel()
    dma = cuda_rt.PitchedCopies(copies)
    if kernels is None or not owner.options.pitched_kernel:
        return dma
    kernel = kernels.PitchedKernel(copies, device, programs(device, target, owner))
    return kernel if device == target else _peer(kernel, dma, device, target, f"pitched {len(copies)} rows", owner)


def _dense(copies: list, device: int, target: int, owner: "CudaIpcTransport", chunk_rows: int):
    kernels = copy_kernel()
    dma = Striped([cuda_rt.BatchCopies(copies[i:i + chunk_rows], device, target)
                   for i in range(0, len(copies), chunk_rows)], owner, device)
    if kernels is None:
        return dma
    kernel = kernels.CopyKernel(copies, device, target, programs=programs(device, target, owner))
    return kernel if device == target else _peer(kernel, dma, device, target, f"dense {len(copies)} rows", owner)


def programs(device: int, target: int, owner: "CudaIpcTransport") -> int:
    """A copy kernel's grid bound on ``device``: ``grid_per_sm`` times its SM count (0: a program per piece)."""
    targets = {t for conn in owner.live for t in conn.targets}
    per_sm = grid_per_sm(device, target, targets, owner.options.kernel_grid)
    return round(per_sm * torch.cuda.get_device_properties(device).multi_processor_count) if per_sm else 0


def grid_per_sm(device: int, target: int, targets: set, kernel_grid: tuple[float, float]) -> float:
    """Programs per SM for a kernel copying from ``device`` into ``target`` while the sender's open
    connections reach ``targets``: ``kernel_grid``'s (same GPU, another GPU) share where some other
    target's copies run beside it, so that the two kernels share the SMs; 0 (a program per piece, the
    whole GPU for this one) where this target is the only one (1 -> 1: a bound grid would only slow it:
    7% on a lone same-GPU copy, bench/diagnostics/copy_overlap.py)."""
    if not targets - {target}:
        return 0.0
    return kernel_grid[0 if device == target else 1]


def _peer(kernel, dma, device: int, target: int, kind: str, owner: "CudaIpcTransport"):
    mode = owner.options.peer_copies
    if mode != "fastest":
        return kernel if mode == "kernel" else dma
    # (timings compare within one set of rows: a shadow receiver's two tables share theirs, another
    #  connection over the same link has its own)
    link = f"cuda:{device}->cuda:{target} {kind} {kernel.nbytes} B"
    return FastestLaunch({"kernel": kernel, "dma": dma}, link, owner.trials_of(link))


class Striped:
    """Launches of one device alternated over the two copy streams of a connection's lane (two streams of
    batch calls beat one across GPUs: bench/diagnostics/copy_batches.py), joined back into the stream
    ``launch`` gets."""

    def __init__(self, parts: list, owner: "CudaIpcTransport", device: int) -> None:
        self.parts, self.owner, self.device = parts, owner, device

    def launch(self, stream: torch.cuda.Stream) -> None:
        if len(self.parts) < 2:
            for part in self.parts:
                part.launch(stream)
            return
        side = self.owner.copies.partner(self.device, stream)
        side.wait_stream(stream)
        for i, part in enumerate(self.parts):
            part.launch(stream if i % 2 == 0 else side)
        stream.wait_stream(side)


@functools.lru_cache(maxsize=1)
def copy_kernel():
    """``weightsync.engine.cuda.copy_kernel`` where Triton imports, else None (rows then go by the copy engines)."""
    try:
        from ..cuda import copy_kernel as module
    except ImportError:
        return None
    return module
