"""Does the UCCL transport's fence prove delivery? A diagnostic for the 2-GPU machine.

Target process on GPU 1, initiator on GPU 0, the engine's ``UcclTransport`` in UCCL's tcp mode. Each
round writes six tensors (8 B .. 4 MiB) filled with a round-specific byte, fences, and the target then
checks its region at once ("at fence") and again after 0.5 s and a device synchronize. Every entry
"ok" at the fence means the fence waited for the bytes; "BAD" at the fence but "ok" later means the
bytes were still on their way (what a fence that only reads back a target cell gives: docs/TRANSPORTS.md).

    source .gpu/env.sh .whl && python3 bench/diagnostics/uccl_delivery.py
"""
import asyncio
import multiprocessing as mp
import os
import sys
import time

os.environ.setdefault("UCCL_P2P_TRANSPORT", "tcp")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIZES = [8, 88, 524288, 4 << 20, 256, 600000]

def target(q_info, q_go, q_out):
    import torch
    from weightsync.engine.transport import TransportOptions
    from weightsync.engine import dataauth
    from weightsync.engine.transports.uccl import UcclTransport
    async def main():
        t = UcclTransport(TransportOptions(device="cuda:1", uccl_tcp=True))
        info = await t.start(1)
        region = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda:1")
        rinfo = t.register(0, region)
        key = dataauth.new_secret()
        t.guard.authorize({0: key})  # the initiator (rank 0) proves this key on its side channel
        q_info.put((info, rinfo, key))
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, q_go.get)
            if msg is None:
                break
            r, variant = msg
            res = []
            for delay in (0.0, 0.5):
                if delay:
                    time.sleep(delay)  # a second look, later: are late bytes still arriving?
                    torch.cuda.synchronize(1)
                off, row = 0, []
                for i, n in enumerate(SIZES):
                    want = (r * 16 + i) % 251
                    got = region[off:off + n]
                    ok = bool((got == want).all())
                    row.append("ok" if ok else f"BAD(first={int(got[0])},want={want},eq={int((got == want).sum())}/{n})")
                    off += n
                res.append(row)
            q_out.put((r, variant, res))
        await t.close()
    asyncio.run(main())

def initiator(q_info, q_go, q_done):
    import torch
    from weightsync.engine.transport import TransportOptions
    from weightsync.engine.transports.uccl import UcclTransport
    from weightsync.wire import PeerInfo
    async def main():
        info, rinfo, key = q_info.get()
        t = UcclTransport(TransportOptions(device="cuda:0", uccl_tcp=True))
        await t.start(0)
        conn = await t.connect(PeerInfo(1, info, (rinfo,)), key)
        srcs = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for n in SIZES]
        for r, variant in [(1, "plain"), (2, "plain"), (3, "plain"), (4, "sync-each"), (5, "sync-each"), (6, "fresh-src")]:
            if variant == "fresh-src":
                srcs = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for n in SIZES]
            for i, s in enumerate(srcs):
                s.fill_((r * 16 + i) % 251)
            off = 0
            for i, s in enumerate(srcs):
                if variant == "sync-each":
                    torch.cuda.synchronize(0)
                await conn.write(s, 0, off, r)
                off += s.numel()
            await conn.fence()
            q_go.put((r, variant))
            q_done.get()
        q_go.put(None)
        await conn.close()
        await t.close()
    asyncio.run(main())

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_info, q_go, q_out, q_done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    pt = ctx.Process(target=target, args=(q_info, q_go, q_out))
    pi = ctx.Process(target=initiator, args=(q_info, q_go, q_done))
    pt.start()
    pi.start()
    for _ in range(6):
        r, variant, res = q_out.get(timeout=120)
        print(f"round {r} {variant:10s} at fence: {res[0]}\n{'':20s} +0.5s sync: {res[1]}", flush=True)
        q_done.put(1)
    pi.join(60)
    pt.join(60)
