"""A round's host cost with nothing to move: a controller, a sender and a receiver in one event loop (uvloop).

How this works: the three members run in this process over loopback (ZeroMQ control, TCP data), with
one 64-value bf16 tensor and no end-to-end checks (``--full-check-every N``: every Nth round checked end
to end, ``ControllerOptions.full_check_every``; 1: every round, crc32 on this CPU); after 5 warm-up rounds it times ``--rounds`` pushes,
each awaited to its commit, and prints the median and mean milliseconds. With one loop doing all the
work, the figure is the members' Python and ZeroMQ's I/O threads, no process wake-ups: what the control
path itself costs (docs/TRANSPORTS.md). ``--profile``: cProfile of the timed rounds, hottest functions.

    python3 bench/diagnostics/round_in_process.py --rounds 400 [--full-check-every N] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


async def rounds(n: int, profile: bool, full_check_every: int = 0) -> list[float]:
    from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender

    sent = {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}
    served = {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}
    async with Controller(senders=1, receivers=1, options=ControllerOptions(full_check_every=full_check_every)) as ctl:
        async with WeightSender(ctl.address, sent, rank=0) as sender, WeightReceiver(ctl.address, served, rank=0):
            await ctl.wait_ready()
            for v in range(1, 6):
                await (await sender.push(v))
            prof = cProfile.Profile() if profile else None
            times = []
            if prof:
                prof.enable()
            for v in range(6, 6 + n):
                t0 = time.perf_counter()
                await (await sender.push(v))
                times.append(time.perf_counter() - t0)
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--full-check-every", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    from weightsync.engine.aio import install_uvloop

    install_uvloop()
    times = asyncio.run(rounds(args.rounds, args.profile, args.full_check_every))
    print(f"empty round in one process (full_check_every={args.full_check_every}): median {statistics.median(times) * 1e3:.3f} ms, "
          f"mean {statistics.mean(times) * 1e3:.3f} ms over {len(times)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
