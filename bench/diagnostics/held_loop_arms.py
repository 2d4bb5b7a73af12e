"""Pushes after a training step that holds the sender's event loop: how many go under an arm.

How this works: a controller and ``--receivers`` shadow receivers run in this process; one sender runs
in a process of its own and, ``--pushes`` times, takes a "training step" of ``--step-ms`` and then pushes
a 64-value tensor, awaiting its commit. The step is either blocking (``time.sleep``: synchronous compute,
the loop runs nothing meanwhile, as in most trainers) or awaited (``asyncio.sleep``: the loop reads the
control channel meanwhile). With two or more receivers the arm comes after the commit (docs/PROTOCOL.md,
*Armed pushes*), so in the blocking case it is delivered while the loop is held; a push reads what was
delivered before it (``WeightSender.push_nowait``) and goes armed. Prints, per way, the pushes that went
armed and the median milliseconds from push to commit (the sender's timeline; ``--timeline``: the last
push's events). docs/OPERATIONS.md.

    python3 bench/diagnostics/held_loop_arms.py [--receivers 2] [--pushes 20] [--step-ms 50] [--timeline]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

NAME = "model.norm.weight"


def _sender(addr: str, blocking: bool, pushes: int, step_s: float, out) -> None:
    from weightsync.roles import WeightSender
    from weightsync.roles.timeline import push_wait

    async def main():
        weights = {NAME: torch.zeros(64, dtype=torch.bfloat16)}
        async with WeightSender(addr, weights, rank=0) as sender:
            waits = []
            for v in range(1, pushes + 1):
                if blocking:
                    time.sleep(step_s)  # (the step itself: compute that holds the loop)
                else:
                    await asyncio.sleep(step_s)
                weights[NAME].add_(1)
                await (await sender.push(v))
                marks = sender.timeline.of(v)
                waits.append(push_wait(marks))
            last = sender.timeline.of(pushes)
            out.put((sender.early.pushes, statistics.median(waits[1:]) * 1e3,
                     {event: round((t - last["recv:commit"]) * 1e3, 3) for event, t in sorted(last.items(), key=lambda kv: kv[1])}))
    asyncio.run(main())


async def run(blocking: bool, receivers: int, pushes: int, step_s: float) -> tuple[int, float]:
    from weightsync.roles import Controller, WeightReceiver

    ctx = mp.get_context("spawn")
    async with Controller(senders=1, receivers=receivers) as ctl:
        members = [WeightReceiver(ctl.address, {NAME: torch.zeros(64, dtype=torch.bfloat16)}, rank=r)
                   for r in range(receivers)]
        for r in members:
            await r.start()
        try:
            out = ctx.Queue()
            proc = ctx.Process(target=_sender, args=(ctl.address, blocking, pushes, step_s, out))
            proc.start()
            result = await asyncio.to_thread(out.get, True, 60 + pushes * step_s * 2)
            await asyncio.to_thread(proc.join, 30)
            return result
        finally:
            for r in members:
                await r.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--timeline", action="store_true", help="the sender's events of its last push")
    args = ap.parse_args()
    for blocking in (True, False):
        armed, wait_ms, last = asyncio.run(run(blocking, args.receivers, args.pushes, args.step_ms / 1e3))
        print(f"{'blocking' if blocking else 'awaited'} step of {args.step_ms:.0f} ms, {args.receivers} receivers: "
              f"{armed} of {args.pushes} pushes armed, push to commit {wait_ms:.2f} ms (median)", flush=True)
        if args.timeline:  # the last push's events at their milliseconds before its commit reached the sender
            print("  " + ", ".join(f"{event} {ms}" for event, ms in last.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
