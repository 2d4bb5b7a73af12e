"""Per-transfer checksums and fingerprints, computed where the bytes are.

``crc32``: zlib's CRC-32 of the bytes (CPU; a CUDA tensor is copied to the host first — fine for
tests, slow for big GPU models). ``sum64``: a position-weighted sum of the bytes in int64, computed by
torch on the tensor's own device (exact integer arithmetic, so CPU and GPU agree bit for bit); it
catches flipped, lost and reordered bytes. ``fp64``: the same idea over 4-byte words, the fingerprint
of delta rounds: ``sum(w(i) * word(i)) mod 2**64`` where ``word(i)`` is the little-endian signed int32
of bytes ``4i .. 4i+3`` of the row (the last one zero-padded) and ``w(i) = i mod 65521 + 1``. Being a
weighted sum it can be *updated* from a row's changes (``fp64_change``: the words a delta touched,
before and after) instead of read again whole, and 65521 words at a time it cannot overflow int64.
All are deterministic; none is cryptographic.
"""

from __future__ import annotations

import zlib

import torch

from ..errors import ConfigError

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

        return zlib.crc32(byte_view(data.cpu()))
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


def touched_words(positions: torch.Tensor, width: int, nbytes: int) -> torch.Tensor:
    """The (sorted, unique) word indices holding the values at ``positions`` of a row of ``width``-byte
    values and ``nbytes`` bytes."""
    first = positions * width // 4
    if width <= 4:
        return torch.unique_consecutive(first)
    return torch.unique(torch.cat([first + k for k in range(width // 4)]))


def word_values(data: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Words ``words`` of a row's bytes (1-D uint8), as int64 of their signed int32 values."""
    n = data.numel()
    out = torch.zeros(words.numel(), dtype=torch.int64, device=data.device)
    for k in range(4):
        index = words * 4 + k
        inside = index < n
        part = torch.zeros_like(out)
        part[inside] = data[index[inside]].to(torch.int64)
        out |= part << (8 * k)
    return torch.where(out >= 1 << 31, out - (1 << 32), out)


def fp64_change(words: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> int:
    """How much a row's ``fp64`` moves when its words ``words`` go from ``before`` to ``after``
    (``word_values`` of each), mod 2**64."""
    weights = words % _MOD + 1
    return int(((after - before) * weights).sum()) & _MASK
