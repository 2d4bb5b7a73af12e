"""Where an idle hop's time goes: a control round trip between two processes 20 ms apart, over ZeroMQ
(pyzmq asyncio on uvloop, ROUTER <-> DEALER, as ``control_hops.py``) and over a plain asyncio TCP stream
(no I/O threads), with the event loops idle or polling (``--spin``), and with each process's ZeroMQ
I/O thread pinned to the CPU its event loop runs on (``ZMQ_THREAD_AFFINITY_CPU_ADD``, the loop's thread
pinned there too).

    python3 bench/diagnostics/hop_wakeups.py [--gap-ms 20] [--n 200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import zmq
import zmq.asyncio


async def _spin(stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0)


def _pin(cpu: int, ctx: zmq.Context | None) -> None:
    """-2: only the I/O thread, to the CPU the loop's thread is on now; -3: the I/O thread SCHED_FIFO."""
    if cpu == -3:
        ctx.set(zmq.THREAD_SCHED_POLICY, 1)  # (SCHED_FIFO)
        ctx.set(zmq.THREAD_PRIORITY, 1)
        return
    if cpu == -2:
        import ctypes

        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, ctypes.CDLL(None).sched_getcpu())
        return
    os.sched_setaffinity(0, {cpu})
    if ctx is not None:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)


def _zmq_echo(addr: str, spin: bool, pin: int) -> None:
    import uvloop

    async def main():
        ctx = zmq.asyncio.Context()
        if pin != -1:
            _pin(pin, ctx)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        stop = asyncio.Event()
        if spin:
            asyncio.ensure_future(_spin(stop))
        await sock.send(b"hi")
        while True:
            frames = await sock.recv_multipart()
            if frames[0] == b"q":
                break
            await sock.send_multipart(frames)
        stop.set()
        sock.close()
        ctx.term()
    uvloop.run(main())


def _tcp_echo(port: int, spin: bool, pin: int) -> None:
    import uvloop

    async def main():
        if pin >= 0:
            _pin(pin, None)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        stop = asyncio.Event()
        if spin:
            asyncio.ensure_future(_spin(stop))
        while True:
            data = await reader.readexactly(100)
            if data[:1] == b"q":
                break
            writer.write(data)
        stop.set()
        writer.close()
    uvloop.run(main())


async def _zmq_rtts(gap: float, n: int, spin: bool, pin: tuple[int, int]) -> list[float]:
    ctx = zmq.asyncio.Context()
    if pin[0] != -1:
        _pin(pin[0], ctx)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(sock.getsockopt_string(zmq.LAST_ENDPOINT), spin, pin[1]))
    proc.start()
    ident, _ = await sock.recv_multipart()
    stop = asyncio.Event()
    if spin:
        asyncio.ensure_future(_spin(stop))
    times = []
    for _ in range(n):
        await asyncio.sleep(gap)
        t0 = time.perf_counter()
        await sock.send_multipart([ident, b"x" * 100])
        await sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    await sock.send_multipart([ident, b"q"])
    stop.set()
    proc.join(30)
    sock.close()
    ctx.term()
    return times[10:]


async def _tcp_rtts(gap: float, n: int, spin: bool, pin: tuple[int, int]) -> list[float]:
    if pin[0] >= 0:
        _pin(pin[0], None)
    conns: asyncio.Queue = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: conns.put_nowait((r, w)), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_tcp_echo, args=(port, spin, pin[1]))
    proc.start()
    reader, writer = await conns.get()
    stop = asyncio.Event()
    if spin:
        asyncio.ensure_future(_spin(stop))
    times = []
    for _ in range(n):
        await asyncio.sleep(gap)
        t0 = time.perf_counter()
        writer.write(b"x" * 100)
        await reader.readexactly(100)
        times.append(time.perf_counter() - t0)
    writer.write(b"q" * 100)
    stop.set()
    proc.join(30)
    writer.close()
    server.close()
    return times[10:]


def main() -> int:
    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    far = (cpus[0], cpus[len(cpus) // 2]) if len(cpus) > 1 else (cpus[0], cpus[0])
    gap = args.gap_ms / 1e3
    cases = [("zmq", 0.0, False, (-1, -1)), ("zmq", gap, False, (-1, -1)), ("zmq", gap, True, (-1, -1)),
             ("zmq", gap, True, far), ("zmq", gap, False, far), ("zmq", gap, True, (-2, -2)),
             ("zmq", gap, True, (-3, -3)), ("zmq", 0.0, False, (-3, -3)),
             ("tcp", 0.0, False, (-1, -1)), ("tcp", gap, False, (-1, -1)), ("tcp", gap, True, (-1, -1)),
             ("tcp", gap, True, far)]
    for way, g, spin, pin in cases:
        run = _zmq_rtts if way == "zmq" else _tcp_rtts
        times = sorted(uvloop.run(run(g, args.n if g else 400, spin, pin)))
        print(f"{way} gap {g * 1e3:.0f} ms spin {spin} pinned {pin if pin[0] >= 0 else {-1: 'no', -2: 'io thread only', -3: 'io fifo'}[pin[0]]}: rtt median "
              f"{statistics.median(times) * 1e6:.1f} us p90 {times[int(0.9 * len(times))] * 1e6:.1f}", flush=True)
        os.sched_setaffinity(0, cpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
