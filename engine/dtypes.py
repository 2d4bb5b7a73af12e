"""Dtypes by name: the names that travel in manifests (``wire.DTYPE_SIZES``) and torch's dtypes.

How this works: ``dtype_name`` is torch's name without its prefix, refused (``ConfigError``) unless the
wire knows its size; ``dtype_from_name`` is the reverse. Shared by the data path and the transforms.
"""

from __future__ import annotations

import torch

from weightsync.wire import DTYPE_SIZES

from .errors import ConfigError


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError("dtype", f"{dtype} cannot travel (supported: {', '.join(sorted(DTYPE_SIZES))})")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("dtype", f"unknown dtype {name!r}")
    return dtype
