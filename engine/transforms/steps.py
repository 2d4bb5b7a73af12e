"""The transform grammar and what is planned from it, pure: a row's steps parsed, the ``share`` step
(a TP rank's share of every fused matrix of a stack), and consecutive FP8 quantizations grouped into
launches (``plan_quant_groups``). ``core.TransformSet`` carries them out.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from weightsync.wire import Transfer

from ..errors import StagingError
from .fp8 import as_matrix

GROUP_BYTES = 256 << 20  # FP8 output bytes quantized in one launch (held until their rows are written)
GROUP_SIZE = 16  # tensors per launch
GROUPS_IN_BUDGET = 4  # groups that fit the pipeline's byte budget: one copying, the next ones quantized ahead


def share_arg(name: str, arg: str) -> tuple[int, int, int]:
    """``"k.i.w"`` (the ``share`` step's argument) -> (components, index, world)."""
    try:
        k, i, w = (int(v) for v in arg.split("."))
    except ValueError:
        raise StagingError(name, f"share needs components.index.world, got {arg!r}") from None
    if k < 1 or w < 1 or not 0 <= i < w:
        raise StagingError(name, f"share {arg!r}: index must be within world, counts >= 1")
    return k, i, w


def share(name: str, x: torch.Tensor, k: int, i: int, w: int) -> torch.Tensor:
    """Of every matrix of a stack ``x`` [E, R, C] whose R rows hold ``k`` fused components (an expert's
    gate and up), the ``i``-th ``w``-th of each component's rows, back to back: [E, R / w, C] (a
    tensor-parallel rank's share of every expert, vLLM's w13 without expert parallelism)."""
    if x.dim() != 3 or x.shape[1] % (k * w):
        raise StagingError(name, f"share {k}.{i}.{w} needs a stack whose rows divide into {k} components of "
                                 f"{w} shares, got {list(x.shape)}")
    each = x.shape[1] // k
    part = each // w
    return torch.cat([x[:, j * each + i * part: j * each + (i + 1) * part] for j in range(k)], dim=1)


@functools.lru_cache(maxsize=256)
def parse(transform: str) -> tuple[tuple[str, str], ...]:
    """``"t,fp8w:128"`` -> ``(("t", ""), ("fp8w", "128"))`` (a table has a handful of distinct strings)."""
    return tuple(step.partition(":")[::2] for step in transform.split(","))


def group_bytes_for(budget_bytes: int) -> int:
    """The group size for a pipeline budget: small enough that ``GROUPS_IN_BUDGET`` groups fit it, so
    the next groups are quantized while one is copied (with two, the copies waited for each launch)."""
    return max(1 << 20, min(GROUP_BYTES, budget_bytes // GROUPS_IN_BUDGET))


def plan_quant_groups(transfers, view_of: Callable[[Transfer], Optional[torch.Tensor]],
                      skip: frozenset = frozenset(), devices: frozenset = frozenset({"cuda"}),
                      max_bytes: int = GROUP_BYTES, max_size: int = GROUP_SIZE) -> dict[tuple, list]:
    """Consecutive quantizations (table order) of sources on ``devices`` of one dtype and block size, cut at
    ``max_size`` tensors or ``max_bytes`` of FP8 output: quantization key -> its group's
    ``(row, source view)`` list (every key of a group maps to the same list). Pure; rows whose source
    is not known yet (``view_of`` gives None) or whose transform is in ``skip`` stay ungrouped."""
    groups: dict[tuple, list] = {}
    current: list = []
    size, kind = 0, None
    for t in transfers:
        steps = parse(t.transform)
        if t.transform in skip or steps[-1][0] not in ("fp8w", "fp8s") or any(op != "t" for op, _ in steps[:-1]):
            continue  # (a cast before quantizing makes a new tensor each round: not a fixed group)
        key = quant_key(t)
        view = None if key in groups else view_of(t)
        if view is None or view.device.type not in devices or view.dim() != 2:
            continue
        nbytes = view.numel()  # one byte per FP8 element
        this_kind = (view.device, view.dtype, key[2], key[3])
        if current and (len(current) >= max_size or size + nbytes > max_bytes or kind != this_kind):
            current, size = [], 0
        current.append((t, view))
        size, kind = size + nbytes, this_kind
        groups[key] = current
    return {k: g for k, g in groups.items() if len(g) > 1}


def quant_key(t: Transfer) -> tuple:
    """Rows sharing a source region and the steps before quantization share one quantization."""
    head = t.transform.split("fp8")[0]
    block = t.transform.rpartition(":")[2]
    return (t.name, t.slice, head, block)


def quant_matrix(t: Transfer, x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as the 2-D grid it is quantized on (a stack of matrices, fused experts, as its 2-D view: the
    same grid and bytes); a ``StagingError`` naming ``t``'s parameter where it has none."""
    try:
        return as_matrix(x, block)
    except ValueError as exc:
        raise StagingError(t.name, str(exc)) from exc
