"""Transport pairs for tests: an initiator connected (with a pair key) to a target."""

from __future__ import annotations

import contextlib

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
