"""An in-process transport for tests: writes are tensor copies into the peer's registered regions.

How this works: every started ``MemoryTransport`` registers itself in a process-wide directory under
a unique address; ``connect`` looks the peer up there. ``write`` copies bytes with torch and counts
them on the target; ``fence`` checks the counts. ``fail_writes`` lets tests inject a failure.

Late delivery, for tests of delivery proofs: with ``hold`` (an ``asyncio.Event``) set on the sending
transport, a write completes once its bytes are copied aside and lands in the target only after
``hold`` is set, as a one-sided write whose completion precedes delivery. ``seal`` then returns a proof
(the connection's id and its count of issued writes) that the target's ``await_proofs`` waits on;
``fence`` waits for delivery itself.

Addressable targets (as cuda_ipc's): ``address`` gives a CPU region's host address, and
``submit_written`` counts bytes that the sender stored there itself as one delivered write.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from typing import Optional

import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from .. import dataauth
from ..datapath.tensors import byte_view
from ..errors import ConnectionClosed, RegistrationError, StagingError, TransportError
from ..transport import Abilities, EpochCounts, TransportOptions, await_each_proof, wait_after

_DIRECTORY: dict[str, "MemoryTransport"] = {}
_CONNECTIONS: dict[int, "MemoryConnection"] = {}  # id -> open connection (proofs name one)
_NEXT = itertools.count(1)
PROOF = struct.Struct("<4sQQ")  # PROOF_MAGIC, connection id, writes issued on it
PROOF_MAGIC = b"memo"
PROOF_TAG = b"proofs:memory"


class MemoryTransport(EpochCounts):
    kind = "memory"
    proof_magic = PROOF_MAGIC
    devices = frozenset({"cuda"})  # torch copies reach any device in this process

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        self.options = options
        self.address = f"mem-{next(_NEXT)}"
        self.rank = -1
        self.regions: dict[int, torch.Tensor] = {}
        EpochCounts.__init__(self)
        self.fail_writes: Optional[str] = None  # a test sets this to make every write fail
        self.hold: Optional[asyncio.Event] = None  # a test sets this: writes land once it is set
        self.guard = dataauth.DataGuard()

    def __repr__(self) -> str:
        return f"<MemoryTransport {self.address} regions={len(self.regions)}>"

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        _DIRECTORY[self.address] = self
        host = self.options.host()
        return TransportInfo(self.kind, host, self.address, self.options.device, PROOF_TAG)

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        """A CPU region is kept as a tensor of its own over the same memory (``torch.frombuffer``): the
        region stays that memory even if a shadow receiver swaps which tensor owns it."""
        if buffer.device.type == "cpu" and buffer.numel():
            buffer = torch.frombuffer(byte_view(buffer), dtype=torch.uint8)
        self.regions[region_id] = buffer
        return RegionInfo(region_id, buffer.numel(), str(buffer.device), region_id.to_bytes(4, "little"))

    def deregister(self, region_id: int) -> None:
        self.regions.pop(region_id, None)

    @property
    def stable_regions(self) -> bool:
        """CPU regions are their memory (above); a CUDA region is the tensor it was given."""
        return all(r.device.type == "cpu" for r in self.regions.values())

    async def connect(self, peer: PeerInfo, key: bytes = b"") -> "MemoryConnection":
        name = f"receiver/{peer.rank}"
        target = _DIRECTORY.get(peer.transport.address)
        if target is None:
            raise TransportError(f"no memory transport at {peer.transport.address}", peer=name)
        nonce = dataauth.new_nonce()  # the same challenge as over a socket, answered in-process
        proof = dataauth.prove(key, nonce, self.rank) if key else bytes(dataauth.PROOF_BYTES)
        if target.guard.admit(self.rank, nonce, proof, f"memory:{self.address}") is None:
            raise ConnectionClosed("the target refused the connection (not authenticated)", peer=name)
        return MemoryConnection(self, target, name, peer.transport.data == PROOF_TAG, key)

    async def settle(self) -> None:
        return None

    async def await_proofs(self, proofs: dict[int, bytes], timeout_s: float) -> dict[int, str]:
        return await await_each_proof(proofs, timeout_s, _landed)

    async def close(self) -> None:
        _DIRECTORY.pop(self.address, None)


def _landed(proof: bytes):
    """The wait for a memory proof: until its connection has delivered the writes it counts."""
    magic, conn_id, issued = PROOF.unpack(proof)
    if magic != PROOF_MAGIC:
        raise KeyError(f"not a memory proof (magic {magic!r})")
    return _CONNECTIONS[conn_id].landed(issued)


class MemoryConnection:
    # compiled rows read CPU memory in place, pitched ones as they lie (as cuda_ipc does); batches of 8 rows
    # (as cuda_ipc batches, so tests drive that path)
    abilities = Abilities(devices=frozenset({"cpu", "cuda"}), compiles=True, direct_devices=frozenset({"cpu"}),
                          pitched_rows=True, submits=True, batch=8, seals=True, writes_in_place=True)
    generation = 0  # bumped by ``reregistered`` (tests of recompiling)

    def __init__(self, local: MemoryTransport, target: MemoryTransport, peer: str, proofs: bool = False,
                 key: bytes = b"") -> None:
        self.local, self.target, self.peer = local, target, peer
        self.key = key
        self.proofs = proofs
        self.id = next(_NEXT)
        self.sent_count = 0
        self.sent_bytes = 0
        self.delivered = 0  # writes landed in the target, in issue order
        self.closed = False
        self._landed = asyncio.Condition()
        _CONNECTIONS[self.id] = self

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        await self.submit(src, dst_region, dst_offset, epoch, after)

    def submit(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
               after: Optional[torch.cuda.Event] = None) -> asyncio.Future:
        """Check and count the write now (a seal covers it from here); copy in a task."""
        self._check_writable()
        region = self._target(src, dst_region, dst_offset)
        self.sent_count += 1
        self.sent_bytes += src.numel() * src.element_size()
        return asyncio.ensure_future(self._copy(src, region, dst_offset, epoch, after))

    def submit_many(self, rows, epoch: int) -> list[asyncio.Future]:
        """``submit`` for many rows (source, region, offset, after), as cuda_ipc's: every row checked
        before any is counted, then copied in order by one task whose future stands for them all."""
        self._check_writable()
        targets = [self._target(src, region, offset) for src, region, offset, _ in rows]
        self.sent_count += len(rows)
        self.sent_bytes += sum(src.numel() * src.element_size() for src, *_ in rows)
        done = asyncio.ensure_future(self._copy_all([(src, target, offset, after) for (src, _, offset, after), target
                                                     in zip(rows, targets)], epoch))
        return [done] * len(rows)

    def compile(self, rows) -> list:
        """A plan's direct rows (``weightsync.engine.datapath.compiled``) as (source, region, offset, None), checked once."""
        out = []
        for row in rows:
            region = self.target.regions.get(row.region)
            if region is None or row.offset + row.nbytes > region.numel():
                where = "no such region" if region is None else f"region of {region.numel()} bytes"
                raise StagingError(row.name, f"{row.nbytes} bytes at region {row.region}+{row.offset} do not fit "
                                             f"the target ({where}, {self.peer})")
            out.append((row.src, region, row.offset, None))
        return out

    def replay(self, table: list, epoch: int) -> list[asyncio.Future]:
        """Count a compiled table's rows now (a seal covers them from here); copy them in order in a task."""
        self._check_writable()
        self.sent_count += len(table)
        self.sent_bytes += sum(src.numel() * src.element_size() for src, *_ in table)
        return [asyncio.ensure_future(self._copy_all(table, epoch))]

    def reregistered(self) -> None:
        """The target's regions changed (a test stands for a new plan): compiled tables are stale."""
        self.generation += 1

    async def _copy_all(self, rows: list, epoch: int) -> None:
        for src, region, offset, after in rows:
            await self._copy(src, region, offset, epoch, after)

    def _target(self, src: torch.Tensor, dst_region: int, dst_offset: int) -> torch.Tensor:
        """The target's region a write of ``src`` at region+offset goes to; raises where it does not fit."""
        region = self.target.regions.get(dst_region)
        n = src.numel() * src.element_size()
        if region is None or dst_offset + n > region.numel():
            raise RegistrationError(f"write of {n} bytes at region {dst_region}+{dst_offset} is out of bounds",
                                    peer=self.peer)
        return region

    def _check_writable(self) -> None:
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        if self.local.fail_writes:
            raise TransportError(self.local.fail_writes, peer=self.peer)

    def address(self, dst_region: int, dst_offset: int, nbytes: int, device: torch.device) -> Optional[int]:
        """The host address of a CPU region's bytes, for work on the CPU; None otherwise."""
        region = self.target.regions.get(dst_region)
        if self.closed or region is None or region.device.type != "cpu" or device.type != "cpu":
            return None
        return region.data_ptr() + dst_offset if dst_offset + nbytes <= region.numel() else None

    def submit_written(self, device: torch.device, dst_region: int, dst_offset: int, nbytes: int, epoch: int,
                       after: Optional[torch.cuda.Event], count: int = 1) -> asyncio.Future:
        """Bytes the sender stored at ``address(...)``: counted on both sides as ``count`` writes."""
        self._check_writable()
        self.sent_count += count
        self.sent_bytes += nbytes
        return asyncio.ensure_future(self._count_written(nbytes, epoch, after, count))

    async def _count_written(self, nbytes: int, epoch: int, after: Optional[torch.cuda.Event], count: int) -> None:
        await wait_after(after)
        await self._land(None, 0, nbytes, epoch, count)

    async def _copy(self, src: torch.Tensor, region: torch.Tensor, offset: int, epoch: int,
                    after: Optional[torch.cuda.Event]) -> None:
        await wait_after(after)
        data = src.reshape(-1).view(torch.uint8)
        if self.local.hold is not None:  # completes now, lands later
            asyncio.ensure_future(self._land_later(self.local.hold, region, offset, data.clone(), epoch))
        else:
            await self._land(region, offset, data, epoch)
        await asyncio.sleep(0)  # a real transport yields here; so does this one

    async def _land_later(self, hold: asyncio.Event, region: torch.Tensor, offset: int, data: torch.Tensor,
                          epoch: int) -> None:
        await hold.wait()
        await self._land(region, offset, data, epoch)

    async def _land(self, region: Optional[torch.Tensor], offset: int, data, epoch: int, count: int = 1) -> None:
        """``data``: bytes to put at ``region[offset:]``, or (no region) the count of bytes already there
        (in ``count`` writes)."""
        if epoch > self.target.closed_epoch:  # a late write of a closed round is dropped, as TCP's agent does
            nbytes = data if region is None else data.numel()
            c = self.target.count(self.local.rank, epoch)
            region_id = next((i for i, r in self.target.regions.items() if r is region), None)
            problem = self.target.guard.write_problem(self.local.rank, self.key, region_id) if region_id is not None \
                else None
            if problem is not None:  # refused as TCP's agent refuses: reported at the fence, never applied
                self.target.guard.refuse(f"memory:{self.local.address}", f"write to region {region_id}: {problem}")
                c.errors.append(f"refused: {problem}")
            elif region is not None and nbytes:
                region[offset:offset + nbytes].copy_(data)
            c.count += count
            c.nbytes += nbytes
        async with self._landed:
            self.delivered += count
            self._landed.notify_all()

    async def landed(self, issued: int) -> None:
        """Until the first ``issued`` writes of this connection are in the target."""
        async with self._landed:
            await self._landed.wait_for(lambda: self.delivered >= issued)

    def seal(self) -> Optional[bytes]:
        return PROOF.pack(PROOF_MAGIC, self.id, self.sent_count) if self.proofs and not self.closed else None

    async def fence(self) -> None:
        if self.closed:
            raise ConnectionClosed("fence on a closed connection", peer=self.peer)
        await self.landed(self.sent_count)

    async def close(self) -> None:
        self.closed = True
        _CONNECTIONS.pop(self.id, None)
