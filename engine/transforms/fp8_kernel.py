"""Block FP8 quantization of many tensors in one GPU launch (Triton), for the sender's FP8 transforms.

How this works. ``quantize_many(xs, block)`` takes 2-D tensors of one float dtype on one GPU, any
strides (a transposed or TP-sliced view is read in place), and returns ``(fp8, scale_inv)`` per tensor,
exactly the layout of ``weightsync.engine.transforms.fp8.quantize_blocks``; a ``Batch`` does the same for a list
quantized every round (a plan's group), with everything but the launch made once. Tensors are
launched in classes (inner dimension contiguous or not; every row start 16-element aligned or not:
the kernel is specialised for each, so the common case loads and stores whole vectors). A launch
reads a small int64 table on the GPU, one row per tensor (rows, columns, strides, the offsets of its
source and outputs from three base pointers, and its first block); the outputs are views of two flat
buffers allocated per run; the grid is the blocks of all tensors together, and each program finds
its tensor by comparing its block number with the table's first-block column, then quantizes one
B x B block (edge blocks masked: absent elements count as zero for the max). One launch replaces two
or three kernel launches and a Python wrapper per tensor: the host cost of FP8 rounds was those
launches (docs/TRANSFORMS.md). Addresses are offsets from the first tensor of each kind, so the
compiler knows their alignment (a pointer loaded from memory would defeat vector loads).

Written in place: a ``Batch`` made with ``dests`` (per tensor, the addresses of its FP8 weight and of its
scales, e.g. a receiver's tensors mapped over CUDA IPC) stores there instead of into fresh buffers: the
same kernel, with the output offsets taken from the lowest destination of each kind (``DeviceAddress``
stands for it as a kernel argument), and the aligned class only for 16-byte aligned destinations.

Fingerprints in the same launch (``fingerprint=True``): the bytes written in place are never on the
sender, so a round that verifies (``fp64``, ``weightsync.engine.datapath.checksums``) gets their
fingerprints from the kernel itself: ``fp64`` is ``sum(w(i) * word(i)) mod 2**64`` over a row's signed
int32 words, ``w(i) = i mod 65521 + 1``, linear in each byte (``byte << 8 * (p % 4)`` times ``w(p // 4)``,
the top byte of a word signed), so each program adds up its block's share of the weight row (below 2**61
in magnitude: exact in int64) and of the scales row (its one float32 word), and ``run`` folds the shares
of each tensor as low and high 32-bit halves (``index_add``: exact at any size) into ``Batch.prints``
(copied to pinned host memory on the launch's stream), read once the launch is done (``fingerprints``).
Weights are worked out per row and per column and combined in int32 (no 64-bit division per element):
the arithmetic is what a fingerprinted launch adds (``bench/diagnostics/fp8_quantize.py``).
The program reads its stored FP8 bytes back (after a barrier) rather than bitcasting its registers: on an
H200 with Triton 3.6, a kernel that both stored ``q`` and bitcast it to bytes stored wrong bytes in about
a quarter of the 16-aligned blocks' elements (and fingerprinted other ones); read back, both are right
(``test_the_fp8_kernel_stores_and_fingerprints_what_it_quantizes_on_the_gpu`` in tests/e2e/test_gpu.py).

The module imports Triton at import time: import it only where CUDA is.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

MAX_TENSORS = 64  # per launch (a longer list is split)
ALIGN = 16  # elements: what "aligned" promises the compiler about row starts

_IN_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["n"])
def _quantize_blocks_kernel(table, n, src, out, scales, prints, BLOCK: tl.constexpr, MAXN: tl.constexpr,
                            INNER_CONTIGUOUS: tl.constexpr, ALIGNED: tl.constexpr, FINGERPRINT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, MAXN)
    firsts = tl.load(table + idx * 8 + 7, mask=idx < n, other=1 << 62)
    entry = table + (tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1) * 8
    rows = tl.load(entry + 0)
    cols = tl.load(entry + 1)
    row_stride = tl.load(entry + 2)
    col_stride = tl.load(entry + 3)
    src_at = tl.load(entry + 4)
    out_at = tl.load(entry + 5)
    scale_at = tl.load(entry + 6)
    blk = pid - tl.load(entry + 7)
    if ALIGNED:
        cols = tl.multiple_of(cols, 16)
        row_stride = tl.multiple_of(row_stride, 16)
        src_at = tl.multiple_of(src_at, 16)
        out_at = tl.multiple_of(out_at, 16)
    block_cols = (cols + BLOCK - 1) // BLOCK
    r = (blk // block_cols) * BLOCK + tl.arange(0, BLOCK)
    c = (blk % block_cols) * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    if INNER_CONTIGUOUS:
        at = r[:, None] * row_stride + c[None, :]
    else:
        at = r[:, None] * row_stride + c[None, :] * col_stride
    x = tl.load(src + src_at + at, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-12)  # fp8.MIN_AMAX
    scale_inv = amax / 448.0  # fp8.FP8_MAX
    q = (x * (1.0 / scale_inv)).to(tl.float8e4nv)
    tl.store(out + out_at + r[:, None] * cols + c[None, :], q, mask=mask)
    tl.store(scales + scale_at + blk, scale_inv)
    if FINGERPRINT:  # this block's share of the fp64 of the weight row and of the scales row (header)
        # A byte at p = r * cols + c is in word p >> 2 at slot p & 3. Per row (BLOCK values, int64 once):
        # its first byte's word mod 65521 and slot; per column: c >> 2 mod 65521 and c & 3. Per element,
        # int32 only: the slot, the carry into the next word, and the weight (one conditional subtract:
        # both parts are below 65521). No 64-bit division or modulo per element (they made the launch
        # 2.8x slower than the quantization alone). (Reading the block back as int32 words instead of
        # bytes was slower still on an H200: 14.9 against 10.9 ms for a 7B model's weights.)
        row_at = r * cols  # (BLOCK values, int64)
        row_word = ((row_at >> 2) % 65521).to(tl.int32)
        row_slot = (row_at & 3).to(tl.int32)
        col_word = ((c >> 2) % 65521).to(tl.int32)
        u = row_slot[:, None] + (c & 3).to(tl.int32)[None, :]  # 0..6: the slot, plus 4 where it carries into the next word
        slot = u & 3
        w = row_word[:, None] + col_word[None, :] + (u >> 2)
        w = tl.where(w >= 65521, w - 65521, w) + 1
        tl.debug_barrier()  # (the block's stores are visible to all its threads past this)
        b = tl.load((out + out_at + r[:, None] * cols + c[None, :]).to(tl.pointer_type(tl.uint8)), mask=mask,
                    other=0, volatile=True).to(tl.int32)  # the bytes stored, read back: see the module's header
        b = tl.where((slot == 3) & (b >= 128), b - 256, b)  # (a word's top byte is signed)
        share = tl.where(mask, (b << (slot * 8)).to(tl.int64) * w.to(tl.int64), 0)
        tl.store(prints + pid * 2, tl.sum(tl.sum(share, axis=1), axis=0))
        tl.store(prints + pid * 2 + 1, scale_inv.to(tl.int32, bitcast=True).to(tl.int64) * (blk % 65521 + 1))


def fingerprints(prints: torch.Tensor) -> list[tuple[int, int]]:
    """``Batch.prints`` (host memory, read once its launch is done: an event recorded after ``run``) ->
    per tensor, the ``fp64`` of its FP8 weight row and of its scales row."""
    mask = (1 << 64) - 1
    return [tuple(((high << 32) + low) & mask for low, high in kinds) for kinds in prints.cpu().tolist()]


def quantize_many(xs: list[torch.Tensor], block: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Block FP8 of every 2-D tensor in ``xs`` (one dtype, one device), once: a one-off ``Batch``."""
    return Batch(xs, block).run()


class Batch:
    """A fixed list of 2-D sources quantized together, possibly every round (a plan's group).

    Made once: the outputs' layout in two flat buffers (an FP8 one, each tensor's start 16-aligned,
    and a float32 one for the scales) and, per class, the launch table on the device. Each ``run``
    then allocates the two buffers and launches once per class: no per-tensor allocation, no table
    upload. ``matches`` says whether a list of tensors is still the one it was made for."""

    def __init__(self, xs: list[torch.Tensor], block: int, dests: Optional[list[tuple[int, int]]] = None,
                 fingerprint: bool = False) -> None:
        if not xs:
            raise ValueError("a quantization batch needs at least one tensor")
        if dests is not None and (len(dests) != len(xs) or any(s_at % 4 for _, s_at in dests)):
            raise ValueError("a quantization batch needs one (weight, 4-aligned scales) address per tensor")
        self.xs, self.block, self.dests, self.fingerprint = list(xs), block, dests, fingerprint
        self.given = xs  # (a caller that passes the same list every round is matched at once: ``matches``)
        self.prints: Optional[torch.Tensor] = None  # int64 [tensors, 2 (weight, scales), 2 (low, high halves)]
        self.device, self.dtype = xs[0].device, xs[0].dtype
        if self.dtype not in _IN_TYPES:
            raise ValueError(f"block FP8 quantizes bfloat16, float16 or float32 tensors, got {self.dtype}")
        self.layout: list[tuple[int, int, int, int, tuple[int, int]]] = []  # q at, rows, cols, scales at, grid
        q_at = s_at = 0
        self.bases = (min(q for q, _ in dests), min(s for _, s in dests)) if dests else (0, 0)
        classes: dict[tuple[bool, bool], list[int]] = {}
        for i, x in enumerate(self.xs):
            if x.dim() != 2 or x.device != self.device or x.dtype != self.dtype:
                raise ValueError(f"a quantization batch takes 2-D {self.dtype} tensors on {self.device}, got "
                                 f"{x.dtype} {list(x.shape)} on {x.device}")
            rows, cols = x.shape
            grid = (-(-rows // block), -(-cols // block))
            if dests:  # offsets from the lowest destination (elements: FP8 is one byte, scales four)
                q_at, s_at = dests[i][0] - self.bases[0], (dests[i][1] - self.bases[1]) // 4
            self.layout.append((q_at, rows, cols, s_at, grid))
            if x.numel():
                inner, aligned = _class_of(x)
                classes.setdefault((inner, aligned and q_at % ALIGN == 0), []).append(i)
            if not dests:
                q_at += -(-rows * cols // ALIGN) * ALIGN
                s_at += grid[0] * grid[1]
        self.q_total, self.s_total = (0, 0) if dests else (q_at, s_at)
        self.launches = []
        for (inner, aligned), members in classes.items():
            for start in range(0, len(members), MAX_TENSORS):
                self.launches.append(self._launch_for(members[start:start + MAX_TENSORS], inner, aligned))
        self.tables_ready = None  # the tables were copied on the stream current now: later streams wait for it
        if self.device.type == "cuda":
            self.tables_ready = torch.cuda.Event()
            self.tables_ready.record(torch.cuda.current_stream(self.device))

    def __repr__(self) -> str:
        return f"<Batch {len(self.xs)} tensors, {len(self.launches)} launches, {self.q_total} fp8 bytes>"

    def matches(self, xs: list[torch.Tensor]) -> bool:
        if xs is self.given:  # (``InPlace.write_all`` passes its prepared list, a plan's fixed views)
            return True
        return len(xs) == len(self.xs) and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            for a, b in zip(xs, self.xs))

    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fp8, scale_inv) per tensor, queued on the current stream; nothing when written in place."""
        if self.tables_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.tables_ready)
        if self.dests:
            qbuf = DeviceAddress(self.bases[0], torch.float8_e4m3fn, self.device)
            sbuf = DeviceAddress(self.bases[1], torch.float32, self.device)
        else:
            qbuf = torch.empty(self.q_total, dtype=torch.float8_e4m3fn, device=self.device)
            sbuf = torch.empty(self.s_total, dtype=torch.float32, device=self.device)
        if self.fingerprint:
            self.prints = torch.zeros((len(self.xs), 2, 2), dtype=torch.int64, device=self.device)
        for table, count, first, blocks, inner, aligned, owners in self.launches:
            shares = torch.empty((blocks, 2), dtype=torch.int64, device=self.device) if self.fingerprint else table
            _quantize_blocks_kernel[(blocks,)](table, count, first, qbuf, sbuf, shares, BLOCK=self.block,
                                               MAXN=MAX_TENSORS, INNER_CONTIGUOUS=inner, ALIGNED=aligned,
                                               FINGERPRINT=self.fingerprint, num_warps=8 if self.block >= 128 else 4)
            if self.fingerprint:
                self.prints[:, :, 0].index_add_(0, owners, shares & 0xFFFFFFFF)
                self.prints[:, :, 1].index_add_(0, owners, shares >> 32)
        if self.fingerprint and self.device.type == "cuda":  # to pinned memory behind the launch, on its stream:
            host = torch.empty(self.prints.shape, dtype=torch.int64, pin_memory=True)  # read once it is done
            self.prints = host.copy_(self.prints, non_blocking=True)
        if self.dests:
            return []
        return [(qbuf[q_at:q_at + rows * cols].view(rows, cols), sbuf[s_at:s_at + grid[0] * grid[1]].view(grid))
                for q_at, rows, cols, s_at, grid in self.layout]

    def _launch_for(self, members: list[int], inner: bool, aligned: bool) -> tuple:
        first = self.xs[members[0]]
        size = first.element_size()
        entries, blocks = [], 0
        for i in members:
            x = self.xs[i]
            q_at, rows, cols, s_at, grid = self.layout[i]
            entries.append((rows, cols, x.stride(0), x.stride(1), (x.data_ptr() - first.data_ptr()) // size,
                            q_at, s_at, blocks))
            blocks += grid[0] * grid[1]
        owners = None  # (each block's tensor, for folding the fingerprints' shares)
        if self.fingerprint:
            counts = torch.tensor([self.layout[i][4][0] * self.layout[i][4][1] for i in members])
            owners = torch.repeat_interleave(torch.tensor(members), counts).to(self.device)
        return _table(entries, self.device), len(members), first, blocks, inner, aligned, owners


class DeviceAddress:
    """A raw device address as a Triton pointer argument (Triton reads ``data_ptr()`` and ``dtype``)."""

    def __init__(self, address: int, dtype: torch.dtype, device: torch.device) -> None:
        self.address, self.dtype, self.device = address, dtype, device

    def data_ptr(self) -> int:
        return self.address


def _class_of(x: torch.Tensor) -> tuple[bool, bool]:
    """(inner dim contiguous, every row start ALIGN-element aligned in the source; outputs always are)."""
    inner = x.stride(1) == 1 or x.shape[1] == 1
    aligned = (inner and x.shape[1] % ALIGN == 0 and x.stride(0) % ALIGN == 0
               and x.data_ptr() % (ALIGN * x.element_size()) == 0)
    return inner, aligned


def _table(entries: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """The launch's table on ``device`` (8 int64 columns: rows, cols, row stride, col stride, source,
    fp8 and scale offsets, first block), copied from pinned memory on the current stream (the
    caching host allocator keeps the pinned buffer until that copy has run)."""
    host = torch.tensor(entries, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def warm(device: torch.device, dtype: torch.dtype, block: int) -> None:
    """Compile every class of the kernel for ``dtype`` (blocking: run it in a worker thread)."""
    aligned = torch.zeros((2 * ALIGN, 2 * ALIGN), dtype=dtype, device=device)
    odd = torch.zeros((2 * ALIGN, 2 * ALIGN + 1), dtype=dtype, device=device)
    quantize_many([aligned, odd, odd.t()], block)  # one tensor of each class
    quantize_many([aligned], block)  # a launch of one tensor (Triton specializes an argument equal to 1)
    Batch([aligned, odd, odd.t()], block, fingerprint=True).run()  # (the fingerprinting variants)
    Batch([aligned], block, fingerprint=True).run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
