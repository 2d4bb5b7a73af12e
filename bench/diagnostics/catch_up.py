"""Microbenchmark: how a two-slot receiver brings a delta row of its landing slot up to the round's base.

A two-slot receiver's landing slot holds the version before its live one, so before a delta applies
there the row must equal the base (the live row). Three ways, timed on one row of ``--mb`` MiB of bf16
whose values changed by one unit in the last place at each fraction (median of ``--rounds``):

- ``copy_ms``: copy the whole row from the live slot (what ``roles.delta_landing`` does);
- ``scatter_ms``: copy only the positions the previous round changed (kept from its delta);
- ``reapply_ms``: apply the previous round's delta again (the compiled CPU kernel; CPU only).

Each result is checked equal to the live row bit for bit. On the CPU at 1-3% changed the whole copy
is the fastest (random access per changed value costs more than streaming the row), so the receiver
copies whole rows; docs/DELTAS.md says so with these figures.

    python3 bench/diagnostics/catch_up.py [--device cpu|cuda] [--mb 128] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from weightsync.engine.transforms import delta as codec  # noqa: E402
from weightsync.engine.transforms import delta_cpu  # noqa: E402

FRACTIONS = (0.001, 0.01, 0.03, 0.1)


def _time(fn, rounds: int, device: torch.device) -> float:
    times = []
    for _ in range(rounds + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def case(numel: int, fraction: float, device: torch.device, rounds: int, gen: torch.Generator) -> dict:
    older = torch.randn(numel, generator=gen, device=gen.device).to(torch.bfloat16)
    positions = torch.randperm(numel, generator=gen, device=gen.device)[:max(1, int(numel * fraction))].sort().values
    live = older.clone()
    codec.bits(live)[positions] += 1  # (the previous round: one unit in the last place)
    out: dict = {"fraction": fraction, "changes": positions.numel()}
    if device.type == "cpu" and delta_cpu.usable(older):  # (made on the CPU: ``gen`` is the CPU's)
        delta, _ = delta_cpu.advance(older.clone(), live)
        landing = older.clone()

        def reapply():
            landing.copy_(older)  # (timed apart, below)
            delta_cpu.apply(delta, landing, checked=True)
        both = _time(reapply, rounds, device)
        out["reapply_equal"] = torch.equal(codec.bits(landing), codec.bits(live))
        out["reapply_ms"] = round(both - _time(lambda: landing.copy_(older), rounds, device), 3)
    older, live, positions = older.to(device), live.to(device), positions.to(device)
    landing = older.clone()
    out["copy_ms"] = round(_time(lambda: landing.copy_(live), rounds, device), 3)
    out["copy_equal"] = torch.equal(codec.bits(landing), codec.bits(live))
    landing = older.clone()
    bits, source = codec.bits(landing), codec.bits(live)
    out["scatter_ms"] = round(_time(lambda: bits.index_copy_(0, positions, source[positions]), rounds, device), 3)
    out["scatter_equal"] = torch.equal(bits, source)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    numel = (args.mb << 20) // 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ok = True
    for fraction in FRACTIONS:
        row = {"device": name, "mb": args.mb, **case(numel, fraction, device, args.rounds, gen),
               "command": "bench/diagnostics/catch_up.py " + " ".join(sys.argv[1:] if argv is None else argv)}
        ok = ok and all(v for k, v in row.items() if k.endswith("_equal"))
        print(json.dumps(row) if args.json else row, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
