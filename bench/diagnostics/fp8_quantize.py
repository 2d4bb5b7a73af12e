"""Microbenchmark: block-FP8 quantization of Qwen2.5-7B's quantized weights on one GPU, step by step.

Times (median of N after a warm-up, all weights the FP8 receiver takes): the engine's
``quantize_blocks``; its two passes alone (block max, scale-and-round); the same function under
``torch.compile`` (fused by Inductor, if it compiles here); and the engine's Triton kernel
(``weightsync.engine.transforms.fp8_kernel``) one weight per launch, one layer per launch and all weights in one launch;
then as a round runs it (``fp8_kernel.Batch`` written in place at fixed destinations, as into a receiver's
tensors), plain and fingerprinted (a checked round's launch: ``fingerprint=True``), beside a device copy
of the same bf16 bytes. Bytes read/written per element say how far each is from the memory bound.

    python3 bench/diagnostics/fp8_quantize.py --rounds 5
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def _time(fn, weights, rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from weightsync.engine.transforms.layouts import FP8Policy
    from weightsync.engine.models.shapes import state_dict_shapes
    from weightsync.engine.transforms import quantize_blocks

    policy = FP8Policy()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
               for p in state_dict_shapes("qwen2.5-7b") if policy.wants(p.name, len(p.shape))]
    elems = sum(w.numel() for w in weights)

    def block_max(w):
        b = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
        lo, hi = torch.aminmax(b, dim=3)
        return torch.maximum(hi.amax(dim=1), lo.amin(dim=1).neg())

    scales = {id(w): quantize_blocks(w)[1] for w in weights}

    def scale_and_round(w):
        b = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        torch.mul(b, scales[id(w)].reciprocal()[:, None, :, None], out=q.view(b.shape))

    def cast_only(w):
        w.to(torch.float8_e4m3fn)

    rows = {"quantize_blocks (engine)": _time(quantize_blocks, weights, args.rounds),
            "  block max (aminmax)": _time(block_max, weights, args.rounds),
            "  scale and round (mul, out=fp8)": _time(scale_and_round, weights, args.rounds),
            "plain cast bf16 -> fp8 (no scales)": _time(cast_only, weights, args.rounds)}
    try:
        compiled = torch.compile(quantize_blocks, dynamic=False)
        t0 = time.perf_counter()
        for w in weights:
            compiled(w)
        torch.cuda.synchronize()
        rows[f"torch.compile(quantize_blocks) (compile {time.perf_counter() - t0:.1f} s)"] = _time(
            compiled, weights, args.rounds)
    except Exception as exc:  # report, keep the other rows
        rows[f"torch.compile failed: {repr(exc)[:120]}"] = float("nan")
    from weightsync.engine.transforms.fp8_kernel import quantize_many

    rows["Triton kernel (engine.transforms.fp8_kernel), one launch per weight"] = _time(
        lambda w: quantize_many([w]), weights, args.rounds)
    per_layer = [weights[i:i + 7] for i in range(0, len(weights), 7)]  # q, k, v, o, gate, up, down
    rows["Triton kernel, one launch per layer (7 weights)"] = _time(quantize_many, per_layer, args.rounds)
    rows["Triton kernel, one launch for all weights"] = _time(quantize_many, [weights], args.rounds)
    from weightsync.engine.transforms.fp8_kernel import Batch

    q = torch.empty(elems + 16 * len(weights), dtype=torch.float8_e4m3fn, device="cuda")  # (16-aligned starts)
    s = torch.empty(sum(-(-w.shape[0] // 128) * -(-w.shape[1] // 128) for w in weights), dtype=torch.float32, device="cuda")
    dests, q_at, s_at = [], q.data_ptr(), s.data_ptr()
    for w in weights:
        dests.append((q_at, s_at))
        q_at += -(-w.numel() // 16) * 16
        s_at += 4 * -(-w.shape[0] // 128) * -(-w.shape[1] // 128)
    for fingerprint in (False, True):
        batch = Batch(weights, 128, dests, fingerprint=fingerprint)
        label = "  the same, fingerprinted (a checked round)" if fingerprint else \
            f"Triton kernel written in place (a round's Batch, {len(batch.launches)} launches)"
        rows[label] = _time(lambda _: batch.run(), [None], args.rounds)
    flat = torch.cat([w.reshape(-1) for w in weights])
    rows["device copy of the same bf16 bytes (for scale)"] = _time(lambda _: torch.empty_like(flat).copy_(flat), [None],
                                                                   args.rounds)
    del q, s, flat
    print(f"{len(weights)} weights, {elems / 1e9:.2f} G elements ({2 * elems / 1e9:.1f} GB bf16)")
    for name, s in rows.items():
        print(f"  {name:<60} {s * 1e3:8.2f} ms  {2 * elems / s / 1e9:7.0f} GB/s of bf16 read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
