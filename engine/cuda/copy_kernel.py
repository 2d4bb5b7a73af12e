"""Many device-to-device copies in one GPU launch (Triton): a compiled round's replay into the same GPU or a peer's.

How this works. A trainer and an inference engine on the same GPU (colocated) exchange weights as
device-to-device copies; thousands of them (a MoE model's per-expert tensors) issued one by one cost
microseconds of launch each, far more than the bytes take. ``CopyKernel(copies, device)`` takes the
``(dst, src, nbytes)`` pointer triples once per plan and cuts every copy into pieces of at most
``tile * steps`` words (64 KiB by default); the pieces' (source offset, destination offset, length) go into one int64 table (``pitched_table.dense``) on
the GPU, offsets counted in 4-byte words from the lowest source and destination (kernel arguments,
so the compiler knows their alignment; ``fp8_kernel.DeviceAddress`` stands for a raw address). ``launch``
then runs one program per piece, or a bounded grid of programs each looping over every ``programs``-th
piece (``grid``: so two copy kernels on two streams share the GPU), copying words in 16-byte
vectors: one launch per round, whatever the tensor count. Copies whose addresses or length are not 16-byte multiples (rare: odd
shapes) go as pointer copies (``cuda_rt.memcpy_batch_async``) on the same stream.

Fingerprints in the same pass (``launch(prints=True)``, a checked round's): ``fp64`` (``engine.datapath.checksums``)
is ``sum(w(i) * word(i)) mod 2**64`` over a copy's signed int32 words, ``w(i) = i mod 65521 + 1``, so each
program also adds up the words it copies times their weights (its piece's first word's position in its
copy mod 65521 comes from a second small table, ``pitched_table.dense_owners``; below 2**61 a piece, exact
in int64), stores the piece's sum, and the launch folds each copy's pieces as low and high 32-bit halves
(``index_add``) and copies them to pinned host memory behind it: the sender's fingerprints of what it
sends without reading the model a second time (``prints``).

The module imports Triton at import time: import it only where CUDA is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from ..transforms.fp8_kernel import DeviceAddress
from . import cuda_rt, pitched_table

TILE = 2048  # 4-byte words per step of a program
STEPS = 8  # steps per program: a piece is TILE * STEPS words (64 KiB)
WARPS = 8  # (bench/diagnostics/copy_kernel.py measures other shapes)
ALIGN = 16


@triton.jit
def _copy_pieces_kernel(table, src, dst, pieces, starts, partials, TILE: tl.constexpr, STEPS: tl.constexpr,
                        PRINT: tl.constexpr):
    offs = tl.arange(0, TILE)
    for piece in tl.range(tl.program_id(0), pieces, tl.num_programs(0)):  # (a program per piece, or fewer looping)
        p = piece  # (table offsets stay far below 2**31: pieces * 6)
        src_at = tl.multiple_of(tl.load(table + p * 3), 4)
        dst_at = tl.multiple_of(tl.load(table + p * 3 + 1), 4)
        words = tl.multiple_of(tl.load(table + p * 3 + 2), 4)
        if PRINT:  # the piece's share of its row's fp64: each word times its weight (the module's header)
            start = tl.load(starts + p).to(tl.int32)
            acc = tl.zeros([TILE], dtype=tl.int64)
        for step in tl.static_range(STEPS):
            at = step * TILE + offs
            mask = at < words
            word = tl.load(src + src_at + at, mask=mask)
            tl.store(dst + dst_at + at, word, mask=mask)
            if PRINT:
                w = start + at
                w = tl.where(w >= 65521, w - 65521, w) + 1
                acc += tl.where(mask, word.to(tl.int64) * w.to(tl.int64), 0)
        if PRINT:
            tl.store(partials + p, tl.sum(acc, axis=0))


def fold(halves: torch.Tensor, owners: torch.Tensor, partials: torch.Tensor) -> None:
    """Each copy's pieces' sums (``partials``, int64; ``owners``: each piece's copy) added up into
    ``halves`` ([copies, 2]: low and high 32-bit halves, so no sum overflows at any size)."""
    halves.zero_()
    halves[:, 0].index_add_(0, owners, partials & 0xFFFFFFFF)
    halves[:, 1].index_add_(0, owners, partials >> 32)


def values(halves: torch.Tensor) -> list[int]:
    """``fold``'s halves (on the host) -> each copy's ``fp64``."""
    mask = (1 << 64) - 1
    return [((high << 32) + low) & mask for low, high in halves.tolist()]


def grid(pieces: int, programs: Optional[int]) -> int:
    """Programs to launch for ``pieces``: one each, or at most ``programs`` that loop over them. A bounded
    grid leaves room on the GPU for a kernel of another stream: a grid of one program per piece (tens of
    thousands for a model) fills every SM until its last pieces are dispatched, so a second copy kernel
    (the one storing into another GPU beside the colocated copy) would start only when the first ends."""
    return pieces if not programs else max(1, min(pieces, programs))


class CopyKernel:
    """A fixed list of copies from ``device``'s memory, launched as one kernel on it (plus pointer copies for
    the unaligned); the destinations are on ``target`` (default: the same device; another GPU's memory
    mapped with peer access on, the kernel storing across the link). ``launch(stream, prints=True)``
    also adds up the ``fp64`` of every copy the kernel makes, from the words it reads (``prints``)."""

    def __init__(self, copies: Sequence[tuple[int, int, int]], device: int, target: Optional[int] = None, *,
                 tile: int = TILE, steps: int = STEPS, warps: int = WARPS, programs: Optional[int] = None) -> None:
        self.device, self.tile, self.steps, self.warps, self.programs = device, tile, steps, warps, programs
        self.target = device if target is None else target
        self.printed = [i for i, c in enumerate(copies) if c[2] and not (c[0] | c[1] | c[2]) % ALIGN]
        aligned = [copies[i] for i in self.printed]
        self._sizes = [c[2] for c in aligned]
        self.rest = [c for c in copies if c[2] and (c[0] | c[1] | c[2]) % ALIGN]
        self.pieces = 0
        self.nbytes = sum(c[2] for c in copies)
        self._sums: Optional[tuple] = None  # (owners, starts, partials, halves, host): ``prints``, made once
        self._event: Optional[torch.cuda.Event] = None
        if not aligned:
            return
        table, self.src_base, self.dst_base = pitched_table.dense(aligned, tile * steps * 4)
        self.pieces = len(table)
        self.table = table.to(f"cuda:{device}")

    def __repr__(self) -> str:
        return (f"<CopyKernel pieces={self.pieces} of {self.tile * self.steps * 4} bytes, {self.warps} warps, "
                f"{grid(self.pieces, self.programs)} programs, pointer_copies={len(self.rest)} bytes={self.nbytes}>")

    def launch(self, stream: torch.cuda.Stream, prints: bool = False) -> None:
        """Queue every copy on ``stream`` (a stream of ``device``); with ``prints``, fingerprint the
        kernel's copies (``printed``: their indices in the list) as it makes them, read by ``prints``."""
        if self.pieces:
            device = torch.device("cuda", self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                sums = self._prepared() if prints else None
                _copy_pieces_kernel[(grid(self.pieces, self.programs),)](
                    self.table, DeviceAddress(self.src_base, torch.int32, device),
                    DeviceAddress(self.dst_base, torch.int32, device), self.pieces,
                    sums[1] if sums else self.table, sums[2] if sums else self.table,
                    TILE=self.tile, STEPS=self.steps, PRINT=bool(sums), num_warps=self.warps)
                if sums:
                    owners, _, partials, halves, host = sums
                    fold(halves, owners, partials)
                    host.copy_(halves, non_blocking=True)
                    self._event = torch.cuda.Event()
                    self._event.record(stream)
        if self.rest:
            cuda_rt.memcpy_batch_async(self.rest, stream, self.device, self.target)

    async def prints(self) -> list[int]:
        """The ``fp64`` of each copy of ``printed``, from the last ``launch(prints=True)``, once it is done."""
        if self._event is None or self._sums is None:
            return []
        await cuda_rt.wait_event(self._event)
        return values(self._sums[4])

    def _prepared(self) -> tuple:
        if self._sums is None:
            device = f"cuda:{self.device}"
            owners, starts = pitched_table.dense_owners(self._sizes, self.tile * self.steps * 4)
            halves = torch.zeros((len(self.printed), 2), dtype=torch.int64, device=device)
            self._sums = (owners.to(device), starts.to(device), torch.empty(self.pieces, dtype=torch.int64, device=device),
                          halves, torch.empty(halves.shape, dtype=torch.int64, pin_memory=True))
        return self._sums


@triton.jit
def _pitched_pieces_kernel(table, src, dst, pieces, TILE: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.arange(0, TILE)
    for piece in tl.range(tl.program_id(0), pieces, tl.num_programs(0)):
        p = piece  # (table offsets stay far below 2**31: pieces * 6)
        src_at = tl.load(table + p * 6)
        dst_at = tl.load(table + p * 6 + 1)
        width = tl.load(table + p * 6 + 2)
        height = tl.load(table + p * 6 + 3)
        src_pitch = tl.load(table + p * 6 + 4)
        dst_pitch = tl.load(table + p * 6 + 5)
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
    go as ``cudaMemcpy2DAsync`` calls on the same stream."""

    def __init__(self, copies, device: int, programs: Optional[int] = None) -> None:
        self.device, self.programs = device, programs
        t = pitched_table.table(copies)
        self.pieces, self.nbytes, self.src_base, self.dst_base = len(t), t.nbytes, t.src_base, t.dst_base
        self.table = t.pieces.to(f"cuda:{device}") if len(t) else None
        self.rest = cuda_rt.PitchedCopies(t.rest)

    def __repr__(self) -> str:
        return (f"<PitchedKernel pieces={self.pieces} {grid(self.pieces, self.programs)} programs bytes={self.nbytes} "
                f"pointer_copies={len(self.rest.copies)}>")

    def launch(self, stream: torch.cuda.Stream) -> None:
        if self.table is not None:
            device = torch.device("cuda", self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                _pitched_pieces_kernel[(grid(self.pieces, self.programs),)](
                    self.table, DeviceAddress(self.src_base, torch.int32, device),
                    DeviceAddress(self.dst_base, torch.int32, device), self.pieces,
                    TILE=pitched_table.TILE, ROWS=pitched_table.ROWS, num_warps=4)
        self.rest.launch(stream)
