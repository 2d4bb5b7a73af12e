"""Find the CUDA caching-allocator block (segment) that holds a tensor, to register it whole.

How this works: ``torch.cuda.memory_snapshot()`` lists the allocator's segments (base address, size,
device). ``block_of`` looks a tensor's pointer up in a cached copy and refreshes it on a miss (a new
segment since the last look), so registering sources costs one snapshot per new allocation, not one
per tensor or per round.
"""

from __future__ import annotations

import bisect

import torch

from ..errors import RegistrationError

_segments: list[tuple[int, int, int]] = []  # sorted (base, size, device)


def _refresh() -> None:
    global _segments
    _segments = sorted((s["address"], s["total_size"], s["device"]) for s in torch.cuda.memory_snapshot())


def _find(ptr: int):
    i = bisect.bisect_right(_segments, (ptr, float("inf"), 0)) - 1
    if i >= 0:
        base, size, device = _segments[i]
        if base <= ptr < base + size:
            return base, size
    return None


def block_of(t: torch.Tensor) -> tuple[int, int]:
    """(base address, size) of the caching-allocator segment holding ``t``."""
    ptr = t.data_ptr()
    found = _find(ptr)
    if found is None:
        _refresh()
        found = _find(ptr)
    if found is None:
        raise RegistrationError(f"no caching-allocator segment holds address {ptr:#x} (not allocated by torch?)")
    return found
