"""CPU transfer benchmark: the engine over loopback TCP against a raw socket, in interleaved pairs.

One sender process -> one receiver process through the public API (Controller, WeightSender,
WeightReceiver; a full round is begin -> writes -> fence -> commit acknowledged, as the controller
times it). Beside them, for the whole run, a raw-socket pair: this process ``sendall`` s the same byte
count from one buffer, a receiver process ``recv_into`` s a preallocated buffer and answers one byte
(the proof an engine fence gives). Each *pair* is one raw round then one engine round, back to back,
so both see the same machine; the figure is the per-pair ratio raw seconds / engine seconds (1.0: the
engine moves the bytes as fast as one socket stream does). Cases:

- ``mix``: 1 x 128 MiB, 12 x 64 MiB, 120 x 1 MiB, 1500 x 64 KiB, 400 x 1 KiB (2,033 tensors, 1.06 GB)
- ``small``: 2,000 x 4 KiB (8.2 MB): the per-tensor cost, with the round's control hops included
- ``one``: a single 4 KiB tensor: the fixed cost of a round (control hops), no target

Targets (docs/TRANSPORTS.md): >= 0.9x raw on the mix, >= 0.5x raw on 2,000 x 4 KiB. ``--json``: the
figures as one JSON object on the last line (paired ratios under keys containing ``ratio``).

    .venv/bin/python bench/transfer_cpu.py [--pairs 7] [--cases mix,small] [--json]
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
WARMUP = 2
CASES = {
    "mix": [(1, 128 * MiB), (12, 64 * MiB), (120, MiB), (1500, 64 * 1024), (400, 1024)],
    "small": [(2000, 4096)],
    "one": [(1, 4096)],
}


def state_dict(case: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for g, (count, nbytes) in enumerate(CASES[case]):
        for i in range(count):
            out[f"g{g}.t{i}"] = torch.randint(0, 255, (nbytes // 4,), generator=gen, dtype=torch.int32).float()
    return out


# --- engine processes --------------------------------------------------------------------------------


def _sender(addr: str, case: str, orders, done) -> None:
    """Pushes version v when told v; says when the push is released."""
    from weightsync.engine.aio import install_uvloop
    from weightsync.roles import WeightSender

    install_uvloop()

    async def main():
        tensors = state_dict(case)
        loop = asyncio.get_running_loop()
        async with WeightSender(addr, tensors, rank=0) as sender:
            while (v := await loop.run_in_executor(None, orders.recv)) > 0:
                tensors["g0.t0"][0] = v  # a new version (the same bytes every round)
                await (await sender.push(v))
                done.send(v)

    asyncio.run(main())


def _receiver(addr: str, case: str, last: int, conn) -> None:
    from weightsync.engine.aio import install_uvloop
    from weightsync.roles import WeightReceiver

    install_uvloop()

    async def main():
        tensors = {k: torch.zeros_like(v) for k, v in state_dict(case).items()}
        async with WeightReceiver(addr, tensors, rank=0) as receiver:
            await receiver.wait_for(last)
            want = state_dict(case)
            want["g0.t0"][0] = last
            conn.send(all(torch.equal(tensors[k], want[k]) for k in want))

    asyncio.run(main())


# --- raw socket --------------------------------------------------------------------------------------


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
        sock.sendall(b"k")
    sock.close()
    srv.close()


class RawSocket:
    """This process sends, a child receives: ``round()`` moves ``nbytes`` once and returns its seconds."""

    def __init__(self, nbytes: int, rounds: int) -> None:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_raw_receiver, args=(writer, nbytes, rounds))
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", reader.recv()))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the engine's sockets
        self.data = memoryview(bytearray(nbytes))

    def round(self) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.data)
        self.sock.recv(1)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(30)


# --- pairs ---------------------------------------------------------------------------------------------


async def pairs(case: str, count: int) -> dict:
    """``count`` measured pairs (after two warm-up pairs: a shadow receiver's two landing slots each
    compile their table once): raw seconds, engine seconds, their ratio."""
    from weightsync.roles import Controller, ControllerOptions

    tensors = state_dict(case)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    total = count + WARMUP
    ctx = mp.get_context("spawn")
    loop = asyncio.get_running_loop()
    raw = RawSocket(nbytes, total)
    # dense rounds of the data path alone: every round's bytes change one value (deltas would be tiny) and no
    # round is checked end to end (bench/transfer_delta.py measures both against these)
    options = ControllerOptions(timeout_s=60.0, delta="off", full_check_every=0)
    async with Controller(senders=1, receivers=1, options=options) as ctl:
        orders_r, orders_w = ctx.Pipe(duplex=False)
        done_r, done_w = ctx.Pipe(duplex=False)
        check_r, check_w = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=_sender, args=(ctl.address, case, orders_r, done_w)),
                 ctx.Process(target=_receiver, args=(ctl.address, case, total, check_w))]
        for p in procs:
            p.start()
        raw_s, engine_s = [], []
        for v in range(1, total + 1):
            raw_s.append(raw.round())
            orders_w.send(v)
            engine_s.append((await asyncio.wait_for(ctl.wait_round(v), 600)).seconds)
            await loop.run_in_executor(None, done_r.recv)
        orders_w.send(0)
        ok = await loop.run_in_executor(None, check_r.recv)
        for p in procs:
            p.join(60)
    raw.close()
    ratios = [r / e for r, e in zip(raw_s[WARMUP:], engine_s[WARMUP:])]
    return {"tensors": len(tensors), "bytes": nbytes, "raw_s": statistics.median(raw_s[WARMUP:]),
            "engine_s": statistics.median(engine_s[WARMUP:]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "bit_exact": ok}


TARGETS = {"mix": 0.9, "small": 0.5, "one": 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="engine vs raw socket over loopback, interleaved pairs")
    ap.add_argument("--pairs", type=int, default=7, help="measured pairs per case (after two warm-up pairs)")
    ap.add_argument("--cases", default="mix,small", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = ap.parse_args(argv)
    from weightsync.engine.aio import install_uvloop

    install_uvloop()
    result = {"bench": "transfer_cpu", "pairs": args.pairs}
    print(f"engine full round vs raw socket, loopback TCP, {args.pairs} pairs after two warm-up pairs, medians")
    print(f"  {'case':<6} {'tensors':>7} {'MB':>8} {'raw ms':>8} {'engine ms':>10} {'ratio':>6} {'range':>12} "
          f"{'target':>6}  bit-exact")
    for case in args.cases.split(","):
        row = asyncio.run(pairs(case, args.pairs))
        row["target"] = TARGETS[case]
        row["met"] = row["ratio"] >= TARGETS[case] and row["bit_exact"]
        result[case] = row
        print(f"  {case:<6} {row['tensors']:>7} {row['bytes'] / 1e6:8.1f} {row['raw_s'] * 1e3:8.1f} "
              f"{row['engine_s'] * 1e3:10.1f} {row['ratio']:6.2f} {row['ratio_min']:5.2f}-{row['ratio_max']:<5.2f} "
              f"{row['target']:6.2f}  {'yes' if row['bit_exact'] else 'NO'}")
    if args.json:
        flat = {"bench": "transfer_cpu", "pairs": args.pairs}
        for case in args.cases.split(","):
            flat.update({f"{case}_{k}": v for k, v in result[case].items()})
        print(json.dumps(flat))
    return 0 if all(result[c]["bit_exact"] for c in args.cases.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
