"""What a checked round's per-row checksums cost on the control plane: a sender's ``writes_done`` built and
encoded, decoded by the controller and encoded again into the receiver's ``fence_commit``, decoded there.

Why: a checked round of a model of thousands of tensors carries a checksum per row through those four
steps; as one map per row (protocol 2.0) the chain took 7.5 ms for 4,720 rows on a 2-core CPU, as
columns (``WriteSummary.checksums: columns[Checksum]``, 3.0) decoded as columns (``Rows``) 1.2 ms. The
collector is off while timing, as it is while a round is open (``engine.aio.Collector``), and torch is
imported, as in a member.

    .venv/bin/python bench/diagnostics/summary_messages.py [--rows 4720] [--repeat 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402,F401  (a member process holds torch)

from weightsync.engine.datapath.lanes import LaneReport, PushReport  # noqa: E402
from weightsync.wire import PROTOCOL_VERSION, Envelope, decode, encode  # noqa: E402
from weightsync.wire import messages as m  # noqa: E402


def _ms(fn, repeat: int):
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - t0) / repeat * 1e3, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4720, help="checksummed rows (Qwen3-30B-A3B's lane: 4,720)")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    indices, values = list(range(args.rows)), [rng.getrandbits(64) for _ in range(args.rows)]

    def writes_done():
        lane = LaneReport(count=args.rows, nbytes=1 << 30)
        lane.add_checksums(indices, values)
        return encode(Envelope(m.WritesDone(1, 1, PushReport({0: lane}, 0.0).summaries(), 0.0, 0.0), 1, "sender/0"))

    def fence(env):
        summary = dataclasses.replace(env.body.receivers[0], peer_rank=0)
        return encode(Envelope(m.FenceCommit(1, (summary,)), 2, "controller"))

    gc.disable()
    sender, frames = _ms(writes_done, args.repeat)
    controller_in, env = _ms(lambda: decode(frames), args.repeat)
    controller_out, fenced = _ms(lambda: fence(env), args.repeat)
    receiver, got = _ms(lambda: decode(fenced), args.repeat)
    gc.enable()
    assert [c.value for c in got.body.checksums[0].checksums] == values  # (the receiver reads what was sent)
    print(f"protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}, {args.rows} checksums: sender {sender:.2f} ms, "
          f"controller {controller_in:.2f} + {controller_out:.2f} ms, receiver {receiver:.2f} ms, "
          f"total {sender + controller_in + controller_out + receiver:.2f} ms; writes_done "
          f"{sum(len(f) for f in frames)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
