"""Name mapping and layout: which source bytes, transformed how, make up each receiver tensor.

How this works. A ``Mapping`` is an ordered list of declarative ``Rule`` s for one architecture; the
first rule whose ``dst`` template matches a receiver name says which trainer parameters (``parts``,
templates sharing its placeholders) are concatenated along dim 0 to make it, whether they are
GPT-2 ``Conv1D`` weights to transpose, and whether each part is itself ``split`` fused components (GPT-2's
``c_attn`` holds q, k and v). A name no rule matches maps to the source of the same name (identity).

``parts_for`` (pure) turns one receiver ``TensorSpec`` into ``Part`` s: a source slice (in the source's
own coordinates), a transform (``weightsync.engine.transforms`` grammar) and the bytes' place in the receiver
tensor. Tensor parallelism: a receiver declares a ``ShardSpec`` of its tensor; a dim-0 shard of a fused
tensor is taken per component (shard ``i`` of ``w`` gets the ``i``-th ``w``-th of q, of k and of v), any
other dim slices every component. Dtypes: a different float dtype is a cast; ``float8_e4m3fn`` with a
``<name>_scale_inv`` float32 tensor next to it is 128x128 block quantization, each part on its own grid
(DeepSeek-V3 / vLLM block FP8), and the scale tensor's parts are derived from the weight's; a 3-D stack of
matrices (fused MoE experts [E, R, C], R whole blocks) is quantized matrix by matrix, its scales [E, R/128,
ceil(C/128)].
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import string
from math import prod
from typing import Mapping as MappingT, Optional, Sequence

from weightsync.wire import ShardSpec, Slice, TensorSpec, dtype_size

from ..errors import BadTiling, ConfigError, ManifestMismatch, UnknownParameter

FP8 = "float8_e4m3fn"
SCALE_SUFFIX = "_scale_inv"
BLOCK = 128
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclasses.dataclass(frozen=True)
class Rule:
    """Receiver names of the form ``dst`` are made of ``parts``; templates share ``{placeholders}``.

    A placeholder matches ``where[name]`` (a regular expression; any text by default). ``parts``
    defaults to ``(dst,)``: the same name, for a rule that only transposes."""

    dst: str
    parts: tuple[str, ...] = ()
    transpose: bool = False  # the sources are Conv1D weights [in, out]; the receiver holds [out, in]
    split: int = 1  # each part holds this many equal fused components along its output dim
    where: tuple[tuple[str, str], ...] = ()
    # each part is a stack of matrices [E, R, C] whose R rows hold this many fused components (an expert's
    # gate and up): a shard of R (tensor parallelism inside every expert) takes its share of each
    stack_split: int = 1

    def __post_init__(self) -> None:
        if not self.parts:
            object.__setattr__(self, "parts", (self.dst,))
        if self.split < 1 or self.stack_split < 1:
            raise ConfigError("split", f"rule {self.dst!r}: split and stack_split must be >= 1, got "
                                       f"{self.split}, {self.stack_split}")
        groups = dict(self.where)
        object.__setattr__(self, "_dst_re", _template_regex(self.dst, groups))
        object.__setattr__(self, "_part_re", _template_regex(self.parts[0], groups))

    def match(self, name: str) -> Optional[tuple[str, ...]]:
        """The source names that make receiver name ``name``, or None if this rule does not apply."""
        m = self._dst_re.fullmatch(name)
        if m is None:
            return None
        return tuple(p.format(**m.groupdict()) for p in self.parts)

    def produce(self, source_name: str) -> Optional[str]:
        """The receiver name this rule makes from a source matching its first part, else None."""
        m = self._part_re.fullmatch(source_name)
        return None if m is None else self.dst.format(**m.groupdict())


def _template_regex(template: str, groups: dict[str, str]) -> "re.Pattern":
    out, seen = [], set()
    try:
        for literal, field, _, _ in string.Formatter().parse(template):
            out.append(re.escape(literal))
            if field is None:
                continue
            out.append(f"(?P={field})" if field in seen else f"(?P<{field}>{groups.get(field, '.+')})")
            seen.add(field)
        return re.compile("".join(out))
    except (re.error, ValueError) as exc:
        raise ConfigError("rule", f"template {template!r} does not compile: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Mapping:
    name: str
    rules: tuple[Rule, ...] = ()

    def recipe(self, dst_name: str) -> tuple[Rule, tuple[str, ...]]:
        for rule in self.rules:
            parts = rule.match(dst_name)
            if parts is not None:
                return rule, parts
        return IDENTITY_RULE, (dst_name,)

    def receiver_names(self, source_names: Sequence[str]) -> list[str]:
        """The names a receiver with this layout holds, in source order (a fused name at its first part)."""
        have = set(source_names)
        consumed: set[str] = set()
        out: list[str] = []
        for src in source_names:
            if src in consumed:
                continue
            for rule in self.rules:
                dst = rule.produce(src)
                if dst is None:
                    continue
                parts = rule.match(dst)
                if parts and all(p in have for p in parts):
                    consumed.update(parts)
                    out.append(dst)
                    break
            else:
                out.append(src)
        return out


IDENTITY_RULE = Rule("{name}")

_DECODER = (  # Llama / Qwen2 / Qwen3 / Mistral: vLLM fuses q, k, v and gate, up along dim 0
    Rule("{p}.self_attn.qkv_proj.{w}",
         ("{p}.self_attn.q_proj.{w}", "{p}.self_attn.k_proj.{w}", "{p}.self_attn.v_proj.{w}"),
         where=(("w", "weight|bias"),)),
    Rule("{p}.mlp.gate_up_proj.weight", ("{p}.mlp.gate_proj.weight", "{p}.mlp.up_proj.weight")),
)
_GPT2 = (  # transformers' GPT-2 uses Conv1D ([in, out]); Linear-based engines hold [out, in]
    Rule("{p}.attn.c_attn.weight", transpose=True, split=3),
    Rule("{p}.attn.c_attn.bias", split=3),
    Rule("{p}.{m}.weight", transpose=True, where=(("m", r"attn\.c_proj|mlp\.c_fc|mlp\.c_proj"),)),
)

_VLLM_EXPERTS = (  # Qwen3-MoE, OLMoE: transformers' fused experts are vLLM's (gate_up [E, 2I, H] is w13, gate first;
    # under TP without EP, each rank's w13 holds every expert's share of gate, then of up)
    Rule("{p}.mlp.experts.routed_experts.w13_weight", ("{p}.mlp.experts.gate_up_proj",), stack_split=2),
    Rule("{p}.mlp.experts.routed_experts.w2_weight", ("{p}.mlp.experts.down_proj",)),
)

_SHARED_EXPERTS = (  # DeepSeek-V3 / GLM-4.5: vLLM fuses the shared experts' gate and up
    Rule("{p}.mlp.shared_experts.gate_up_proj.weight",
         ("{p}.mlp.shared_experts.gate_proj.weight", "{p}.mlp.shared_experts.up_proj.weight")),
)

_DEEPSEEK = (  # DeepSeek-V3 / Kimi-K2 (MLA): vLLM fuses the two down-projections q_a and kv_a (with the
    # shared rope key) and the shared experts' gate and up; kv_b_proj stays whole (MLA derives its absorbed
    # matrices from it after loading: the vLLM worker remakes them at commit)
    Rule("{p}.self_attn.fused_qkv_a_proj.weight",
         ("{p}.self_attn.q_a_proj.weight", "{p}.self_attn.kv_a_proj_with_mqa.weight")),
    *_SHARED_EXPERTS,
)

_QWEN2_MOE = (  # Qwen2-MoE: one shared expert beside the routed ones, its gate and up fused by vLLM
    # (its sigmoid gate ``shared_expert_gate`` keeps its name)
    Rule("{p}.mlp.shared_expert.gate_up_proj.weight",
         ("{p}.mlp.shared_expert.gate_proj.weight", "{p}.mlp.shared_expert.up_proj.weight")),
)

_MIXTRAL = (  # Mixtral: vLLM keeps the MoE block under its checkpoint name, block_sparse_moe (transformers 5:
    # mlp); its experts are vLLM's fused stacks as in Qwen3-MoE
    Rule("{p}.block_sparse_moe.gate.weight", ("{p}.mlp.gate.weight",)),
    Rule("{p}.block_sparse_moe.experts.routed_experts.w13_weight", ("{p}.mlp.experts.gate_up_proj",),
         stack_split=2),
    Rule("{p}.block_sparse_moe.experts.routed_experts.w2_weight", ("{p}.mlp.experts.down_proj",)),
)

MAPPINGS: dict[str, Mapping] = {
    "identity": Mapping("identity"),
    "llama": Mapping("llama", _DECODER),
    "qwen2": Mapping("qwen2", _DECODER),
    "qwen3": Mapping("qwen3", _DECODER),
    "qwen2_moe": Mapping("qwen2_moe", _DECODER + _QWEN2_MOE + _VLLM_EXPERTS),
    "qwen3_moe": Mapping("qwen3_moe", _DECODER + _VLLM_EXPERTS),
    "olmoe": Mapping("olmoe", _DECODER + _VLLM_EXPERTS),  # (its q/k norms span every head: whole on each rank)
    "mistral": Mapping("mistral", _DECODER),
    "gemma2": Mapping("gemma2", _DECODER),  # Gemma 2 and 3 (text): their extra norms keep their names
    "gemma3_text": Mapping("gemma3_text", _DECODER),
    "mixtral": Mapping("mixtral", _DECODER + _MIXTRAL),
    "deepseek_v3": Mapping("deepseek_v3", _DECODER + _DEEPSEEK + _VLLM_EXPERTS),
    "glm4_moe": Mapping("glm4_moe", _DECODER + _SHARED_EXPERTS + _VLLM_EXPERTS),
    "gpt2": Mapping("gpt2", _GPT2),
}


def get_mapping(mapping: "str | Mapping") -> Mapping:
    if isinstance(mapping, Mapping):
        return mapping
    try:
        return MAPPINGS[mapping]
    except KeyError:
        raise ConfigError("mapping", f"unknown mapping {mapping!r}; known: {sorted(MAPPINGS)}") from None


@dataclasses.dataclass(frozen=True)
class SourceShape:
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Component:
    """Rows ``start:stop`` of a source's output dim, in the receiver's orientation."""

    src: str
    start: int
    stop: int
    transpose: bool
    out_dim: int  # the source dim that becomes the receiver's dim 0 (-1: a scalar)
    rest: tuple[int, ...]  # the receiver-orientation shape after dim 0
    src_size: int  # the source's size along out_dim
    stack_split: int = 1  # a stack of matrices holding this many fused components along dim 1 (``Rule``)

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Part:
    """One contiguous write: ``slice`` of source ``src`` -> ``nbytes`` at ``offset`` into the receiver tensor."""

    src: str
    slice: Optional[Slice]
    offset: int
    nbytes: int
    transform: str
    row_bytes: int  # > 0: the part may be cut at multiples of this along source dim 0 (plain copies only)


def components(mapping: Mapping, dst: str, sources: MappingT[str, SourceShape], where: str
               ) -> tuple[list[Component], str]:
    """The receiver tensor ``dst`` as components in order; also the sources' common dtype."""
    rule, names = mapping.recipe(dst)
    out: list[Component] = []
    dtypes: set[str] = set()
    for src in names:
        s = sources.get(src)
        if s is None:
            raise UnknownParameter(src, where, _closest(src, sources), part_of=None if src == dst else dst)
        dtypes.add(s.dtype)
        transpose = rule.transpose and len(s.shape) == 2
        out_dim = 1 if transpose else 0
        if not s.shape:
            out.append(Component(src, 0, 0, False, -1, (), 0))
            continue
        rest = (s.shape[0],) if transpose else tuple(s.shape[1:])
        size = s.shape[out_dim]
        if size % rule.split:
            raise BadTiling(f"{size} rows cannot be split into {rule.split} fused components", param=src)
        step = size // rule.split
        stack = rule.stack_split if len(s.shape) == 3 else 1
        out.extend(Component(src, k * step, (k + 1) * step, transpose, out_dim, rest, size, stack)
                   for k in range(rule.split))
    if len(dtypes) > 1 or len({c.rest for c in out}) > 1:
        raise ManifestMismatch(f"parts {list(names)} disagree in dtype or trailing shape", param=dst, ranks=[where])
    return out, dtypes.pop()


def full_shape(comps: Sequence[Component]) -> tuple[int, ...]:
    if len(comps) == 1 and comps[0].out_dim < 0:
        return ()
    return (sum(c.rows for c in comps), *comps[0].rest)


def _closest(name: str, names) -> list[str]:
    return difflib.get_close_matches(name, list(names), n=3, cutoff=0.5)


def dtype_transform(src_dtype: str, t: TensorSpec, where: str, custom: MappingT[tuple[str, str], str],
                    names: frozenset) -> str:
    """The per-element step from the source dtype to what the receiver wants ('' when they agree)."""
    if t.dtype == src_dtype:
        return ""
    if (src_dtype, t.dtype) in custom:
        return custom[(src_dtype, t.dtype)]
    if t.dtype == FP8 and src_dtype in FLOATS:
        if t.name + SCALE_SUFFIX not in names:
            raise ManifestMismatch(f"an {FP8} weight needs its block scales as {t.name + SCALE_SUFFIX!r}",
                                   param=t.name, ranks=[where])
        if len(t.shape) not in (2, 3):
            raise ManifestMismatch(f"block FP8 quantizes 2-D weights and 3-D stacks of them (fused experts), "
                                   f"this one is {len(t.shape)}-D", param=t.name, ranks=[where])
        if len(t.shape) == 3 and t.shape[1] % BLOCK:
            raise BadTiling(f"a stack of matrices {list(t.shape)} is quantized per matrix: its {t.shape[1]} rows "
                            f"(dim 1) must be whole {BLOCK}-row blocks", param=t.name, ranks=[where])
        return f"fp8w:{BLOCK}"
    if t.dtype in FLOATS and src_dtype in FLOATS:
        return f"cast:{t.dtype}"
    raise ManifestMismatch(f"receiver wants {t.dtype}, senders have {src_dtype} and no transform converts them",
                           param=t.name, ranks=[where])


def parts_for(t: TensorSpec, comps: Sequence[Component], step: str, where: str,
              scale_of: Optional[TensorSpec] = None) -> list[Part]:
    """The writes that fill receiver tensor ``t`` (or, with ``scale_of``, the FP8 scales of that weight)."""
    weight = scale_of or t
    if tuple(weight.full_shape) != full_shape(comps):
        raise ManifestMismatch(f"receiver wants full shape {list(weight.full_shape)}, the mapping gives "
                               f"{list(full_shape(comps))} from {sorted({c.src for c in comps})}",
                               param=weight.name, ranks=[where])
    if weight.shard is not None and weight.shard.dim == 1 and comps[0].stack_split > 1:
        return _inside_matrices(t, comps, weight.shard, step, where, scale_of is not None)
    regions = _shard_regions(weight.name, weight.shard, comps, where)
    if scale_of is not None:
        return _scale_parts(t, regions, step, where)
    size = dtype_size(t.dtype)
    out: list[Part] = []
    offset = 0
    for comp, rows, cols in regions:
        local = _local_shape(comp, rows, cols)
        nbytes = prod(local) * size
        out.append(_part(comp, rows, cols, offset, nbytes, step, size))
        offset += nbytes
    return out


def _inside_matrices(t: TensorSpec, comps: Sequence[Component], shard: ShardSpec, step: str, where: str,
                     scales: bool) -> list[Part]:
    """A tensor-parallel shard of every matrix of a stack [E, R, C] whose R rows hold fused components
    (``Rule.stack_split``: an expert's gate and up): shard ``i`` of ``w`` holds, matrix after matrix, the
    ``i``-th ``w``-th of each component's rows (vLLM's w13 without expert parallelism). One part, the
    whole stack through the ``share`` transform, which a sender may apply to any run of whole matrices
    (``cuts._matrix_runs``)."""
    comp = comps[0]
    if len(comps) > 1 or step.startswith("fp8") or scales:
        raise ManifestMismatch("a shard inside every matrix of a fused stack is made from one source and "
                               "not quantized to block FP8 here", param=t.name, ranks=[where])
    experts, rows, cols = shard.full_shape
    span, k = shard.stop - shard.start, comp.stack_split
    if span == 0 or rows % span or shard.start % span or rows % k or (rows // k) % (rows // span):
        raise BadTiling(f"rows {shard.start}:{shard.stop} of dim 1 ({rows} rows in {k} fused components) are "
                        f"not one of equal tensor-parallel shards of each component", param=t.name, ranks=[where])
    share = f"share:{k}.{shard.start // span}.{rows // span}"
    return [Part(comp.src, None, 0, experts * span * cols * dtype_size(t.dtype), ",".join(filter(None, (share, step))), 0)]


def block_scale_shape(name: str, shard: Optional[ShardSpec], comps: Sequence[Component]) -> tuple[int, ...]:
    """The float32 ``<name>_scale_inv`` a receiver holding ``shard`` of weight ``name`` needs."""
    blocks = [_blocks(_local_shape(c, rows, cols)) for c, rows, cols in _shard_regions(name, shard, comps, "layout")]
    return (sum(b[0] for b in blocks), *blocks[-1][1:])


def _blocks(local: tuple[int, ...]) -> tuple[int, ...]:
    """The block grid of a region: block rows and columns of a 2-D one (edge blocks ragged); of a 3-D
    stack of matrices (fused experts, each on its own grid), the matrices and each one's grid."""
    *stack, r, c = local
    return (*stack, -(-r // BLOCK), -(-c // BLOCK))


def _shard_regions(name: str, shard: Optional[ShardSpec], comps: Sequence[Component], where: str):
    """Per component: (rows in the component, (dim, start, stop) of another receiver dim or None)."""
    if shard is None or comps[0].out_dim < 0:
        return [(c, (0, c.rows), None) for c in comps]
    if shard.dim != 0:
        return [(c, (0, c.rows), (shard.dim, shard.start, shard.stop)) for c in comps]
    if len(comps) == 1:
        return [(comps[0], (shard.start, shard.stop), None)]
    span = shard.stop - shard.start
    total = shard.full_shape[0]
    if span == 0 or total % span or shard.start % span:
        raise BadTiling(f"rows {shard.start}:{shard.stop} of {total} are not one of equal tensor-parallel shards",
                        param=name, ranks=[where])
    world, index = total // span, shard.start // span
    out = []
    for c in comps:
        if c.rows % world:
            raise BadTiling(f"component {c.src} [{c.start}:{c.stop}] has {c.rows} rows, not divisible into "
                            f"{world} tensor-parallel shards", param=name, ranks=[where])
        each = c.rows // world
        out.append((c, (index * each, (index + 1) * each), None))
    return out


def _local_shape(comp: Component, rows: tuple[int, int], cols) -> tuple[int, ...]:
    if comp.out_dim < 0:
        return ()
    shape = [rows[1] - rows[0], *comp.rest]
    if cols is not None:
        shape[cols[0]] = cols[2] - cols[1]
    return tuple(shape)


def _source_slice(comp: Component, rows: tuple[int, int], cols) -> Optional[Slice]:
    """The one source dim that needs cutting (a cut along two is refused); dim-0 copies always carry one."""
    if comp.out_dim < 0:
        return None
    a, b = comp.start + rows[0], comp.start + rows[1]
    cuts = []
    if (a, b) != (0, comp.src_size) or (comp.out_dim == 0 and cols is None):
        cuts.append((comp.out_dim, a, b))
    if cols is not None:
        dim, start, stop = cols
        cuts.append(((1 - comp.out_dim) if comp.transpose else dim, start, stop))
    if len(cuts) > 1:
        raise BadTiling(f"needs a slice of {comp.src} along two dims (a fused component and a shard)",
                        param=comp.src)
    return Slice(*cuts[0]) if cuts else None


def _part(comp: Component, rows, cols, offset: int, nbytes: int, step: str, size: int) -> Part:
    sl = _source_slice(comp, rows, cols)
    steps = [s for s in ("t" if comp.transpose else "", step) if s]
    plain = not steps and (sl is None or sl.dim == 0) and comp.out_dim >= 0
    row_bytes = prod(comp.rest) * size if plain else 0
    return Part(comp.src, sl, offset, nbytes, ",".join(steps), row_bytes)


def _scale_parts(t: TensorSpec, regions, step: str, where: str) -> list[Part]:
    if not step.startswith("fp8w:"):
        raise ManifestMismatch(f"{t.name} looks like block scales, but its weight is not quantized to {FP8}",
                               param=t.name, ranks=[where])
    rows_total, grid, offset, out = 0, (), 0, []
    for k, (comp, rows, cols) in enumerate(regions):
        local = _local_shape(comp, rows, cols)
        if k < len(regions) - 1 and len(local) == 2 and local[0] % BLOCK:  # (a stack's matrices: each its own grid)
            raise BadTiling(f"fused component {comp.src} has {local[0]} rows: block FP8 needs a multiple of "
                            f"{BLOCK} to keep the components' blocks apart", param=t.name, ranks=[where])
        grid = _blocks(local)
        nbytes = prod(grid) * 4
        steps = [s for s in ("t" if comp.transpose else "", "fp8s" + step[4:]) if s]
        out.append(Part(comp.src, _source_slice(comp, rows, cols), offset, nbytes, ",".join(steps), 0))
        rows_total += grid[0]
        offset += nbytes
    want = (rows_total, *grid[1:])
    if t.dtype != "float32" or tuple(t.shape) != want:
        raise ManifestMismatch(f"block scales must be float32 {list(want)}, receiver has "
                               f"{t.dtype}{list(t.shape)}", param=t.name, ranks=[where])
    return out
