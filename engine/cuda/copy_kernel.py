"""Many device-to-device copies in one GPU launch (Triton): a compiled round's replay into the same GPU or a peer's.

How this works. A trainer and an inference engine on the same GPU (colocated) exchange weights as
device-to-device copies; thousands of them (a MoE model's per-expert tensors) issued one by one cost
microseconds of launch each, far more than the bytes take. ``CopyKernel(copies, device)`` takes the
``(dst, src, nbytes)`` pointer triples once per plan and cuts every copy into pieces of at most
``tile * steps`` words (128 KiB by default); the pieces' (source offset, destination offset, length) go into one int64 table (``pitched_table.dense``) on
the GPU, offsets counted in 4-byte words from the lowest source and destination (kernel arguments,
so the compiler knows their alignment; ``fp8_kernel.DeviceAddress`` stands for a raw address). ``launch``
then runs one program per piece, or a bounded grid of programs each looping over every ``programs``-th
piece (``grid``: so two copy kernels on two streams share the GPU), copying words in 16-byte
vectors: one launch per round, whatever the tensor count, made through the compiled kernel's own
launcher with its arguments bound once (``launches.Launch``). Copies whose addresses or length are not 16-byte multiples (rare: odd
shapes) go as pointer copies (``cuda_rt.memcpy_batch_async``) on the same stream.

The module imports Triton at import time: import it only where CUDA is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from ..transforms.fp8_kernel import DeviceAddress
from . import cuda_rt, pitched_table
from .launches import Launch

TILE = 4096  # 4-byte words per step of a program (8 per thread: two 16-byte vectors)
STEPS = 8  # steps per program: a piece is TILE * STEPS words (128 KiB)
WARPS = 16  # (bench/diagnostics/copy_kernel.py times other shapes: this one was the fastest on every model)
ALIGN = 16


@triton.jit
def _copy_pieces_kernel(table, src, dst, pieces, TILE: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.arange(0, TILE)
    for piece in tl.range(tl.program_id(0), pieces, tl.num_programs(0)):  # (a program per piece, or fewer looping)
        p = piece  # (table offsets stay far below 2**31: pieces * 6)
        src_at = tl.multiple_of(tl.load(table + p * 3), 4)
        dst_at = tl.multiple_of(tl.load(table + p * 3 + 1), 4)
        words = tl.multiple_of(tl.load(table + p * 3 + 2), 4)
        for step in tl.static_range(STEPS):
            at = step * TILE + offs
            mask = at < words
            tl.store(dst + dst_at + at, tl.load(src + src_at + at, mask=mask), mask=mask)


def grid(pieces: int, programs: Optional[int]) -> int:
    """Programs to launch for ``pieces``: one each, or at most ``programs`` that loop over them. A bounded
    grid leaves room on the GPU for a kernel of another stream: a grid of one program per piece (tens of
    thousands for a model) fills every SM until its last pieces are dispatched, so a second copy kernel
    (the one storing into another GPU beside the colocated copy) would start only when the first ends."""
    return pieces if not programs else max(1, min(pieces, programs))


def _table_launch(fn, kernel, programs: Optional[int], meta: dict, direct: Optional[bool] = None) -> Launch:
    """``fn`` over ``kernel``'s piece table (``table``, ``pieces``, ``src_base``, ``dst_base``, ``device``):
    the launch its rounds replay (``launches.Launch``)."""
    where = torch.device("cuda", kernel.device)
    return Launch(fn, grid(kernel.pieces, programs),
                  (kernel.table, DeviceAddress(kernel.src_base, torch.int32, where),
                   DeviceAddress(kernel.dst_base, torch.int32, where), kernel.pieces), meta, kernel.device, direct=direct)


class CopyKernel:
    """A fixed list of copies from ``device``'s memory, launched as one kernel on it (plus pointer copies for
    the unaligned); the destinations are on ``target`` (default: the same device; another GPU's memory
    mapped with peer access on, the kernel storing across the link)."""

    def __init__(self, copies: Sequence[tuple[int, int, int]], device: int, target: Optional[int] = None, *,
                 tile: int = TILE, steps: int = STEPS, warps: int = WARPS, programs: Optional[int] = None,
                 direct: Optional[bool] = None) -> None:
        self.device, self.tile, self.steps, self.warps, self.programs = device, tile, steps, warps, programs
        self.target = device if target is None else target
        aligned = [c for c in copies if c[2] and not (c[0] | c[1] | c[2]) % ALIGN]
        self.rest = [c for c in copies if c[2] and (c[0] | c[1] | c[2]) % ALIGN]
        self.pieces = 0
        self.nbytes = sum(c[2] for c in copies)
        self.launcher: Optional[Launch] = None
        if not aligned:
            return
        table, self.src_base, self.dst_base = pitched_table.dense(aligned, tile * steps * 4)
        self.pieces = len(table)
        self.table = table.to(f"cuda:{device}")
        self.launcher = _table_launch(_copy_pieces_kernel, self, programs,
                                      {"TILE": tile, "STEPS": steps, "num_warps": warps}, direct)

    def __repr__(self) -> str:
        return (f"<CopyKernel pieces={self.pieces} of {self.tile * self.steps * 4} bytes, {self.warps} warps, "
                f"{grid(self.pieces, self.programs)} programs, pointer_copies={len(self.rest)} bytes={self.nbytes}>")

    def launch(self, stream: torch.cuda.Stream) -> None:
        """Queue every copy on ``stream`` (a stream of ``device``)."""
        if self.launcher is not None:
            self.launcher(stream)
        if self.rest:
            cuda_rt.memcpy_batch_async(self.rest, stream, self.device, self.target)


@triton.jit
def _pitched_pieces_kernel(table, src, dst, pieces, TILE: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr):
    offs = tl.arange(0, TILE)
    for piece in tl.range(tl.program_id(0), pieces, tl.num_programs(0)):
        p = piece  # (table offsets stay far below 2**31: pieces * 6)
        src_at = tl.load(table + p * 6)
        dst_at = tl.load(table + p * 6 + 1)
        width = tl.load(table + p * 6 + 2)
        height = tl.load(table + p * 6 + 3)
        src_pitch = tl.load(table + p * 6 + 4)
        dst_pitch = tl.load(table + p * 6 + 5)
        if VEC:  # (every offset, width and pitch a multiple of 4 words: 16-byte vectors)
            src_at, dst_at = tl.multiple_of(src_at, 4), tl.multiple_of(dst_at, 4)
            width = tl.multiple_of(width, 4)
            src_pitch, dst_pitch = tl.multiple_of(src_pitch, 4), tl.multiple_of(dst_pitch, 4)
        across = offs < width
        for r in tl.static_range(ROWS):
            mask = across & (offs * 0 + r < height)  # (a vector compare: the interpreter needs one)
            tl.store(dst + dst_at + r * dst_pitch + offs, tl.load(src + src_at + r * src_pitch + offs, mask=mask),
                     mask=mask)


class PitchedKernel:
    """Pitched copies ``(dst, src, width, height, pitch)`` from one device (into the same GPU, or into a
    peer's mapped memory: cuda_ipc times both against the copy engines, ``engine.cuda.fastest``), as one
    launch of a descriptor table (``engine.cuda.pitched_table``: one program per
    piece of at most ``ROWS`` rows of ``TILE`` words); copies it cannot address (not 4-byte aligned)
    go as ``cudaMemcpy2DAsync`` calls on the same stream. Where every copy's addresses, width and pitch
    are 16-byte multiples (bf16 TP slices of even widths), the kernel moves 16-byte vectors (``vec``)."""

    def __init__(self, copies, device: int, programs: Optional[int] = None, *, tile: int = pitched_table.TILE,
                 rows: int = pitched_table.ROWS, warps: int = pitched_table.WARPS, vec: Optional[bool] = None) -> None:
        self.device, self.programs = device, programs
        t = pitched_table.table(copies, tile, rows)
        self.vec = pitched_table.vectors(copies) if vec is None else vec
        self.pieces, self.nbytes, self.src_base, self.dst_base = len(t), t.nbytes, t.src_base, t.dst_base
        self.table = t.pieces.to(f"cuda:{device}") if len(t) else None
        self.rest = cuda_rt.PitchedCopies(t.rest)
        self.launcher: Optional[Launch] = None
        if self.table is not None:
            self.launcher = _table_launch(_pitched_pieces_kernel, self, programs,
                                          {"TILE": tile, "ROWS": rows, "VEC": self.vec, "num_warps": warps})

    def __repr__(self) -> str:
        return (f"<PitchedKernel pieces={self.pieces} {grid(self.pieces, self.programs)} programs vec={self.vec} bytes={self.nbytes} "
                f"pointer_copies={len(self.rest.copies)}>")

    def launch(self, stream: torch.cuda.Stream) -> None:
        if self.launcher is not None:
            self.launcher(stream)
        self.rest.launch(stream)
