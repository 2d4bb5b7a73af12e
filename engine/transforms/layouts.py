"""Receiver layouts: the tensors an inference engine holds, derived from the trainer's shapes.

How this works. ``receiver_layout`` (pure) takes the trainer's parameter dtypes and shapes, a name
mapping (``weightsync.engine.plan.mapping``), and optionally a tensor-parallel position (``TensorParallel``) and
an FP8 policy (``FP8Policy``); it returns one ``LayoutEntry`` per receiver tensor: name (fused names
included), dtype, local shape and the ``ShardSpec`` a receiver declares. ``allocate`` makes the
tensors. Tensor parallelism follows vLLM's Linear classes: column-parallel layers (q/k/v and fused qkv,
gate/up and fused gate_up, MLA's q_b_proj and kv_b_proj, GPT-2 c_attn and c_fc, vocab-parallel
embeddings and lm_head) shard dim 0 and their biases; row-parallel layers (o_proj, down_proj, GPT-2
attn/mlp c_proj) shard dim 1 of the weight and replicate the bias; everything else (norms, positions,
MLA's fused q_a/kv_a down-projection, MoE routers) is replicated, and so is a
vocabulary whose size does not divide by the TP world (vLLM pads it; GPT-2's 50257 rows). Expert
parallelism (``ExpertParallel``) cuts fused expert stacks [E, R, C] along their experts; without it,
tensor parallelism goes inside every expert: a fused gate-and-up stack whose components the mapping
names (vLLM's w13) takes each rank's share of gate and of up, a down stack (w2) its columns; any other
stack is refused (a ``ConfigError`` naming it). FP8: 2-D
weights and 3-D expert stacks the policy includes become float8_e4m3fn with a float32
``<name>_scale_inv`` of 128x128 blocks next to them (a stack's, matrix by matrix: [E, R/128, C/128]);
norms, embeddings and lm_head are excluded by default.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping as MappingT, Optional, Sequence

import torch

from weightsync.wire import ShardSpec

from ..dtypes import dtype_from_name
from ..errors import ConfigError
from ..plan.mapping import FP8, SCALE_SUFFIX, Mapping, SourceShape, block_scale_shape, components, full_shape
from ..plan.mapping import MAPPINGS, get_mapping

COLUMN = (r".*\.(q_proj|k_proj|v_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|q_b_proj|kv_b_proj)\.(weight|bias)",
          r".*\.(attn\.c_attn|mlp\.c_fc)\.(weight|bias)",
          r".*(embed_tokens|lm_head|wte)\.weight")
VOCAB = r".*(embed_tokens|lm_head|wte)\.weight"
ROW = (r".*\.(o_proj|down_proj|attn\.c_proj|mlp\.c_proj)\.weight",)
EXPERT_STACKS = (r"(.*\.)?experts\.(routed_experts\.)?[^.]+",)  # fused [E, R, C]: transformers' and vLLM's names
DOWN_STACKS = (r"(.*\.)?experts\.(routed_experts\.)?(w2_weight|down_proj)",)  # [E, H, I]: row-parallel inside
FP8_EXCLUDE = (r".*norm.*", r".*embed.*", r".*lm_head.*", r".*\.wte\..*", r".*\.wpe\..*", r".*\.ln_.*",
               r".*\.(mlp|block_sparse_moe)\.gate\.weight", r".*\.shared_expert_gate\.weight")
# (the last two: MoE routers and Qwen2-MoE's shared-expert gate, which FP8 checkpoints keep as they are)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This receiver is shard ``index`` of ``world`` (vLLM-style column / row parallel layers)."""

    index: int
    world: int
    column: tuple[str, ...] = COLUMN
    row: tuple[str, ...] = ROW

    def __post_init__(self) -> None:
        _check_position("tensor_parallel", self.index, self.world)

    def dim_for(self, name: str, ndim: int) -> Optional[int]:
        if self.world == 1 or ndim == 0:
            return None
        if any(re.fullmatch(p, name) for p in self.column):
            return 0
        if ndim == 2 and any(re.fullmatch(p, name) for p in self.row):
            return 1
        return None


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """This receiver holds expert shard ``index`` of ``world``: every fused expert stack (a 3-D tensor
    whose name ``stacks`` matches, [E, R, C]) is cut along its experts, E / world each (vLLM's expert
    parallelism: the experts are not cut by tensor parallelism then)."""

    index: int
    world: int
    stacks: tuple[str, ...] = EXPERT_STACKS

    def __post_init__(self) -> None:
        _check_position("expert_parallel", self.index, self.world)

    def holds(self, name: str, ndim: int) -> bool:
        return self.world > 1 and _stack(name, ndim, self.stacks)


def _stack(name: str, ndim: int, patterns: tuple[str, ...]) -> bool:
    """Whether ``name`` (``ndim``-D) is a fused expert stack [E, R, C] by ``patterns``."""
    return ndim == 3 and any(re.fullmatch(p, name) for p in patterns)


def _check_position(field: str, index: int, world: int) -> None:
    if world < 1 or not 0 <= index < world:
        raise ConfigError(field, f"index {index} is not within world {world}")


@dataclasses.dataclass(frozen=True)
class FP8Policy:
    """Which receiver weights are served in block FP8 (patterns are full-match regular expressions)."""

    # (the latter: fused MoE expert stacks, vLLM's and transformers' names)
    include: tuple[str, ...] = (r".*\.weight",
                                r"(.*\.)?experts\.((routed_experts\.)?(w13_weight|w2_weight)|gate_up_proj|down_proj)")
    exclude: tuple[str, ...] = FP8_EXCLUDE

    def wants(self, name: str, ndim: int) -> bool:
        return (ndim in (2, 3) and any(re.fullmatch(p, name) for p in self.include)
                and not any(re.fullmatch(p, name) for p in self.exclude))


@dataclasses.dataclass(frozen=True)
class LayoutEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]  # local (this shard's) shape
    shard: Optional[ShardSpec]


def receiver_layout(sources: MappingT[str, tuple[str, Sequence[int]]], mapping: "str | Mapping" = "identity",
                    tp: Optional[TensorParallel] = None, fp8: Optional[FP8Policy] = None,
                    dtype: Optional[str] = None, ep: Optional[ExpertParallel] = None) -> list[LayoutEntry]:
    """``sources``: trainer name -> (dtype, shape). ``dtype``: the receiver's float dtype, if it differs."""
    rules = get_mapping(mapping)
    shapes = {n: SourceShape(d, tuple(s)) for n, (d, s) in sources.items()}
    out: list[LayoutEntry] = []
    for name in rules.receiver_names(list(sources)):
        comps, src_dtype = components(rules, name, shapes, "layout")
        full = full_shape(comps)
        want = dtype if dtype and src_dtype.startswith(("float", "bfloat")) else src_dtype
        if ep is not None and ep.holds(name, len(full)):
            shard = _experts(name, full, ep)
        elif tp is not None and tp.world > 1 and _stack(name, len(full), EXPERT_STACKS):
            shard = _inside_experts(name, full, tp, comps[0].stack_split)
        else:
            shard = _shard(name, full, tp)
        local = shard.local_shape() if shard is not None else full
        if fp8 is not None and fp8.wants(name, len(full)):
            if shard is not None and shard.dim == 1 and comps[0].stack_split > 1:
                raise ConfigError("fp8", f"{name}: block FP8 of a shard inside every expert of a fused stack is "
                                         f"not derived; use expert parallelism")
            out.append(LayoutEntry(name, FP8, local, shard))
            scales = block_scale_shape(name, shard, comps)
            out.append(LayoutEntry(name + SCALE_SUFFIX, "float32", scales, None))
        else:
            out.append(LayoutEntry(name, want, local, shard))
    return out


def _experts(name: str, full: tuple[int, ...], ep: ExpertParallel) -> ShardSpec:
    if full[0] % ep.world:
        raise ConfigError("expert_parallel", f"{name}: {full[0]} experts do not divide by {ep.world}")
    each = full[0] // ep.world
    return ShardSpec(full, 0, ep.index * each, (ep.index + 1) * each)


_STACK_MAPPINGS = sorted(name for name, m in MAPPINGS.items() if any(r.stack_split > 1 for r in m.rules))


def _inside_experts(name: str, full: tuple[int, ...], tp: TensorParallel, components: int) -> ShardSpec:
    """Tensor parallelism inside every expert of a fused stack (vLLM's MoE without expert parallelism): a
    stack of fused gate and up (its mapping rule names the components, ``Rule.stack_split``: vLLM's
    w13) shards dim 1, each rank its share of each component of every expert; a down stack (w2, [E, H,
    I]) dim 2, row-parallel. Any other stack (one whose components the mapping does not name) is
    refused, naming it."""
    if components > 1:
        dim = 1
    elif _stack(name, len(full), DOWN_STACKS):
        dim = 2
    else:
        raise ConfigError("tensor_parallel", f"{name}: a fused expert stack {list(full)} under tensor parallelism "
                                             f"needs its fused components named by the mapping ({', '.join(_STACK_MAPPINGS)}) "
                                             f"or expert parallelism (vLLM: enable_expert_parallel=True)")
    if full[dim] % (tp.world * components):
        raise ConfigError("tensor_parallel", f"{name}: dim {dim} of size {full[dim]} does not divide into "
                                             f"{components} component(s) of {tp.world} shards")
    each = full[dim] // tp.world
    return ShardSpec(full, dim, tp.index * each, (tp.index + 1) * each)


def _shard(name: str, full: tuple[int, ...], tp: Optional[TensorParallel]) -> Optional[ShardSpec]:
    dim = tp.dim_for(name, len(full)) if tp is not None else None
    if dim is None:
        return None
    size = full[dim]
    if size % tp.world and re.fullmatch(VOCAB, name):
        return None  # vLLM pads the vocabulary to divide; without padding, a ragged vocabulary is replicated
    if size % tp.world:
        raise ConfigError("tensor_parallel", f"{name}: dim {dim} of size {size} does not divide by {tp.world}")
    each = size // tp.world
    return ShardSpec(full, dim, tp.index * each, (tp.index + 1) * each)


def allocate(layout: Sequence[LayoutEntry], device: "str | torch.device" = "cpu"
             ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """Zeroed tensors for a layout, and the shard specs to give ``WeightReceiver(shards=...)``."""
    tensors = {e.name: torch.zeros(e.shape, dtype=dtype_from_name(e.dtype), device=device) for e in layout}
    shards = {e.name: e.shard for e in layout if e.shard is not None}
    return tensors, shards
