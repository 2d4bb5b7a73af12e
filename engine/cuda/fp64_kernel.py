"""The ``fp64`` fingerprints of many byte ranges on one GPU in one launch (Triton), read back in one copy.

How this works. ``fp64`` (``weightsync.engine.datapath.checksums``) is ``sum(w(i) * word(i)) mod 2**64``
over a row's little-endian signed int32 words, ``w(i) = i mod 65521 + 1``. A word is linear in its
bytes (the three low ones unsigned, the top one signed), so each byte at position ``p`` adds
``byte << 8 * (p % 4)`` times ``w(p // 4)`` on its own, and a program can sum any run of bytes without
looking at its neighbours. ``Fingerprints(ranges, device)`` takes the ranges once: each is
``(address, nbytes, row_bytes, pitch)``, ``nbytes`` bytes read as rows of ``row_bytes`` bytes,
``pitch`` bytes apart (a dense range: one row); it cuts them into chunks of ``CHUNK`` bytes, one
program each, and puts every range's offset (from the lowest address), length, row, pitch and first
program in a small int64 table on the GPU, and each program's range in another. ``launch`` runs
one program per chunk, each writing the int64 sum of its chunk (below 2**60 in magnitude, so exact),
then ``_fold_kernel``, one program per range adding up that range's partial sums (int64, wrapping:
the sum mod 2**64, which is the fingerprint), and copies the sums to the host once. Everything a
launch needs is made with the ranges: its tables, the partial sums' and the sums' buffers, and each
kernel's ``launches.Launch`` (the compiled kernel's own launcher, its arguments bound once), so a
launch is two kernel launches per class of ranges, one copy and an event record, whatever the number
of ranges (26 us of host time on an H100 against 101 through Triton's launcher and torch's folding:
docs/DELTAS.md). The buffers are the object's: a launch on
another stream than the last one waits for the last one's event first.

Ranges whose address, length, row and pitch are multiples of 4 (nearly every row: tensors start
aligned, and rows of 2- and 4-byte values have even lengths) take ``_fp64_words_kernel`` instead: it
loads whole int32 words, ``WORDS`` a program, each times its weight, a quarter of the byte kernel's
loads and arithmetic. Its table holds each range's own address (no common base), so it needs no
tensor argument per range. Any other range takes the byte kernel.

The module imports Triton at import time: import it only where CUDA is.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np
import torch

import triton
import triton.language as tl

from ..transforms.fp8_kernel import DeviceAddress
from . import cuda_rt
from .launches import Launch

CHUNK = 8192  # bytes per program
_MASK = (1 << 64) - 1


@triton.jit(do_not_specialize=["src"])  # (the lowest address of a launch's byte rows: any alignment, one compile)
def _fp64_kernel(table, owner, src, partials, CHUNK: tl.constexpr, PITCHED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    entry = table + tl.load(owner + pid).to(tl.int64) * 5
    src_at = tl.load(entry + 0)
    nbytes = tl.load(entry + 1)
    start = (pid - tl.load(entry + 4)) * CHUNK  # this program's first byte in its range (a multiple of 4)
    local = tl.arange(0, CHUNK)  # (int32 from here: no 64-bit division or modulo per byte)
    p = start + local
    mask = p < nbytes
    if PITCHED:
        row = tl.load(entry + 2)
        pitch = tl.load(entry + 3)
        at = (p // row) * pitch + p % row
    else:
        at = p
    b = tl.load(src + src_at + at, mask=mask, other=0).to(tl.int32)
    slot = local & 3
    b = tl.where((slot == 3) & (b >= 128), b - 256, b)  # a word's top byte counts signed
    w = ((start // 4) % 65521).to(tl.int32) + (local >> 2)  # the word's index mod 65521 (CHUNK / 4 < 65521:
    w = tl.where(w >= 65521, w - 65521, w) + 1  # it wraps at most once in a program), plus one
    tl.store(partials + pid, tl.sum((b << (slot * 8)).to(tl.int64) * w.to(tl.int64), axis=0))


WORDS = 4096  # int32 words per program of the word kernel (< 65521: a program's weights wrap at most once)


@triton.jit
def _fp64_words_kernel(table, owner, partials, WORDS: tl.constexpr, PITCHED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    entry = table + tl.load(owner + pid).to(tl.int64) * 5
    src = tl.load(entry + 0).to(tl.pointer_type(tl.int32))
    start = (pid - tl.load(entry + 4)) * WORDS  # this program's first word in its range
    local = tl.arange(0, WORDS)
    p = start + local
    mask = p < tl.load(entry + 1)
    if PITCHED:
        row = tl.load(entry + 2)
        at = (p // row) * tl.load(entry + 3) + p % row
    else:
        at = p
    word = tl.load(src + at, mask=mask, other=0).to(tl.int64)
    w = (start % 65521).to(tl.int32) + local
    w = tl.where(w >= 65521, w - 65521, w) + 1
    tl.store(partials + pid, tl.sum(word * w.to(tl.int64), axis=0))


FOLD = 1024  # partial sums a fold program adds per step


@triton.jit
def _fold_kernel(partials, spans, sums, FOLD: tl.constexpr):
    """One program per range: its partial sums (``spans``: first program, programs, the range's index in
    ``sums``) added up in int64, wrapping: the range's fingerprint mod 2**64."""
    entry = spans + tl.program_id(0).to(tl.int64) * 3
    first = tl.load(entry + 0)
    n = tl.load(entry + 1)
    acc = tl.zeros([FOLD], dtype=tl.int64)
    for start in range(0, n, FOLD):
        at = start + tl.arange(0, FOLD)
        acc += tl.load(partials + first + at, mask=at < n, other=0)
    tl.store(sums + tl.load(entry + 2), tl.sum(acc, axis=0))


class Fingerprints:
    """The ``fp64`` of fixed byte ranges on ``device`` (see the module's header); ``run`` -> one int each."""

    def __init__(self, ranges: Sequence[tuple[int, int, int, int]], device: torch.device) -> None:
        self.device = torch.device(device)
        self.count = len(ranges)
        self.sums = torch.zeros(max(1, self.count), dtype=torch.int64, device=self.device)  # (empty ranges: 0)
        self.launches = []
        for words in (True, False):
            for pitched in (False, True):
                members = [i for i, (address, nbytes, row, pitch) in enumerate(ranges)
                           if nbytes and (row != pitch) == pitched and _in_words(address, nbytes, row, pitch) == words]
                if members:
                    self.launches.append(self._launch_for([ranges[i] for i in members], members, pitched, words))
        self._free: list[torch.Tensor] = []  # pinned host buffers whose sums were read (``values``)
        self._last: Optional[tuple[int, torch.cuda.Event]] = None  # (stream, event) of the last launch
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Fingerprints {self.count} ranges, {len(self.launches)} classes on {self.device}>"

    def _launch_for(self, ranges: list[tuple[int, int, int, int]], members: list[int], pitched: bool,
                    words: bool) -> tuple:
        """One class's kernels: for the word kernel each range's own address and its lengths in words;
        for the byte kernel offsets from the lowest address (its ``DeviceAddress``) and lengths in bytes.
        -> ((kernel, grid, args, meta) of the partial sums, the same of their fold), as ``Launch`` takes them."""
        base = 0 if words else min(address for address, *_ in ranges)
        unit, per_program = (4, WORDS) if words else (1, CHUNK)
        rows, spans, programs = [], [], 0
        for (address, nbytes, row, pitch), member in zip(ranges, members):
            chunks = -(-nbytes // (unit * per_program))
            rows.append((address - base, nbytes // unit, row // unit, pitch // unit, programs))
            spans.append((programs, chunks, member))
            programs += chunks
        table = torch.tensor(rows, dtype=torch.int64).to(self.device)
        owner = torch.from_numpy(np.repeat(np.arange(len(ranges), dtype=np.int32),
                                           [chunks for _, chunks, _ in spans])).to(self.device)
        partials = torch.empty(programs, dtype=torch.int64, device=self.device)
        if words:
            main = (_fp64_words_kernel, programs, (table, owner, partials),
                    {"WORDS": WORDS, "PITCHED": pitched, "num_warps": 8})
        else:
            main = (_fp64_kernel, programs, (table, owner, DeviceAddress(base, torch.uint8, self.device), partials),
                    {"CHUNK": CHUNK, "PITCHED": pitched, "num_warps": 8})
        fold = (_fold_kernel, len(ranges), (partials, torch.tensor(spans, dtype=torch.int64).to(self.device),
                                            self.sums), {"FOLD": FOLD, "num_warps": 4})
        if self.device.type != "cuda":  # (Triton's interpreter, in tests: launched as is)
            return main, fold
        return tuple(Launch(fn, grid, args, meta, self.device.index) for fn, grid, args, meta in (main, fold))

    def run(self, stream: Optional[torch.cuda.Stream] = None) -> list[int]:
        """Every range's fingerprint, computed on ``stream`` (default: the device's current one); waits
        for it (blocking: call it from a worker thread where the loop must not wait)."""
        host, event = self.launch(stream)
        if event is not None:
            event.synchronize()
        return self.values(host)

    def launch(self, stream: Optional[torch.cuda.Stream] = None) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """Queue the fingerprints on ``stream``: (where their sums land on the host, the event after
        which they are there; ``values`` reads them then). Does not wait."""
        if self.device.type != "cuda":
            for kernels in self.launches:
                for fn, grid, args, meta in kernels:
                    fn[(grid,)](*args, **meta)
            return self.sums[:self.count].clone(), None
        stream = stream or torch.cuda.current_stream(self.device)
        with self._lock:
            if self._last is not None and self._last[0] != stream.cuda_stream:
                stream.wait_event(self._last[1])  # (the partial sums and sums are this object's)
            for main, fold in self.launches:
                main(stream)
                fold(stream)
            host = self._free.pop() if self._free else torch.empty(self.count, dtype=torch.int64, pin_memory=True)
            if self.count:
                cuda_rt.memcpy_async(host.data_ptr(), self.sums.data_ptr(), 8 * self.count, stream)
            event = torch.cuda.Event()
            event.record(stream)
            self._last = (stream.cuda_stream, event)
        return host, event

    def values(self, host: torch.Tensor) -> list[int]:
        """The fingerprints a ``launch`` copied into ``host`` (once its event has passed)."""
        out = [v & _MASK for v in host.tolist()]
        if host.is_pinned() and len(self._free) < 4:
            self._free.append(host)  # (read: the next launch may copy into it)
        return out


def _in_words(address: int, nbytes: int, row: int, pitch: int) -> bool:
    """Whether a range is whole int32 words where it lies (the word kernel's)."""
    return address % 4 == 0 and nbytes % 4 == 0 and row % 4 == 0 and pitch % 4 == 0
