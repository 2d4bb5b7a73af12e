"""Where a round's GPU time goes, from a sender's torch.profiler trace (``bench/transfer_mn.py --trace``).

How this works: the bench marks each push with ``record_function("round vN")``. This reads the Chrome
trace (``senderR.json.gz``), takes the GPU events (kernels, copies, memsets) that ran inside each round's
span, and prints per round: its span, and per CUDA stream the events, their busy time and the first
start and last end relative to the round's start; then the longest events of the median round. It
shows whether a sender's copies overlap (one stream each, running at once) or queue on one stream, and
how much of the round the GPU was busy at all. The receivers' kernels (colocated receivers share the
GPU) are not in a sender's trace.

    python3 bench/diagnostics/trace_rounds.py OUT/trace/sender0.json.gz [--top 12] [--skip 1]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def rounds_of(events: list[dict]) -> list[tuple[str, float, float]]:
    """[(name, start_us, end_us)] of the ``round vN`` ranges, in time order."""
    out = [(e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("ph") == "X" and re.fullmatch(r"round v\d+", str(e.get("name", "")))
           and e.get("cat") in ("user_annotation", "cpu_op", None)]
    return sorted(set(out), key=lambda r: r[1])


def summarize(events: list[dict], start: float, end: float) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X" and start <= e["ts"] < end]
    streams: dict = collections.defaultdict(list)
    for e in gpu:
        streams[str(e.get("args", {}).get("stream", e.get("tid")))].append(e)
    per_stream = {}
    for s, evs in sorted(streams.items()):
        per_stream[s] = {"events": len(evs), "busy_ms": round(sum(e["dur"] for e in evs) / 1e3, 3),
                         "first_ms": round((min(e["ts"] for e in evs) - start) / 1e3, 3),
                         "last_end_ms": round((max(e["ts"] + e["dur"] for e in evs) - start) / 1e3, 3)}
    top = sorted(gpu, key=lambda e: -e["dur"])
    return {"span_ms": round((end - start) / 1e3, 3), "streams": per_stream,
            "top": [(e["name"][:90], str(e.get("args", {}).get("stream", e.get("tid"))),
                     round((e["ts"] - start) / 1e3, 3), round(e["dur"] / 1e3, 3)) for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--skip", type=int, default=1, help="rounds left out first (the first plans and compiles; "
                    "transfer_mn's rounds still timing their ways into another GPU: 8 with 11 rounds)")
    args = ap.parse_args()
    with gzip.open(args.trace, "rt") if args.trace.endswith(".gz") else open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    rounds = rounds_of(events)[args.skip:]
    if not rounds:
        raise SystemExit(f"{args.trace}: no 'round vN' ranges (run bench/transfer_mn.py --trace)")
    sums = [(name, summarize(events, s, e)) for name, s, e in rounds]
    for name, s in sums:
        streams = "  ".join(f"stream {k}: {v['events']} ev busy {v['busy_ms']} ms [{v['first_ms']}, {v['last_end_ms']}]"
                            for k, v in s["streams"].items())
        print(f"{name}: span {s['span_ms']} ms  {streams}")
    spans = [s["span_ms"] for _, s in sums]
    name, med = sorted(sums, key=lambda x: x[1]["span_ms"])[len(sums) // 2]
    print(f"median round {name} (span {med['span_ms']} ms of {statistics.median(spans)}): longest GPU events")
    for ev, stream, at, dur in med["top"][:args.top]:
        print(f"  {at:8.3f} +{dur:7.3f} ms  stream {stream}  {ev}")


if __name__ == "__main__":
    main()
