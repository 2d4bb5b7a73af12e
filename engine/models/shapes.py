"""Real architectures' parameter shapes, from transformers config classes: no download, no weights.

How this works: the model is instantiated on torch's ``meta`` device (shapes only, no memory), and its
state dict's names, shapes and dtypes are read off. ``ARCHITECTURES`` holds the configs the benchmarks
use (Qwen2.5-7B, Qwen3-235B-A22B, a Kimi-K2 / DeepSeek-V3-shaped 1T MoE, GPT-2 sizes). ``tp_slice``
says how a tensor-parallel / expert-parallel inference rank slices each parameter (vLLM's layout:
column-parallel along dim 0, row-parallel along dim 1, fused experts along the expert dim).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    dtype: str


def _qwen25_7b():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def _qwen25_05b():  # (the real one ties lm_head to the embedding; untied here: every tensor its own)
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False)


def _qwen3_235b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                          num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)


def _qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)


def _kimi_k2():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
                            n_routed_experts=384, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=1536,
                            kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                            vocab_size=163840)


def gpt2_config(size: str = "small"):
    from transformers import GPT2Config

    dims = {"tiny": (2, 128, 4), "small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20)}
    if size not in dims:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose from {sorted(dims)}")
    n_layer, n_embd, n_head = dims[size]
    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)


ARCHITECTURES: dict[str, Callable[[], object]] = {
    "qwen2.5-7b": _qwen25_7b,
    "qwen2.5-0.5b": _qwen25_05b,
    "qwen3-235b-a22b": _qwen3_235b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "kimi-k2": _kimi_k2,
}


@functools.lru_cache(maxsize=None)
def state_dict_shapes(arch: str, dtype: str = "bfloat16", layers: Optional[int] = None) -> tuple[ParamShape, ...]:
    """The parameter names and shapes of ``arch`` (a key of ARCHITECTURES or ``gpt2-<size>``); ``layers``:
    only that many decoder layers (a slice of a big model that fits a benchmark's GPUs)."""

    if arch.startswith("gpt2-"):
        config = gpt2_config(arch.split("-", 1)[1])
    elif arch in ARCHITECTURES:
        config = ARCHITECTURES[arch]()
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(ARCHITECTURES)} or gpt2-<size>")
    if layers is not None:
        config.num_hidden_layers = layers
    return config_shapes(config, dtype)


def config_shapes(config, dtype: str = "bfloat16") -> tuple[ParamShape, ...]:
    """The parameter names and shapes of a transformers config's causal LM (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tuple(ParamShape(n, tuple(t.shape), dtype) for n, t in model.state_dict().items())


def per_expert(shapes: tuple[ParamShape, ...]) -> tuple[ParamShape, ...]:
    """``shapes`` with each fused expert tensor (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) split into per-expert ``experts.{e}.gate_proj/up_proj/down_proj.weight``: how most training
    checkpoints (and the trainers of RL frameworks) hold a MoE model, thousands of tensors."""
    out = []
    for p in shapes:
        fused = _EXPERTS.search(p.name)
        if not fused:
            out.append(p)
            continue
        prefix = p.name[:fused.start()] + "experts"
        experts, rows, cols = p.shape
        for e in range(experts):
            if fused.group(1) == "gate_up_proj":
                out += [ParamShape(f"{prefix}.{e}.{proj}.weight", (rows // 2, cols), p.dtype) for proj in ("gate_proj", "up_proj")]
            else:
                out.append(ParamShape(f"{prefix}.{e}.down_proj.weight", (rows, cols), p.dtype))
    return tuple(out)


_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj|embed_tokens|lm_head)\.weight$")
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")
_EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)$")


def tp_slice(name: str, shape: tuple[int, ...], tp_rank: int, tp_size: int,
             ep_rank: Optional[int] = None, ep_size: int = 1) -> Optional[tuple[int, int, int]]:
    """(dim, start, stop) this inference rank holds, or None for the whole tensor (replicated)."""
    experts = _EXPERTS.search(name)
    if experts and ep_size > 1 and ep_rank is not None:
        dim, part, idx = 0, ep_size, ep_rank
        size = shape[0]
    elif experts and tp_size > 1:  # TP inside each expert: gate_up [E, 2I, H] by rows, down [E, H, I] by columns
        dim = 1 if experts.group(1) == "gate_up_proj" else 2
        part, idx = tp_size, tp_rank
        size = shape[dim]
    elif _COLUMN.search(name) and tp_size > 1:
        dim, part, idx = 0, tp_size, tp_rank
        size = shape[0]
    elif _ROW.search(name) and tp_size > 1 and len(shape) == 2:
        dim, part, idx = 1, tp_size, tp_rank
        size = shape[1]
    else:
        return None
    if size % part:
        return None  # not divisible (e.g. fewer KV heads than ranks): vLLM replicates these
    step = size // part
    return dim, idx * step, (idx + 1) * step


def bench_model(name: str) -> tuple[ParamShape, ...]:
    """The state dicts the transfer benchmarks move: ``qwen2.5-7b`` (dense, 339 tensors, 15.2 GB),
    ``qwen2.5-0.5b`` (dense, 291 tensors, 1.26 GB: the size many RL research runs use) and
    ``qwen3-30b-a3b`` (12 of its 48 layers, per-expert tensors: 4,719 tensors, 16.2 GB)."""
    if name == "qwen3-30b-a3b":
        return per_expert(state_dict_shapes(name, layers=12))
    return state_dict_shapes(name)
