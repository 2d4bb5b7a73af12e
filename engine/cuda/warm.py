"""Compile, before any round, the Triton kernels a round may launch on a member's GPUs.

Triton compiles a kernel on its first launch in a process: a tenth of a second or more each (less
once its disk cache holds it). Inside a round that is a spike no transfer explains: the first full
check of a dense run took 0.2 s for 8 ms of copies on 2 x H200 until the fingerprint kernel was
compiled at start. ``warm(widths)`` launches each kernel once on a few bytes of every device named
(``widths``: device -> the value widths of its tensors): the copy kernel launched the direct way (its
check, ``launches.direct_works``), the ``fp64`` kernels (full checks: words and bytes, dense and
pitched), and
with ``deltas`` the delta encoder (senders) or the check and apply (receivers) for widths of 1, 2 and
4 bytes. Blocking: call it off the event loop. Errors are left to the round (it falls back itself).
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

log = logging.getLogger("weightsync")


def warm(widths: Mapping[torch.device, set[int]], deltas: str = "") -> None:
    """Launch each kernel once per device (``deltas``: "encode", "apply" or "" for none)."""
    from ..datapath.checksums import fp64_many
    from ..datapath.delta_rows import WIDTHS

    from .launches import direct_works

    for device, sizes in widths.items():
        try:
            if device.type == "cuda":
                direct_works(device.index if device.index is not None else torch.cuda.current_device())
            fp64_many(_fp64_classes(device))
            if deltas:
                _deltas(device, sorted(w for w in sizes if w in WIDTHS), deltas)
        except Exception as exc:  # (no Triton here: the rounds take their fallbacks)
            log.info("weightsync: kernels not compiled ahead on %s: %r", device, exc)


def _fp64_classes(device: torch.device) -> list[torch.Tensor]:
    """A view of each class the ``fp64`` kernels specialise on: whole words dense and pitched, bytes
    dense and pitched (a receiver's landing pieces and a sender's sources may be any of them, so any may
    be a round's first launch of its class)."""
    words = torch.zeros(64, 64, dtype=torch.int32, device=device)
    raw = words.view(torch.uint8)
    return [words, words[:, :32], raw.reshape(-1)[1:258], raw[:, 1:8]]


def _deltas(device: torch.device, widths: list[int], side: str) -> None:
    from ..transforms import delta as codec
    from . import delta_apply, delta_kernel

    dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    for width in widths:
        new = torch.arange(4096, dtype=torch.int32, device=device).to(dtypes[width])
        base = new.clone()
        base[::97] += 1
        if side == "encode":
            delta_kernel.encode_many([(base, new)])
        else:
            packed = codec.pack_tensor(codec.encode(new, base))
            applier = delta_apply.Applier([(packed, new, delta_apply.headers(packed, [0])[0])])
            if applier.check() == [None]:
                applier.apply()
