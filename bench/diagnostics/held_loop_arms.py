"""Pushes after a training step that holds the sender's event loop: how many go under an arm.

How this works: a controller and ``--receivers`` shadow receivers run in this process; one sender runs
in a process of its own and, ``--pushes`` times, takes a "training step" of ``--step-ms`` and then pushes
a 64-value tensor, awaiting its commit. The step is either blocking (``time.sleep``: synchronous compute,
the loop runs nothing meanwhile, as in most trainers) or awaited (``asyncio.sleep``: the loop reads the
control channel meanwhile). With two or more receivers the arm comes after the commit (docs/PROTOCOL.md,
*Armed pushes*), so in the blocking case it is delivered while the loop is held; a push reads what was
delivered before it (``WeightSender.push_nowait``) and goes armed. Prints, per way, the pushes that went
armed and the median milliseconds from push to commit (the sender's timeline; ``--timeline``: the last
push's events, the controller's and the receivers' beside the sender's, since the push). The pushes start
once each process has loaded its CPU delta kernels (``delta_cpu.warmed``: on a machine that compiles them
first, ~10 s during which that thread holds the GIL and every round is tens of milliseconds).
docs/OPERATIONS.md.

    python3 bench/diagnostics/held_loop_arms.py [--receivers 2] [--pushes 20] [--step-ms 50] [--timeline] [--no-streams]
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
        from weightsync.engine.transforms import delta_cpu

        weights = {NAME: torch.zeros(64, dtype=torch.bfloat16)}
        async with WeightSender(addr, weights, rank=0) as sender:
            await asyncio.to_thread(delta_cpu.warmed, 120)  # (its start-up load holds the GIL: not a step's cost)
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
            out.put((sender.early.pushes, statistics.median(waits[1:]) * 1e3, sender.timeline.of(pushes)))
    asyncio.run(main())


async def run(blocking: bool, receivers: int, pushes: int, step_s: float, streams: bool = True) -> tuple[int, float, list]:
    from weightsync.engine.transforms import delta_cpu
    from weightsync.roles import Controller, ControllerOptions, WeightReceiver
    from weightsync.roles.timeline import merge

    ctx = mp.get_context("spawn")
    async with Controller(senders=1, receivers=receivers, options=ControllerOptions(session_streams=streams)) as ctl:
        members = [WeightReceiver(ctl.address, {NAME: torch.zeros(64, dtype=torch.bfloat16)}, rank=r)
                   for r in range(receivers)]
        for r in members:
            await r.start()
        await asyncio.to_thread(delta_cpu.warmed, 120)
        try:
            out = ctx.Queue()
            proc = ctx.Process(target=_sender, args=(ctl.address, blocking, pushes, step_s, out))
            proc.start()
            armed, wait_ms, marks = await asyncio.to_thread(out.get, True, 60 + pushes * step_s * 2)
            await asyncio.to_thread(proc.join, 30)
            sources = {"sender": marks, "controller": ctl.timeline.of(pushes),
                       **{f"receiver {r}": m.timeline.of(pushes) for r, m in enumerate(members)}}
            return armed, wait_ms, merge(marks.get("send:armed_push", marks.get("send:push", 0.0)), sources)
        finally:
            for r in members:
                await r.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--timeline", action="store_true", help="the sender's events of its last push")
    ap.add_argument("--no-streams", action="store_true", help="sessions stay on ZeroMQ (ControllerOptions.session_streams)")
    args = ap.parse_args()
    for blocking in (True, False):
        armed, wait_ms, last = asyncio.run(run(blocking, args.receivers, args.pushes, args.step_ms / 1e3,
                                                   not args.no_streams))
        print(f"{'blocking' if blocking else 'awaited'} step of {args.step_ms:.0f} ms, {args.receivers} receivers: "
              f"{armed} of {args.pushes} pushes armed, push to commit {wait_ms:.2f} ms (median)", flush=True)
        if args.timeline:  # the last push's events, every role's, at their milliseconds since the push
            for ms, event in last:
                print(f"  {ms:9.3f}  {event}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
