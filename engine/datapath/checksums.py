"""Per-transfer checksums and fingerprints, computed where the bytes are.

``crc32``: the CRC-32 of the bytes, zlib's polynomial and values (CPU; a CUDA tensor is copied to the
host first — fine for tests, slow for big GPU models), computed by ISA-L (``isal``, a dependency) where
it imports, else by zlib: the same values, ISA-L 5.9x faster on this CPU (24.7 GB/s against 4.2; both
let go of the GIL), which is most of what a CPU member's full check costs. ``sum64``: a
position-weighted sum of the bytes in int64, computed by torch on the tensor's own device (exact
integer arithmetic, so CPU and GPU agree bit for bit); it catches flipped, lost and reordered bytes. ``fp64``: the same idea over 4-byte words, the fingerprint
of delta rounds: ``sum(w(i) * word(i)) mod 2**64`` where ``word(i)`` is the little-endian signed int32
of bytes ``4i .. 4i+3`` of the row (the last one zero-padded) and ``w(i) = i mod 65521 + 1``. Being a
weighted sum it can be *updated* from a row's changes (``fp64_change``: the words a delta touched,
before and after) instead of read again whole, and 65521 words at a time it cannot overflow int64.
All are deterministic; none is cryptographic. ``fp64_many`` takes many rows at once (``ManyPrints``,
kept by callers whose rows come back): on a GPU one
launch for all of them (``weightsync.engine.cuda.fp64_kernel``, dense and pitched rows read where they
lie), elsewhere row by row.
"""

from __future__ import annotations

import functools
import logging
import zlib
from typing import Mapping, Optional, Sequence

try:
    from isal.isal_zlib import crc32 as _crc32  # (zlib's CRC-32, with the CPU's carry-less multiply)
except ImportError:  # (an install without ISA-L: the same values, slower)
    _crc32 = zlib.crc32

import torch

from ..errors import ConfigError

log = logging.getLogger("weightsync")

ALGORITHMS = ("", "crc32", "sum64", "fp64")
_CHUNK = 1 << 24
_MASK = (1 << 64) - 1
_MOD = 65521  # weights repeat every _MOD words: a block of them sums to at most 2**31 * 2.15e9 < 2**63
_BLOCKS = 256  # blocks of _MOD words reduced at once (a 64 MiB int64 temporary)


def validate(algo: str) -> str:
    if algo not in ALGORITHMS:
        raise ConfigError("checksum", f"unknown checksum {algo!r}; use one of {ALGORITHMS}")
    return algo


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.uint8 else flat.to(torch.uint8)


def checksum(t: torch.Tensor, algo: str) -> int:
    """The checksum of a contiguous tensor's bytes."""
    data = _bytes(t.contiguous())
    if algo == "crc32":
        from .tensors import byte_view

        return _crc32(byte_view(data.cpu()))
    if algo == "sum64":
        total = 0
        for start in range(0, data.numel(), _CHUNK):
            chunk = data[start:start + _CHUNK].to(torch.int64)
            weights = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
            total = (total + int((chunk * weights).sum())) & _MASK
        return total
    if algo == "fp64":
        return fp64(data)
    raise ConfigError("checksum", f"unknown checksum {algo!r}; use one of {ALGORITHMS}")


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(1, _MOD + 1, dtype=torch.int64, device=device)
    return w


def _words(data: torch.Tensor) -> torch.Tensor:
    """A row's bytes (1-D uint8) as int32 words, the last zero-padded (a view where it may be one)."""
    n = data.numel()
    if n % 4 == 0 and data.storage_offset() % 4 == 0 and data.data_ptr() % 4 == 0:
        return data.view(torch.int32)
    padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=data.device)
    padded[:n] = data
    return padded.view(torch.int32)


def _fold(partials: torch.Tensor) -> int:
    """The sum mod 2**64 of int64 values each below 2**63 in magnitude, with no overflow on the way."""
    low = int((partials & 0xFFFFFFFF).sum())
    high = int((partials >> 32).sum())
    return ((high << 32) + low) & _MASK


def fp64(data: torch.Tensor) -> int:
    """The ``fp64`` fingerprint of a row's bytes (1-D uint8, on any device)."""
    words = _words(data.reshape(-1))
    weights = _weights(words.device)
    total, n = 0, words.numel()
    whole = n // _MOD * _MOD
    step = _MOD * _BLOCKS
    for start in range(0, whole, step):
        block = words[start:min(start + step, whole)].view(-1, _MOD).to(torch.int64)
        total += _fold((block * weights).sum(dim=1))
    if whole < n:
        tail = words[whole:].to(torch.int64)
        total += int((tail * weights[:tail.numel()]).sum())
    return total & _MASK


def fp64_change(positions: torch.Tensor, before: torch.Tensor, after: torch.Tensor, width: int) -> int:
    """How much a row's ``fp64`` moves when its ``width``-byte values at ``positions`` go from bit patterns
    ``before`` to ``after`` (as ``engine.transforms.delta.apply`` gives them: int64 of the values' signed
    integers, unsigned for 1-byte values), mod 2**64: O(changes), never a pass over the row. A word's
    signed int32 is its lower bytes unsigned plus its top byte (or half) signed, so each value adds its
    own share to its word: ``fp64`` is linear in the words."""
    if width == 8:  # two words: the low one's and the high one's signed int32
        low = fp64_change(positions * 2, _s32(before & 0xFFFFFFFF), _s32(after & 0xFFFFFFFF), 4)
        high = fp64_change(positions * 2 + 1, before >> 32, after >> 32, 4)
        return (low + high) & _MASK
    per = 4 // width
    slot = positions % per
    word = positions // per
    shift = 8 * width * slot
    top = slot == per - 1
    if width == 1:  # bytes come unsigned: the top one of a word counts signed
        before = torch.where(top & (before >= 128), before - 256, before)
        after = torch.where(top & (after >= 128), after - 256, after)
    elif width == 2:  # halves come signed: the low one of a word counts unsigned
        before = torch.where(~top & (before < 0), before + 65536, before)
        after = torch.where(~top & (after < 0), after + 65536, after)
    products = ((after - before) << shift) * (word % _MOD + 1)
    return _fold(products)


def _s32(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 1 << 31, v - (1 << 32), v)


_KERNEL_FAILED: list[str] = []  # why the GPU kernel could not run here (then rows go one by one)


def fp64_many(views: Sequence[torch.Tensor], streams: Mapping[torch.device, "torch.cuda.Stream"] = {}) -> list[int]:
    """The ``fp64`` of each view's bytes in order: dense views, and views whose dim-0 rows are each dense
    at a larger stride (pitched) read as they lie; any other layout is made contiguous first. CUDA views
    of one device go in one launch (on ``streams[device]``, else the device's current stream; this waits
    for it: call it off the event loop, or use ``fp64_many_async``); the rest row by row."""
    return ManyPrints(views).values(streams)


async def fp64_many_async(views: Sequence[torch.Tensor],
                          streams: Mapping[torch.device, "torch.cuda.Stream"] = {}) -> list[int]:
    """``fp64_many`` without blocking the event loop (``ManyPrints.values_async``)."""
    return await ManyPrints(views).values_async(streams)


class ManyPrints:
    """The ``fp64`` of a fixed list of views, worked out once: which go to the kernel (per device, their
    byte ranges) and which row by row. A caller that fingerprints the same views again (a compiled
    lane's rows, a receiver's landing pieces) keeps it: each ``values`` is then one launch per device,
    with no work per row on the host (a 4,720-row lane spent 26 ms making views' streams and ranges)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = list(views)
        self.rest: list[int] = []
        by_device: dict[torch.device, dict[int, tuple]] = {}
        for i, v in enumerate(self.views):
            where = _range(v) if v.device.type == "cuda" else None
            if where is not None:
                by_device.setdefault(v.device, {})[i] = where
            else:
                self.rest.append(i)
        self.kernel = {d: (tuple(m), tuple(m.values())) for d, m in by_device.items()}  # -> (indices, ranges)
        self._prepared: dict = {}  # device -> its launch (``_fingerprints``), once asked for

    def __repr__(self) -> str:
        return f"<ManyPrints {len(self.views)} views, {len(self.kernel)} devices by kernel, {len(self.rest)} row by row>"

    def values(self, streams: Mapping[torch.device, "torch.cuda.Stream"] = {}) -> list[int]:
        out, launched, rest = self._launch(streams)
        _place(out, rest, [fp64(_bytes(self.views[i].contiguous())) for i in rest])
        for members, (fingerprints, host, event) in launched.items():
            if event is not None:
                event.synchronize()
            _place(out, members, fingerprints.values(host))
        return out  # type: ignore[return-value]

    async def values_async(self, streams: Mapping[torch.device, "torch.cuda.Stream"] = {}) -> list[int]:
        """``values`` without blocking the loop: the CUDA launches from the loop's thread, their sums
        copied to pinned host memory behind an event the loop polls; the other views on a worker thread.
        (A worker thread would need the GIL back from a loop that polls, once per step.)"""
        import asyncio

        out, launched, rest = self._launch(streams)
        if rest:
            _place(out, rest, await asyncio.to_thread(lambda: [fp64(_bytes(self.views[i].contiguous())) for i in rest]))
        for members, (fingerprints, host, event) in launched.items():
            if event is not None:
                from ..cuda import cuda_rt

                await cuda_rt.wait_event(event)
            _place(out, members, fingerprints.values(host))
        return out  # type: ignore[return-value]

    def _launch(self, streams: Mapping) -> tuple[list, dict, list[int]]:
        """Launch the kernel per device: (a list for the fingerprints; per device, its views' indices ->
        (the prepared launch, the host tensor its sums land in, their event); the indices left to the
        caller, row by row: the kernel's rest, and every view where the kernel cannot run)."""
        out: list[Optional[int]] = [None] * len(self.views)
        rest = list(self.rest)
        launched = {}
        for device, (members, ranges) in self.kernel.items():
            if _KERNEL_FAILED:
                rest += members
                continue
            try:
                fingerprints = self._prepared.get(device)
                if fingerprints is None:
                    fingerprints = self._prepared[device] = _fingerprints(ranges, device)
                launched[members] = (fingerprints, *fingerprints.launch(streams.get(device)))
            except Exception as exc:  # no Triton or a Triton problem here: row by row is correct
                _KERNEL_FAILED.append(repr(exc)[:200])
                log.warning("fp64: the GPU kernel cannot run here (%s); fingerprints go row by row", _KERNEL_FAILED[0])
                rest += members
        return out, launched, rest


def _place(out: list, members: Sequence[int], values: list[int]) -> None:
    for i, value in zip(members, values):
        out[i] = value


def _range(v: torch.Tensor) -> Optional[tuple[int, int, int, int]]:
    """(address, bytes, bytes per row, pitch) of a dense or pitched view; None for other layouts."""
    nbytes = v.numel() * v.element_size()
    if v.is_contiguous():
        return v.data_ptr(), nbytes, nbytes, nbytes
    if v.dim() >= 2 and v.shape[0] >= 2 and v[0].is_contiguous():
        row = v[0].numel() * v.element_size()
        pitch = v.stride(0) * v.element_size()
        if pitch > row:
            return v.data_ptr(), nbytes, row, pitch
    return None


@functools.lru_cache(maxsize=16)
def _fingerprints(ranges: tuple, device: torch.device):
    """The prepared launch for ``ranges``, kept: a plan's rows come back every full check (a sender's
    lanes, a two-slot receiver's two slots), and their tables then cost nothing to make again. A launch
    holds addresses and lengths only, so the same ranges always make the same launch."""
    from ..cuda.fp64_kernel import Fingerprints

    return Fingerprints(ranges, device)
