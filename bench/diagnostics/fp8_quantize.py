"""Microbenchmark: block-FP8 quantization of Qwen2.5-7B's quantized weights on one GPU, step by step.

Times (median of N after a warm-up, all weights the FP8 receiver takes): the engine's
``quantize_blocks``; its two passes alone (block max, scale-and-round); the same function under
``torch.compile`` (fused by Inductor, if it compiles here); and the engine's Triton kernel
(``weightsync.engine.transforms.fp8_kernel``) one weight per launch, one layer per launch and all weights in one launch;
then as a round runs it (``fp8_kernel.Batch`` written in place at fixed destinations, as into a receiver's
tensors), plain and fingerprinted (a checked round's launch: ``fingerprint=True``), beside a device copy
of the same bf16 bytes. Bytes read/written per element say how far each is from the memory bound.

``--device cpu``: the CPU's two formulations side by side, one thread, Qwen2.5-0.5B's quantized weights
by default (or ``--model``, ``--layers``): ``quantize_blocks`` as CPUs run it (strip by strip, in float32)
and the one pass over each whole matrix that devices run (``fp8._quantize_whole``), alternating, each
round checked to give the same bytes.

    python3 bench/diagnostics/fp8_quantize.py --rounds 5
    python3 bench/diagnostics/fp8_quantize.py --device cpu --rounds 5
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, weights, rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        _sync()
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _weights(model: str, layers, device: str) -> list:
    from weightsync.engine.models.shapes import state_dict_shapes
    from weightsync.engine.transforms.layouts import FP8Policy

    policy = FP8Policy()
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(p.shape, generator=gen, device=device, dtype=torch.bfloat16)
            for p in state_dict_shapes(model, layers=layers) if policy.wants(p.name, len(p.shape))]


def _cpu(args) -> int:
    """Strips (CPUs) beside one pass per matrix (devices), alternating rounds, same bytes checked."""
    from weightsync.engine.transforms import fp8

    torch.set_num_threads(1)
    weights = _weights(args.model or "qwen2.5-0.5b", args.layers, "cpu")
    elems = sum(w.numel() for w in weights)
    ways = {"quantize_blocks (CPUs: strips in float32)": fp8.quantize_blocks,
            "one pass over each matrix (devices: _quantize_whole)":
                lambda w: fp8._quantize_whole(fp8.as_matrix(w), 128)}
    times: dict = {name: [] for name in ways}
    for r in range(args.rounds + 1):  # (the first round warms up: not counted)
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for w in weights:
                fn(w)
            if r:
                times[name].append(time.perf_counter() - t0)
    for w in weights[:: max(1, len(weights) // 16)]:
        (q, s), (q1, s1) = (fn(w) for fn in ways.values())
        if not (torch.equal(q.reshape(-1).view(torch.uint8), q1.reshape(-1).view(torch.uint8))
                and torch.equal(s.reshape(-1), s1.reshape(-1))):
            raise SystemExit(f"the two formulations differ on a {list(w.shape)} weight")
    print(f"{len(weights)} weights, {elems / 1e6:.0f} M elements, one thread, median of {args.rounds} rounds")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:<56} {t * 1e3:8.1f} ms  {2 * elems / t / 1e9:6.2f} GB/s of bf16 read")
    first, second = (statistics.median(ts) for ts in times.values())
    print(f"  strips are {second / first:.2f}x faster (same bytes)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="", help="default: qwen2.5-7b on CUDA, qwen2.5-0.5b on the CPU")
    ap.add_argument("--layers", type=int, default=None, help="only this many decoder layers")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        return _cpu(args)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from weightsync.engine.transforms import quantize_blocks

    weights = _weights(args.model or "qwen2.5-7b", args.layers, "cuda")
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
