"""Row deltas on real training steps: how many bf16 values an AdamW step changes, what the delta codec
(engine/transforms/delta.py) makes of them, and how fast it encodes and applies, on this CPU.

    .venv/bin/python bench/delta_codec.py --out docs/results/delta_codec_cpu.json   # ~100M parameters

How this works: a Qwen2 built from a transformers config (fp32 master weights, AdamW at ``--lr``, random
tokens) takes ``--steps`` optimizer steps. After each, every parameter's bf16 cast (what inference
serves) is encoded against the previous step's cast, the delta is packed, unpacked and applied to a copy
of the base, and the result must equal the new cast bit for bit (else the run fails). Per step: the
changed fraction, bytes per changed value (headers and escapes included; rows that go whole counted
whole), whole bytes over wire bytes, and encode / apply throughput in GB/s of served bytes. This is the
codec alone; rounds that carry deltas are measured by their own bench once they exist.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from weightsync.engine.transforms import delta as d  # noqa: E402
from weightsync.engine.transforms.fp8 import quantize_blocks  # noqa: E402


def model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).float()


def fp8_state(net) -> dict:
    """Each matrix's block-FP8 form (128 x 128 scales), as an FP8 receiver holds it."""
    return {n: quantize_blocks(p.detach().to(torch.bfloat16)) for n, p in net.named_parameters() if p.dim() == 2}


def fp8_row(base: dict, new: dict, bf16_base: dict, net) -> dict:
    """For FP8 receivers: the delta of the quantized bytes and scales against the last step's, and how many
    128 x 128 blocks hold any changed bf16 value (what sending changed blocks whole would move)."""
    values = changed = scales = scales_changed = whole = wire = blocks_hit = 0
    params = dict(net.named_parameters())
    for name, (q, s) in new.items():
        q0, s0 = base[name]
        dq, ds = d.encode(q0, q), d.encode(s0, s)
        whole += q.numel() + s.numel() * 4
        wire += (dq.nbytes if dq is not None else q.numel()) + (ds.nbytes if ds is not None else s.numel() * 4)
        values += q.numel()
        changed += int((d.bits(q0) != d.bits(q)).sum())
        scales += s.numel()
        scales_changed += int((s0 != s).sum())
        moved = (d.bits(params[name].detach().to(torch.bfloat16)) != d.bits(bf16_base[name])).reshape(q.shape)
        r, c = moved.shape
        grid = torch.nn.functional.pad(moved.float(), (0, (-c) % 128, 0, (-r) % 128))
        blocks_hit += int(grid.reshape(-(-r // 128), 128, -(-c // 128), 128).amax(dim=(1, 3)).sum())
    return {"fp8_changed_fraction": round(changed / values, 5), "fp8_scales_changed": scales_changed,
            "fp8_whole_over_wire": round(whole / wire, 1), "blocks_with_a_change": round(blocks_hit / scales, 4)}


def step_row(base: dict, net) -> dict:
    changes = wire = whole = 0
    encode_s = apply_s = 0.0
    for name, p in net.named_parameters():
        new = p.detach().to(torch.bfloat16)
        t0 = time.perf_counter()
        delta = d.encode(base[name], new)
        encode_s += time.perf_counter() - t0
        whole += new.numel() * 2
        if delta is None:  # goes whole
            changes += int((d.bits(base[name]) != d.bits(new)).sum())
            wire += new.numel() * 2
        else:
            target = base[name].clone()
            received = d.unpack(d.pack(delta))
            t0 = time.perf_counter()
            d.apply(received, target, name)
            apply_s += time.perf_counter() - t0
            if not torch.equal(d.bits(target), d.bits(new)):
                raise SystemExit(f"{name}: the applied delta differs from the new bf16 values")
            changes += delta.changes
            wire += delta.nbytes
        base[name] = new.clone()
    values = whole // 2
    return {"changed_fraction": round(changes / values, 5), "bytes_per_changed_value": round(wire / max(changes, 1), 3),
            "whole_over_wire": round(whole / wire, 2), "encode_gb_s": round(whole / encode_s / 1e9, 2),
            "apply_gb_s": round(whole / max(apply_s, 1e-9) / 1e9, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    net = model(args.hidden, args.layers, args.vocab)
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    base = {n: p.detach().to(torch.bfloat16).clone() for n, p in net.named_parameters()}
    fp8 = fp8_state(net)
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (2, 64), generator=g)
        net(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        fp8_now = fp8_state(net)
        fp8_stats = fp8_row(fp8, fp8_now, base, net)
        fp8 = fp8_now
        steps.append({**step_row(base, net), **fp8_stats})
    result = {"params_m": round(params / 1e6, 1), "lr": args.lr, "optimizer": "AdamW, fp32 master weights",
              "served": "bfloat16", "steps": steps,
              "bytes_per_changed_value": max(s["bytes_per_changed_value"] for s in steps),
              "whole_over_wire_median": statistics.median(s["whole_over_wire"] for s in steps),
              "bit_exact": True, "machine": f"{os.cpu_count()} CPUs",
              "command": "bench/delta_codec.py " + " ".join(sys.argv[1:])}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
