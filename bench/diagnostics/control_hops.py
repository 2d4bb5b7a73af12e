"""Control-message round trips between two processes: back to back, after idle gaps, and with the
event loops kept polling (``weightsync.engine.aio.Spinner``) or PM QoS held (``/dev/cpu_dma_latency`` = 0).

Why: a round's control messages reach processes that have been idle for tens of milliseconds; this
measures what such a hop costs on a machine, apart from the engine (pyzmq asyncio on uvloop, ROUTER <->
DEALER, 100-byte messages, median of 110-380 round trips). Results: docs/results/control_hops_h200x2.txt.
``channel_round_trips`` (the last line) makes the same round trip through the engine's own control
channel (``roles.channel.ControlChannel``: its socket pump, the codec, a ``fence_commit`` out and a
``commit_ack`` back, each encoded, sent, received and decoded, with ``--auth`` HMAC-signed and CURVE
encrypted too): what one round trip of a round's messages costs before any role acts on them; and the
same through the channel's session stream (``roles.channel_stream``: after ``welcome`` a session's
messages go on a TCP stream of its own, with ``--auth`` sealed with ChaCha20-Poly1305).

    python3 bench/diagnostics/control_hops.py [qos] [--auth]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pathlib
import statistics
import struct
import sys
import time

import zmq
import zmq.asyncio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # (the checkout: ``weightsync``)


async def _spinner(stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0)


AS_THEY_ARE, IO_HERE = -1, -2  # ``pin``'s ways other than a CPU


def pin(cpu: int, ctx: "zmq.Context | None" = None) -> None:
    """Where this process's threads run (bench/diagnostics/hop_wakeups.py): ``cpu`` >= 0, this thread and
    the threads it starts next (``ctx``'s I/O thread among them) on that CPU; ``IO_HERE``, ``ctx``'s I/O
    thread alone on the CPU this thread runs on now; ``AS_THEY_ARE``, nothing moved."""
    if cpu == IO_HERE:
        import ctypes

        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, ctypes.CDLL(None).sched_getcpu())
    elif cpu >= 0:
        os.sched_setaffinity(0, {cpu})
        if ctx is not None:
            ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)


def _echo(addr: str, spin: bool, cpu: int = AS_THEY_ARE) -> None:
    import uvloop

    uvloop.install()

    async def main():
        ctx = zmq.asyncio.Context()
        pin(cpu, ctx)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        stop = asyncio.Event()
        if spin:
            asyncio.ensure_future(_spinner(stop))
        await sock.send(b"hi")
        while True:
            frames = await sock.recv_multipart()
            if frames[0] == b"q":
                break
            await sock.send_multipart(frames)
        stop.set()
        sock.close()
        ctx.term()
    asyncio.run(main())


async def trips(once, gap_s: float, n: int, spin: bool, block: bool = True) -> list[float]:
    """Seconds of each of ``n`` awaits of ``once()`` (a round trip), after ten warm-up ones, ``gap_s``
    apart: idle in a blocking sleep (``block``: as a controller between the messages of a round) or in
    the loop (which ``spin`` keeps polling)."""
    stop = asyncio.Event()
    if spin:
        asyncio.ensure_future(_spinner(stop))
    times = []
    try:
        for _ in range(n):
            if gap_s and block:
                time.sleep(gap_s)  # this process idles (blocking), as a controller does between messages
            elif gap_s:
                await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            await once()
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
    return times[10:]


async def round_trips(gap_s: float, spin: bool, cpus: tuple[int, int] = (AS_THEY_ARE, AS_THEY_ARE), block: bool = True,
                      n: int = 0) -> list[float]:
    """ZeroMQ round trips to an echoing process (``trips``); ``cpus``: ``pin`` here and there."""
    ctx = zmq.asyncio.Context()
    pin(cpus[0], ctx)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    proc = mp.get_context("spawn").Process(target=_echo, args=(sock.getsockopt_string(zmq.LAST_ENDPOINT), spin,
                                                                cpus[1]))
    proc.start()
    ident, _ = await sock.recv_multipart()

    async def once() -> None:
        await sock.send_multipart([ident, b"x" * 100])
        await sock.recv_multipart()
    try:
        return await trips(once, gap_s, n or (120 if gap_s else 400), spin, block)
    finally:
        await sock.send_multipart([ident, b"q"])
        proc.join(30)
        sock.close()
        ctx.term()


def _channel_echo(addr: str, key, stream: bool = False) -> None:
    import uvloop

    uvloop.install()

    async def main():
        from weightsync.roles.channel import ControlChannel
        from weightsync.wire import messages as m

        chan = ControlChannel(zmq.DEALER, "receiver/0", auth_key=key)
        chan.connect(addr)
        await chan.send(m.Heartbeat(0))
        if stream:  # (the welcome names the stream's port and token: every message after it goes there)
            _, env = await chan.recv()
            await chan.attach("127.0.0.1", env.body.stream_port, env.body.stream_token, 10.0)
        while True:
            _, env = await chan.recv()
            if not isinstance(env.body, m.FenceCommit):
                break
            await chan.send(m.CommitAck(env.body.version, True, "", 1e-4, 0.0), version=env.body.version)
        chan.close()
    asyncio.run(main())


async def channel_round_trips(key=None, rounds: int = 400, stream: bool = False) -> list[float]:
    """Round trips through ``ControlChannel`` (the module's header): seconds each, after ten warm-up ones;
    ``stream``: through its session stream."""
    from weightsync.roles.channel import ControlChannel
    from weightsync.wire import messages as m

    chan = ControlChannel(zmq.ROUTER, "controller", auth_key=key)
    addr = chan.bind("tcp://127.0.0.1:0")
    port = chan.listen_stream("127.0.0.1") if stream else None
    proc = mp.get_context("spawn").Process(target=_channel_echo, args=(addr, key, stream))
    proc.start()
    peer, _ = await chan.recv()
    if stream:
        token = os.urandom(16)
        await chan.send(m.Welcome("s", 3, 4, 500, 5000, ("stream",), None, port, token), to=peer)
        chan.expect(peer, token)
    summary = m.WriteSummary(0, 294, 1260334848, (), b"p" * 80)  # (a cuda_ipc proof's size)
    times = []
    try:
        for v in range(1, rounds + 1):
            t0 = time.perf_counter()
            await chan.send(m.FenceCommit(v, (summary,)), to=peer, version=v)
            await chan.recv()
            times.append(time.perf_counter() - t0)
        await chan.send(m.Abort(0, m.AbortReason.SHUTDOWN, "done", "controller"), to=peer)
    finally:
        proc.join(30)
        chan.close()
    return times[10:]


def main() -> int:
    import uvloop

    uvloop.install()
    if "qos" in sys.argv[1:]:  # PM QoS: no deep C-states on any CPU while this file stays open
        try:
            qos = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
            os.write(qos, struct.pack("i", 0))
            print("cpu_dma_latency=0 held")
        except OSError as exc:
            print("no PM QoS:", exc)
    for gap_s, spin in ((0.0, False), (0.02, False), (0.02, True)):
        times = sorted(asyncio.run(round_trips(gap_s, spin)))
        print(f"gap {gap_s * 1e3:.0f} ms spin {spin}: rtt median {statistics.median(times) * 1e6:.1f} us "
              f"p90 {times[int(0.9 * len(times))] * 1e6:.1f}")
    key = os.urandom(32) if "--auth" in sys.argv[1:] else None
    for stream in (False, True):
        times = sorted(asyncio.run(channel_round_trips(key, stream=stream)))
        print(f"engine channel{' on its session stream' if stream else ''} (fence_commit -> commit_ack"
              f"{', signed and encrypted' if key else ''}): rtt median "
              f"{statistics.median(times) * 1e6:.1f} us p90 {times[int(0.9 * len(times))] * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
