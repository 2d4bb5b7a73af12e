"""A round's host cost with nothing to move: a controller, a sender and a receiver in one event loop (uvloop).

How this works: the three members run in this process over loopback (ZeroMQ control, TCP data), with
one 64-value bf16 tensor and no end-to-end checks (``--full-check-every N``: every Nth round checked end
to end, ``ControllerOptions.full_check_every``; 1: every round, crc32 on this CPU); after 5 warm-up rounds it times ``--rounds`` pushes,
each awaited to its commit, and prints the median and mean milliseconds. With one loop doing all the
work, the figure is the members' Python and ZeroMQ's I/O threads, no process wake-ups: what the control
path itself costs (docs/TRANSPORTS.md). ``--profile``: cProfile of the timed rounds, hottest functions.
``--timeline``: each event of a round (``roles/timeline``: every message sent and received, the
sender's pipeline steps) at its median milliseconds since the controller started the round, with the
step from the event before: where a round's host time goes, message by message. ``--no-arm``: the
controller offers no arms, so each push waits for its ``begin`` (docs/PROTOCOL.md, *Armed pushes*).

    python3 bench/diagnostics/round_in_process.py --rounds 400 [--full-check-every N] [--no-arm] [--profile] [--timeline]
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


async def rounds(n: int, profile: bool, full_check_every: int = 0, arm: bool = True) -> tuple[list[float], list]:
    """(each timed round's seconds, each one's merged timeline: ``roles.timeline.merge``)."""
    from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender
    from weightsync.engine.transforms import delta_cpu
    from weightsync.roles.timeline import merge

    sent = {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}
    served = {"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}
    options = ControllerOptions(full_check_every=full_check_every, arm_pushes=arm)
    async with Controller(senders=1, receivers=1, options=options) as ctl:
        async with WeightSender(ctl.address, sent, rank=0) as sender, \
                WeightReceiver(ctl.address, served, rank=0) as receiver:
            await ctl.wait_ready()
            await asyncio.to_thread(delta_cpu.warmed)  # (steady rounds: not while the CPU delta kernels load)
            for v in range(1, 6):
                await (await sender.push(v))
            prof = cProfile.Profile() if profile else None
            times, timelines = [], []
            if prof:
                prof.enable()
            for v in range(6, 6 + n):
                t0 = time.perf_counter()
                await (await sender.push(v))
                times.append(time.perf_counter() - t0)
                marks = ctl.timeline.of(v)  # (between rounds, untimed: timelines keep their last 16 versions only)
                timelines.append(merge(marks["round:start"], {"controller": marks, "sender": sender.timeline.of(v),
                                                              "receiver": receiver.timeline.of(v)}))
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return times, timelines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--full-check-every", type=int, default=0, metavar="N")
    ap.add_argument("--timeline", action="store_true", help="print each event's median time in the round")
    ap.add_argument("--no-arm", action="store_true", help="no arms: each push waits for its begin")
    args = ap.parse_args(argv)
    from weightsync.engine.aio import install_uvloop
    from weightsync.roles.timeline import medians

    install_uvloop()
    times, timelines = asyncio.run(rounds(args.rounds, args.profile, args.full_check_every, not args.no_arm))
    if args.timeline:
        before = None
        for event, ms in medians(timelines):
            print(f"{ms:8.3f} ms  {'' if before is None else f'+{ms - before:.3f}':>7}  {event}")
            before = ms
    print(f"empty round in one process (full_check_every={args.full_check_every}, arms {'off' if args.no_arm else 'on'}): median {statistics.median(times) * 1e3:.3f} ms, "
          f"mean {statistics.mean(times) * 1e3:.3f} ms over {len(times)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
