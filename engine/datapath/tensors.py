"""Torch-facing helpers: byte views, dtype names, tied-weight detection, flat landing buffers, specs.

How this works: the data plane moves bytes, so tensors are seen through ``byte_view`` (a memoryview
of a contiguous CPU tensor's bytes that keeps the tensor alive). Receivers re-home their parameters
into one ``FlatBuffer`` per registered region (each tensor at an aligned offset), so a transport
registers one allocation, not one per tensor. ``named_tensors`` accepts an ``nn.Module`` or a mapping
and finds tied names (one storage under two names). ``spec_for`` builds the wire ``TensorSpec``.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Union

import torch

from weightsync.wire import ShardSpec, TensorSpec

from ..dtypes import dtype_name
from ..errors import ConfigError

ALIGN = 256  # byte alignment of tensors inside flat buffers (covers every dtype and vector loads)

Params = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, zero-copy; the view keeps the tensor alive."""
    if t.device.type != "cpu":
        raise ConfigError("device", f"byte_view needs a CPU tensor, got {t.device}")
    if not t.is_contiguous():
        raise ConfigError("layout", "byte_view needs a contiguous tensor")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


MAX_NAME_BYTES = 1024  # a parameter name's UTF-8 bytes, at most (the longest in common models is under 200)


def named_tensors(params: Params) -> dict[str, torch.Tensor]:
    """Names -> tensors of a module's state (parameters and buffers, tied names kept) or a mapping;
    each checked (``check_tensor``): a bad one is a ``ConfigError`` naming it, here, not at a join."""
    if isinstance(params, torch.nn.Module):
        out = dict(params.named_parameters(remove_duplicate=False))
        for name, buf in params.named_buffers(remove_duplicate=False):
            out.setdefault(name, buf)
    elif isinstance(params, Mapping):
        for name, t in params.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise ConfigError("params", f"entry {name!r:.80} is not a str -> Tensor pair")
        out = dict(params)
    else:
        raise ConfigError("params", f"expected an nn.Module or a mapping of name -> Tensor, got {type(params).__name__}")
    for name, t in out.items():
        check_tensor(name, t)
    return out


def check_tensor(name: str, t: torch.Tensor) -> None:
    """A name that travels (non-empty UTF-8, at most ``MAX_NAME_BYTES``) and a tensor whose bytes
    exist (strided, not on the meta device)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ConfigError(f"params[{name!r:.80}]", f"a parameter name must be valid UTF-8: {exc.reason}") from exc
    if size == 0 or size > MAX_NAME_BYTES:
        raise ConfigError(f"params[{name!r:.80}]", f"a parameter name needs 1..{MAX_NAME_BYTES} bytes, got {size}")
    if t.layout is not torch.strided:
        raise ConfigError(f"params[{name!r}]", f"{t.layout} tensors cannot be transferred: give a dense tensor")
    if t.device.type == "meta":
        raise ConfigError(f"params[{name!r}]", "a meta-device tensor holds no bytes: materialise it first")


def _identity(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def find_ties(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> the first name that views exactly the same memory (same pointer, dtype, shape, strides)."""
    first: dict[tuple, str] = {}
    ties: dict[str, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        key = _identity(t)
        if key in first:
            ties[name] = first[key]
        else:
            first[key] = name
    return ties


def spec_for(name: str, t: torch.Tensor, *, region: Optional[int], offset: int, tied_to: Optional[str] = None,
             shard: Optional[ShardSpec] = None, gatherable: bool = False) -> TensorSpec:
    return TensorSpec(
        name=name,
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        nbytes=t.numel() * t.element_size(),
        strides=tuple(t.stride()),
        contiguous=t.is_contiguous(),
        device=str(t.device),
        region=region,
        offset=offset,
        shard=shard,
        tied_to=tied_to,
        gatherable=gatherable,
    )


def aligned_layout(tensors: Mapping[str, torch.Tensor], ties: Mapping[str, str]) -> tuple[dict[str, int], int]:
    """Byte offsets of each (untied) tensor in a flat buffer, aligned to ALIGN; and the total size."""
    offsets: dict[str, int] = {}
    at = 0
    for name, t in tensors.items():
        if name in ties:
            continue
        offsets[name] = at
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    for name, canonical in ties.items():
        offsets[name] = offsets[canonical]
    return offsets, max(at, ALIGN)


class FlatBuffer:
    """One allocation holding many tensors at fixed offsets (a registered region)."""

    def __init__(self, nbytes: int, device: Union[str, torch.device] = "cpu", pin: bool = False) -> None:
        self.storage = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<FlatBuffer {self.nbytes} bytes on {self.storage.device}>"

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = self.storage[offset:offset + n]
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=self.storage.device)
        return raw.view(dtype).view(shape)
