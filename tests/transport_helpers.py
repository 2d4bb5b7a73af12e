"""Transport pairs for tests: an initiator connected (with a pair key) to a target."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import torch

from weightsync.engine.transport import connect_authorized, create_transport
from weightsync.wire import PeerInfo


@contextlib.asynccontextmanager
async def tcp_pair(nbytes: int = 64):
    """A TCP initiator connected to a target with one registered region of ``nbytes``."""
    src, dst = create_transport("tcp"), create_transport("tcp")
    info = await dst.start(1)
    await src.start(0)
    rinfo = dst.register(0, torch.zeros(nbytes, dtype=torch.uint8))
    conn = await connect_authorized(src, dst, PeerInfo(1, info, (rinfo,)))
    try:
        yield src, dst, conn
    finally:
        await conn.close()
        await src.close()
        await dst.close()


async def connect_while_closing(address: str, close, turns: int, clients: int = 4) -> None:
    """``clients`` connections the kernel completes at ``address`` ("host:port"), then ``close()`` awaited
    ``turns`` loop turns later: returns once each has heard its end (a reset or an end of stream, maybe
    after a challenge); a connection left open and silent fails the 3 s wait."""
    loop = asyncio.get_running_loop()
    host, _, port = address.rpartition(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(clients)]
    try:
        for _ in range(turns):
            await _Turn()
        await close()
        for c in socks:
            c.setblocking(False)
            ended = False
            while not ended:  # (a challenge may come first, then the end)
                try:
                    ended = not await asyncio.wait_for(loop.sock_recv(c, 64), 3.0)
                except ConnectionResetError:
                    ended = True
    finally:
        for c in socks:
            c.close()


class _Turn:
    """One turn of the event loop (a bare ``yield``: the task runs again at the next turn), to place a
    step between the loop's own steps; it waits for nothing."""

    def __await__(self):
        yield
