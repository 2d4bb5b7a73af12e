"""Transforms: what a sender does to a row on the way (transposes, dtype casts, TP slices, fused names,
block FP8), and the FSDP gathers that make full tensors of sharded ones.

How this works: ``steps`` is the transform grammar, pure (a row's steps parsed, the ``share`` step, FP8
quantizations grouped into launches); ``core`` runs a row's steps (``TransformSet``: per round, shared
and grouped quantizations; ``in_place``: those written straight into the receiver where the transport can
address it);
``fp8`` is the block-FP8 reference (eager torch) and ``fp8_kernel`` the Triton kernel that quantizes
many tensors in one launch (imported only where CUDA is); ``layouts`` builds receiver layouts (vLLM's
TP shards, fused qkv / gate_up, the FP8 policy); ``gather`` runs FSDP2 all-gathers under a byte budget.
docs/TRANSFORMS.md has the details.
"""

from .core import THREAD_BYTES, Transform, TransformSet
from .steps import GROUP_BYTES, GROUP_SIZE, GROUPS_IN_BUDGET, group_bytes_for, parse, plan_quant_groups
from .fp8 import FP8_MAX, MIN_AMAX, Quantizer, dequantize_blocks, fp8_error_bound, quantize_blocks, within_fp8_bound

__all__ = ["FP8_MAX", "GROUPS_IN_BUDGET", "GROUP_BYTES", "GROUP_SIZE", "MIN_AMAX", "THREAD_BYTES", "Quantizer",
           "Transform", "TransformSet", "dequantize_blocks", "fp8_error_bound", "group_bytes_for", "parse",
           "plan_quant_groups", "quantize_blocks", "within_fp8_bound"]
