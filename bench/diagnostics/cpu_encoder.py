"""Microbenchmark: the CPU delta encoder (``delta_cpu.encode_many``) over a model, beside another build of
its kernels, and the memory's own read rate.

The model and steps are bench/transfer_delta.py's (``--mb`` of bf16 in 8 MiB matrices and small vectors;
``fraction`` of the values moved by one or two units in the last place), encoded in the batches a
round makes (``delta_rows.CPU_BATCH_BYTES``), one thread. Per fraction: the median of ``--rounds``
encodes (each from a fresh copy of the base), and with ``--against FILE`` (another version of
``engine/transforms/delta_kernels.py``, e.g. ``git show REV:engine/transforms/delta_kernels.py``) the same
rows encoded by it, the two alternating round by round, their packed deltas, bases and fingerprint
changes required equal. ``read_floor_ms``: one compiled pass that only reads the base and the new
bytes (xor-or of 8-byte words), what any encoder must spend; ``ns_per_change`` is the encode's time
beyond that floor per changed value.

    .venv/bin/python bench/diagnostics/cpu_encoder.py [--mb 512] [--against OLD.py] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from transfer_delta import model, step  # noqa: E402
from weightsync.engine.datapath.delta_rows import CPU_BATCH_BYTES  # noqa: E402
from weightsync.engine.transforms import delta_cpu  # noqa: E402


@numba.njit(nogil=True)
def _read(a, b):
    x = np.uint64(0)
    for i in range(a.size):
        x |= a[i] ^ b[i]
    return x


def _load(path: str):
    """A kernels module from ``path``, under a name of its own (numba's cache finds it again by it)."""
    name = f"weightsync_kernels_{zlib.crc32(pathlib.Path(path).read_bytes()):08x}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _batches(names: list[str], tensors: dict) -> list[list[str]]:
    out, size = [[]], 0
    for n in names:
        if size >= CPU_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(n)
        size += tensors[n].numel() * 2
    return out


def _encode(kernels, batches, base: dict, new: dict) -> tuple[float, list]:
    """Seconds to encode every batch through ``kernels`` (``delta_cpu.encode_many``'s), and what it gave."""
    done = []
    real = delta_cpu._kernels
    delta_cpu._kernels = lambda: kernels  # (encode_many calls the kernels it is given)
    try:
        t0 = time.perf_counter()
        for names in batches:
            done.append(delta_cpu.encode_many([(base[n].view(-1), new[n].view(-1)) for n in names]))
        return time.perf_counter() - t0, done
    finally:
        delta_cpu._kernels = real


def _same(a: list, b: list) -> bool:
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            if (x.changes, x.change) != (y.changes, y.change) or (x.packed is None) != (y.packed is None):
                return False
            if x.packed is not None and not torch.equal(x.packed, y.packed):
                return False
    return len(a) == len(b)


def run(mb: int, fractions: list[float], rounds: int, against: str) -> dict:
    torch.set_num_threads(1)
    new = model((mb, 0))
    names = list(new)
    batches = _batches(names, new)
    ours, theirs = delta_cpu._kernels(), (_load(against) if against else None)
    words = lambda t: t.view(-1).view(torch.int64).numpy().view(np.uint64)  # noqa: E731
    out = {"model_bytes": sum(t.numel() * 2 for t in new.values()), "tensors": len(names), "batches": len(batches),
           "against": against, "cases": []}
    for fraction in fractions:
        old = {n: t.clone() for n, t in new.items()}
        step(new, fraction, seed=int(fraction * 1e6) + 1)
        changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in names)
        floor, times, ref_times, same = [], [], [], True
        for r in range(rounds + 1):  # (the first: numba's load, pages touched)
            t0 = time.perf_counter()
            for n in names:
                if new[n].numel() * 2 % 8 == 0:
                    _read(words(old[n]), words(new[n]))
            floor.append(time.perf_counter() - t0)
            s, got = _encode(ours, batches, {n: t.clone() for n, t in old.items()}, new)
            times.append(s)
            if theirs is not None:
                s, ref = _encode(theirs, batches, {n: t.clone() for n, t in old.items()}, new)
                ref_times.append(s)
                same = same and _same(got, ref)
        med = lambda xs: statistics.median(xs[1:])  # noqa: E731
        case = {"fraction": fraction, "changed": changed, "read_floor_ms": round(med(floor) * 1e3, 2),
                "encode_ms": round(med(times) * 1e3, 2),
                "ns_per_change": round((med(times) - med(floor)) / max(changed, 1) * 1e9, 1)}
        if theirs is not None:
            case.update(against_ms=round(med(ref_times) * 1e3, 2), speedup=round(med(ref_times) / med(times), 3),
                        same_bytes=same)
        out["cases"].append(case)
        print(json.dumps(case), flush=True)
        new = old
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="MiB of bf16 weights")
    ap.add_argument("--fractions", default="0.001,0.01,0.03,0.1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", default="", help="another delta_kernels.py, timed beside this one")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object on the last line")
    ap.add_argument("--out", default="", help="write the figures (with the command) to this file")
    args = ap.parse_args(argv)
    out = run(args.mb, [float(f) for f in args.fractions.split(",")], args.rounds, args.against)
    out["command"] = "bench/diagnostics/cpu_encoder.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out))
    return 0 if all(c.get("same_bytes", True) for c in out["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
