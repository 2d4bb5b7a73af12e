"""An in-process transport for tests: writes are tensor copies into the peer's registered regions.

How this works: every started ``MemoryTransport`` registers itself in a process-wide directory under
a unique address; ``connect`` looks the peer up there. ``write`` copies bytes with torch and counts
them on the target; ``fence`` checks the counts. ``fail_writes`` lets tests inject a failure.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Optional

import torch

from wire import PeerInfo, RegionInfo, TransportInfo

from ..errors import ConnectionClosed, RegistrationError, TransportError
from ..transport import SourceCounters, TransportOptions, wait_after

_DIRECTORY: dict[str, "MemoryTransport"] = {}
_NEXT = itertools.count(1)


class MemoryTransport:
    kind = "memory"
    devices = frozenset({"cuda"})  # torch copies reach any device in this process

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        self.options = options
        self.address = f"mem-{next(_NEXT)}"
        self.rank = -1
        self.regions: dict[int, torch.Tensor] = {}
        self._counters: dict[tuple[int, int], SourceCounters] = {}
        self.closed_epoch = -1
        self.fail_writes: Optional[str] = None  # a test sets this to make every write fail

    def __repr__(self) -> str:
        return f"<MemoryTransport {self.address} regions={len(self.regions)}>"

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        _DIRECTORY[self.address] = self
        host = self.options.host_id or socket.gethostname()
        return TransportInfo(self.kind, host, self.address, self.options.device, b"")

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        self.regions[region_id] = buffer
        return RegionInfo(region_id, buffer.numel(), str(buffer.device), region_id.to_bytes(4, "little"))

    def deregister(self, region_id: int) -> None:
        self.regions.pop(region_id, None)

    async def connect(self, peer: PeerInfo) -> "MemoryConnection":
        target = _DIRECTORY.get(peer.transport.address)
        if target is None:
            raise TransportError(f"no memory transport at {peer.transport.address}", peer=f"receiver/{peer.rank}")
        return MemoryConnection(self, target, f"receiver/{peer.rank}")

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        return {src: c for (src, e), c in self._counters.items() if e == epoch}

    def close_epoch(self, epoch: int) -> None:
        self.closed_epoch = max(self.closed_epoch, epoch)
        self._counters = {k: c for k, c in self._counters.items() if k[1] > self.closed_epoch}

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        _DIRECTORY.pop(self.address, None)


class MemoryConnection:
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, local: MemoryTransport, target: MemoryTransport, peer: str) -> None:
        self.local, self.target, self.peer = local, target, peer
        self.sent_count = 0
        self.sent_bytes = 0
        self.closed = False

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        await wait_after(after)
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        if self.local.fail_writes:
            raise TransportError(self.local.fail_writes, peer=self.peer)
        region = self.target.regions.get(dst_region)
        n = src.numel() * src.element_size()
        if region is None or dst_offset + n > region.numel():
            raise RegistrationError(f"write of {n} bytes at region {dst_region}+{dst_offset} is out of bounds",
                                    peer=self.peer)
        self.sent_count += 1
        self.sent_bytes += n
        if epoch <= self.target.closed_epoch:
            return  # a late write of a closed round: dropped, as the TCP agent does
        if n:
            region[dst_offset:dst_offset + n].copy_(src.reshape(-1).view(torch.uint8))
        c = self.target._counters.setdefault((self.local.rank, epoch), SourceCounters())
        c.count += 1
        c.nbytes += n
        await asyncio.sleep(0)  # a real transport yields here; so does this one

    async def fence(self) -> None:
        if self.closed:
            raise ConnectionClosed("fence on a closed connection", peer=self.peer)

    async def close(self) -> None:
        self.closed = True
