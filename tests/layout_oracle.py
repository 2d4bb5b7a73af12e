"""What a vLLM-style inference rank should hold, computed from the trainer's tensors with plain torch
(cat, chunk, transpose), independently of the planner's part arithmetic; and the FP8 receiver check."""

from __future__ import annotations

import torch

from weightsync.engine.transforms import within_fp8_bound
from weightsync.engine.transforms.layouts import TensorParallel


def qwen2_state(seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def expected_qwen2(src: dict, name: str, tp: TensorParallel = TensorParallel(0, 1)) -> torch.Tensor:
    """What a TP rank holds under ``name`` (vLLM names and shards)."""
    i, w = tp.index, tp.world
    if ".qkv_proj." in name:
        return torch.cat([src[name.replace("qkv_proj", f"{c}_proj")].chunk(w)[i] for c in "qkv"])
    if ".gate_up_proj." in name:
        return torch.cat([src[name.replace("gate_up_proj", f"{c}_proj")].chunk(w)[i] for c in ("gate", "up")])
    if ".o_proj." in name or ".down_proj." in name:
        return src[name].chunk(w, dim=1)[i]
    if "embed_tokens" in name or "lm_head" in name:
        return src[name].chunk(w)[i]
    return src[name]


def expected_gpt2(src: dict, name: str, tp: TensorParallel) -> torch.Tensor:
    i, w = tp.index, tp.world
    t = src[name]
    if name.endswith("c_attn.weight"):
        return torch.cat([part.t().chunk(w)[i] for part in t.chunk(3, dim=1)])
    if name.endswith("c_attn.bias"):
        return torch.cat([part.chunk(w)[i] for part in t.chunk(3)])
    if name.endswith("mlp.c_fc.weight"):
        return t.t().chunk(w)[i]
    if name.endswith("mlp.c_fc.bias") or name.endswith("wte.weight") or name == "lm_head.weight":
        return t.chunk(w)[i]
    if name.endswith("c_proj.weight"):
        return t.t().chunk(w, dim=1)[i]
    return t


def check_fp8_receiver(state: dict, want) -> list[str]:
    """Names whose tensors are wrong: FP8 weights must dequantize within the stated bound of
    ``want(name)``, everything else must equal it. Returns the quantized names."""
    quantized = []
    for name, got in state.items():
        if name.endswith("_scale_inv"):
            continue
        ref = want(name)
        if got.dtype != torch.float8_e4m3fn:
            assert torch.equal(got, ref), name
            continue
        quantized.append(name)
        assert within_fp8_bound(ref, got, state[name + "_scale_inv"]), name
    return quantized
