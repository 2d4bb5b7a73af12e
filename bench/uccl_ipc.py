"""The UCCL ``write_ipc`` baseline row: GPU 0 -> GPU 1 through UCCL P2P's same-host IPC path.

Two processes (initiator on GPU 0, target on GPU 1). The target builds an endpoint, accepts a local
connection and advertises its buffers; the initiator writes them with one ``write_ipc`` each. uccl
0.1.1 corrupts writes into sub-buffers of one allocation (../shared/notes/uccl-0.1.1.md), so every
chunk is its own allocation (1 GiB each; sizes are 32-bit on some UCCL paths). The uccl API differs
between releases; the calls that differ are tried in both known forms and the error is reported, not
raised, so that the other rows of the benchmark still print.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback

import torch

CHUNK = 1 << 30


def _endpoint(p2p, gpu: int):
    try:
        return p2p.Endpoint(gpu, 4)
    except TypeError:
        return p2p.Endpoint(gpu)


def _chunks(nbytes: int) -> list[int]:
    sizes = [CHUNK] * (nbytes // CHUNK)
    if nbytes % CHUNK:
        sizes.append(nbytes % CHUNK)
    return sizes


def _target(nbytes: int, conn) -> None:
    try:
        from uccl import p2p

        torch.cuda.set_device(1)
        ep = _endpoint(p2p, 1)
        meta = ep.get_metadata()
        conn.send(("meta", meta, p2p.Endpoint.parse_metadata(meta)))
        accepted = ep.accept_local()
        if not accepted[0]:
            raise RuntimeError(f"accept_local failed: {accepted}")
        cid = accepted[-1]
        bufs = [torch.zeros(n, dtype=torch.uint8, device="cuda:1") for n in _chunks(nbytes)]
        blobs = []
        for b in bufs:
            ok, blob = ep.advertise_ipc(cid, b.data_ptr(), b.numel())
            if not ok:
                raise RuntimeError("advertise_ipc failed")
            blobs.append(bytes(blob))
        conn.send(("blobs", blobs))
        msg = conn.recv()  # ("check", seed) after the initiator's last round
        gen = torch.Generator(device="cuda:1").manual_seed(msg[1])
        ok = all(torch.equal(b, torch.randint(0, 256, (b.numel(),), generator=gen, dtype=torch.uint8, device="cuda:1"))
                 for b in bufs)
        conn.send(("checked", ok))
    except BaseException:
        conn.send(("error", traceback.format_exc()[-1500:]))


def _connect(ep, meta_parsed):
    """connect_local takes the remote GPU index in newer uccl, its PCI bus id in 0.1.1."""
    errors = []
    for arg in (1, str(meta_parsed[-1])):
        try:
            out = ep.connect_local(arg)
        except TypeError as exc:
            errors.append(repr(exc))
            continue
        if out[0]:
            return out[-1]
        errors.append(f"connect_local({arg!r}) -> {out}")
    raise RuntimeError("; ".join(errors))


def _expect(conn, kind: str) -> tuple:
    if not conn.poll(90):
        raise RuntimeError(f"target sent no {kind!r} within 90 s")
    msg = conn.recv()
    if msg[0] != kind:
        raise RuntimeError(f"target: {msg}")
    return msg


def _initiator(nbytes: int, rounds: int, conn, result) -> None:
    try:
        from uccl import p2p

        torch.cuda.set_device(0)
        ep = _endpoint(p2p, 0)
        _, _, parsed = _expect(conn, "meta")
        cid_box: list = []
        t = threading.Thread(target=lambda: cid_box.append(_connect(ep, parsed)))
        t.start()
        t.join(60)
        if not cid_box:
            raise RuntimeError("connect_local did not complete")
        cid = cid_box[0]
        _, blobs = _expect(conn, "blobs")
        gen = torch.Generator(device="cuda:0").manual_seed(5)
        srcs = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8, device="cuda:0") for n in _chunks(nbytes)]
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for src, blob in zip(srcs, blobs):
                if not ep.write_ipc(cid, src.data_ptr(), src.numel(), blob):
                    raise RuntimeError("write_ipc failed")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        conn.send(("check", 5))
        result.send(("ok", times[1:], _expect(conn, "checked")[1]))
    except BaseException:
        result.send(("error", traceback.format_exc()[-1500:]))


def write_ipc_seconds(nbytes: int, rounds: int) -> dict:
    """{"seconds": [per round], "ok": bit-exact} or {"error": text}."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    r_in, r_out = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_target, args=(nbytes, b)), ctx.Process(target=_initiator, args=(nbytes, rounds, a, r_out))]
    for p in procs:
        p.start()
    try:
        if not r_in.poll(150):
            return {"error": "no result within 150 s"}
        msg = r_in.recv()
        if msg[0] == "error":
            return {"error": msg[1]}
        return {"seconds": msg[1], "ok": msg[2]}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
