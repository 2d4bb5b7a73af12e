"""Per-transfer checksums, computed where the bytes are.

``crc32``: zlib's CRC-32 of the bytes (CPU; a CUDA tensor is copied to the host first — fine for
tests, slow for big GPU models). ``sum64``: a position-weighted sum of the bytes in int64, computed by
torch on the tensor's own device (exact integer arithmetic, so CPU and GPU agree bit for bit); it
catches flipped, lost and reordered bytes. Both are deterministic; neither is cryptographic.
"""

from __future__ import annotations

import zlib

import torch

from ..errors import ConfigError

ALGORITHMS = ("", "crc32", "sum64")
_CHUNK = 1 << 24
_MASK = (1 << 64) - 1


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
    raise ConfigError("checksum", f"unknown checksum {algo!r}; use one of {ALGORITHMS}")
