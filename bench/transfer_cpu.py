"""CPU transfer benchmark: the engine over loopback TCP vs a raw socket moving the same bytes.

One sender process -> one receiver process, a ~1 GB state dict of mixed tensor sizes (big matrices,
mid-size, many small and tiny tensors), full update rounds through the public API (Controller,
WeightSender, WeightReceiver: begin -> writes -> fence -> commit). In the same run, a raw-socket
baseline: one process ``sendall``s the same number of bytes from one buffer, another ``recv_into`` a
preallocated buffer. Median of N rounds after a warm-up. Prints a table and a JSON line; the target is
the engine's full round at >= 80% of the raw socket's throughput.

    .venv/bin/python bench/transfer_cpu.py [--rounds 5] [--scale 1.0] [--checksum]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pathlib
import socket
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MiB = 1 << 20


def state_dict(scale: float) -> dict[str, torch.Tensor]:
    """Mixed sizes: 1 x 128 MiB, 12 x 64 MiB, 120 x 1 MiB, 1500 x 64 KiB, 400 x 1 KiB (about 1.0 GB)."""
    gen = torch.Generator().manual_seed(0)
    groups = [(1, 128 * MiB), (12, 64 * MiB), (120, MiB), (1500, 64 * 1024), (400, 1024)]
    out = {}
    for g, (count, nbytes) in enumerate(groups):
        for i in range(max(1, int(count * scale))):
            out[f"g{g}.t{i}"] = torch.randint(0, 255, (nbytes // 4,), generator=gen, dtype=torch.int32).float()
    return out


# --- engine ----------------------------------------------------------------------------------------


def _sender(addr: str, rounds: int, scale: float, conn) -> None:
    from engine.aio import install_uvloop
    from roles import WeightSender

    install_uvloop()

    async def main():
        tensors = state_dict(scale)
        async with WeightSender(addr, tensors, rank=0) as sender:
            for v in range(1, rounds + 1):
                tensors["g0.t0"][0] = v  # a new version (the bytes are the same size every round)
                await (await sender.push(v))
        conn.send("done")

    asyncio.run(main())


def _receiver(addr: str, rounds: int, scale: float, conn) -> None:
    from engine.aio import install_uvloop
    from roles import WeightReceiver

    install_uvloop()

    async def main():
        tensors = {k: torch.zeros_like(v) for k, v in state_dict(scale).items()}
        async with WeightReceiver(addr, tensors, rank=0) as receiver:
            await receiver.wait_for(rounds)
            conn.send(int(tensors["g0.t0"][0]))

    asyncio.run(main())


async def engine_rounds(rounds: int, scale: float, checksum: bool) -> list:
    from roles import Controller, ControllerOptions

    ctx = mp.get_context("spawn")
    opts = ControllerOptions(checksum="crc32" if checksum else "", timeout_s=60.0)
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        procs = [ctx.Process(target=_sender, args=(ctl.address, rounds, scale, pipes[0][1])),
                 ctx.Process(target=_receiver, args=(ctl.address, rounds, scale, pipes[1][1]))]
        for p in procs:
            p.start()
        reports = [await asyncio.wait_for(ctl.wait_round(v), 600) for v in range(1, rounds + 1)]
        last = await asyncio.get_running_loop().run_in_executor(None, pipes[1][0].recv)
        if last != rounds:
            raise RuntimeError(f"receiver ended on version {last}, expected {rounds}")
        for p in procs:
            p.join(60)
    return reports


# --- raw socket ------------------------------------------------------------------------------------


def _raw_receiver(port_conn, nbytes: int, rounds: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += sock.recv_into(buf[got:])
        sock.sendall(b"k")  # the receiver has every byte: same proof an engine fence gives
    sock.close()
    srv.close()


def raw_socket_rounds(nbytes: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_raw_receiver, args=(writer, nbytes, rounds))
    proc.start()
    port = reader.recv()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the engine's sockets
    data = memoryview(bytearray(nbytes))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        times.append(time.perf_counter() - t0)
    sock.close()
    proc.join(30)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="engine vs raw socket over loopback")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (one more is a warm-up)")
    ap.add_argument("--scale", type=float, default=1.0, help="scale the state dict (1.0 is about 1 GB)")
    ap.add_argument("--checksum", action="store_true", help="verify CRC-32 per transfer in the engine rounds")
    args = ap.parse_args(argv)
    total = args.rounds + 1
    tensors = state_dict(args.scale)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    del tensors
    raw = raw_socket_rounds(nbytes, total)[1:]
    reports = asyncio.run(engine_rounds(total, args.scale, args.checksum))[1:]
    eng_round = [r.seconds for r in reports]
    eng_transfer = [r.stages["transfer"] for r in reports]
    raw_s, round_s, xfer_s = (statistics.median(x) for x in (raw, eng_round, eng_transfer))
    gb = nbytes / 1e9
    rows = [("raw socket (sendall -> recv_into)", raw_s), ("engine: transfer stage (begin -> writes done)", xfer_s),
            ("engine: full round (begin -> commit acked)", round_s)]
    print(f"{len(reports)} rounds after a warm-up, {gb:.3f} GB, mixed sizes, median")
    for name, s in rows:
        print(f"  {name:<48} {s * 1e3:9.1f} ms {gb / s:7.2f} GB/s {raw_s / s:6.2f}x of raw")
    result = {"bench": "transfer_cpu", "bytes": nbytes, "tensors": len(state_dict(args.scale)),
              "raw_gbps": gb / raw_s, "engine_round_gbps": gb / round_s, "engine_transfer_gbps": gb / xfer_s,
              "round_over_raw": raw_s / round_s, "target": 0.8, "met": raw_s / round_s >= 0.8,
              "checksum": args.checksum}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
