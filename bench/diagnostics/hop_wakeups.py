"""Where an idle hop's time goes: a control round trip between two processes 20 ms apart, over ZeroMQ
(pyzmq asyncio on uvloop, ROUTER <-> DEALER: ``control_hops.round_trips``) and over a plain asyncio TCP
stream (no I/O threads), the event loops idle or polling while they wait (``spin``), and each process's
threads pinned (``control_hops.pin``): all of them to one CPU, or its ZeroMQ I/O thread alone to the
CPU its loop runs on. Results: docs/results/hop_wakeups_h100.txt.

    python3 bench/diagnostics/hop_wakeups.py [--gap-ms 20] [--n 150]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from control_hops import AS_THEY_ARE, IO_HERE, _spinner, pin, round_trips, trips  # noqa: E402

PINS = {AS_THEY_ARE: "no", IO_HERE: "io thread only"}


def _tcp_echo(port: int, spin: bool, cpu: int) -> None:
    import uvloop

    async def main():
        pin(cpu)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        stop = asyncio.Event()
        if spin:
            asyncio.ensure_future(_spinner(stop))
        while (data := await reader.readexactly(100))[:1] != b"q":
            writer.write(data)
        stop.set()
        writer.close()
    uvloop.run(main())


async def tcp_round_trips(gap_s: float, spin: bool, cpus: tuple[int, int], n: int) -> list[float]:
    """The same round trips over one asyncio TCP stream (``trips``, idle in the loop)."""
    pin(cpus[0])
    conns: asyncio.Queue = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: conns.put_nowait((r, w)), "127.0.0.1", 0)
    proc = mp.get_context("spawn").Process(target=_tcp_echo, args=(server.sockets[0].getsockname()[1], spin, cpus[1]))
    proc.start()
    reader, writer = await conns.get()

    async def once() -> None:
        writer.write(b"x" * 100)
        await reader.readexactly(100)
    try:
        return await trips(once, gap_s, n, spin, block=False)
    finally:
        writer.write(b"q" * 100)
        proc.join(30)
        writer.close()
        server.close()


def main() -> int:
    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--n", type=int, default=150)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    far = (cpus[0], cpus[len(cpus) // 2])
    gap, none, here = args.gap_ms / 1e3, (AS_THEY_ARE,) * 2, (IO_HERE,) * 2
    cases = [("zmq", 0.0, False, none), ("zmq", gap, False, none), ("zmq", gap, True, none), ("zmq", gap, True, far),
             ("zmq", gap, False, far), ("zmq", gap, True, here), ("tcp", 0.0, False, none), ("tcp", gap, False, none),
             ("tcp", gap, True, none), ("tcp", gap, True, far)]
    for way, g, spin, where in cases:
        n = args.n if g else 400
        run = (round_trips(g, spin, where, block=False, n=n) if way == "zmq" else tcp_round_trips(g, spin, where, n))
        times = sorted(uvloop.run(run))
        print(f"{way} gap {g * 1e3:.0f} ms spin {spin} pinned {where if where[0] >= 0 else PINS[where[0]]}: rtt median "
              f"{statistics.median(times) * 1e6:.1f} us p90 {times[int(0.9 * len(times))] * 1e6:.1f}", flush=True)
        os.sched_setaffinity(0, cpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
