"""Same-host GPU transport: one-sided writes straight into the receiver's registered CUDA memory.

How this works. Target: ``register`` shares the whole caching-allocator block behind a buffer
(``storage._share_cuda_()``: the block's IPC handle and the buffer's offset in it); the descriptor
carries that handle, offset, size, device, owner pid and raw pointer. Initiator: ``connect`` opens each
peer handle once per local device, in the *sender's* device context, with peer access enabled, and
caches the mapping (a block shared by several regions is opened once). The first ``write`` of a round
orders the copy streams after the producer's stream; each write queues a pointer-to-pointer
``cudaMemcpyAsync`` (``submit_many``: many rows in one ``cudaMemcpyBatchAsync``, one completion for them)
on a copy stream of the sender's device (the copy engine pushes over NVLink/PCIe; the same GPU is a
local device copy; each connection has a pair of its own, ``cuda_ipc_streams``, so the copies to a colocated
receiver and to one on another GPU run at once, not one queued behind the other), behind the source's
transform event if it has one (``stream.wait_event``: no host round trip), and waits for its CUDA event, which one poller task
per connection queries from the event loop, oldest first (``cuda_rt.EventPoller``). So ``fence`` has
nothing left to wait for: a completed copy is in the target's memory. In the owner's own process the raw pointer is used.
Writes are not observable by the target (``counters`` is empty); senders report them instead. A plan's direct rows
are compiled once into a few launches per link (``cuda_ipc_tables``: copy kernels, batch and 2-D copies,
or the faster of a kernel and the copy engines into another GPU) and replayed every round.

Addressable targets. ``address`` gives the mapped address of a target byte range as the sender's device
sees it (peer access on), so a kernel on the sender can store there itself (the FP8 quantization writes
its outputs into the receiver's tensors); ``submit_written`` then accounts for such bytes: a stream of
their own waits for the kernel's event (not a copy stream: later copies must not queue behind the
kernels), a seal covers that stream too, and its completion is polled like a copy's.

Delivery proofs. A target advertises ``PROOF_TAG``; a connection to it can ``seal`` a round as soon as
its last copy is *queued*: the first copy stream of its lane waits for the other and for the kernels'
stream, and an interprocess CUDA event (one per sender device and lane, re-recorded by each seal) is
recorded behind them; the proof is (pid, device, event handle). The target opens the handle once (``await_proofs``) and polls the event: when it has
happened, every copy queued before the seal is in its memory. The record precedes the message that
carries the proof, so the target never sees an older record of the event.
"""

from __future__ import annotations

import asyncio
import math
import os
import struct
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from .. import dataauth
from ..cuda import cuda_rt
from ..cuda.fastest import Trials
from ..errors import ConnectionClosed, RegistrationError, StagingError, TransportError, TransportUnavailable
from ..transport import Abilities, SourceCounters, TransportOptions, await_each_proof
from .cuda_ipc_streams import _OWN_EVENTS, PROOF, PROOF_MAGIC, CopyStreams
from .cuda_ipc_tables import IpcTable, compile_table

if TYPE_CHECKING:
    from ..datapath.compiled import CopyRow

DESCRIPTOR = struct.Struct("<II64sQQQ")  # pid, device, handle, offset in block, size, raw pointer
PROOF_TAG = b"proofs:ipc_event"  # in a target's TransportInfo.data: it checks delivery proofs
Row = tuple[torch.Tensor, int, int, Optional[torch.cuda.Event]]  # source, region, offset, after (``submit_many``)


class CudaIpcTransport:
    kind = "cuda_ipc"
    stable_regions = True  # a region is the memory block its descriptor names (``transport.Transport``)
    proof_magic = PROOF_MAGIC
    devices = frozenset({"cuda"})

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailable("transport 'cuda_ipc' needs CUDA, and torch.cuda.is_available() is False")
        self.options = options
        self.rank = -1
        self.regions: dict[int, torch.Tensor] = {}
        self.mappings: dict[tuple[bytes, int], int] = {}  # (block handle, local device) -> base pointer
        self.copies = CopyStreams()  # the connections' copy streams and proof events, per device and lane
        self.live: set = set()  # open connections (whose targets' devices bound the copy kernels' grids)
        self.opened_events: dict[bytes, torch.cuda.Event] = {}  # target side: senders' proof events
        self.spin_s = math.inf if options.busy_poll else cuda_rt.SPIN_S  # completion and proof polling
        self.guard = dataauth.DataGuard()  # kept for the contract: IPC writes are one-sided (engine.dataauth)
        self.choices: dict[str, Trials] = {}  # link -> how its ways into another GPU fare (``peer_copies``)

    def __repr__(self) -> str:
        chosen = {link: trials.chosen for link, trials in self.choices.items()}
        return f"<CudaIpcTransport regions={len(self.regions)} mappings={len(self.mappings)} peer_copies={chosen}>"

    def trials_of(self, link: str) -> Trials:
        """The timings of the ways a link's rows go into another GPU, shared by the tables of the same
        rows (``engine.cuda.fastest``)."""
        return self.choices.setdefault(link, Trials(("kernel", "dma")))

    @property
    def trying(self) -> set[str]:
        """Links whose ways into another GPU are still being timed."""
        return {link for link, trials in self.choices.items() if trials.chosen is None}

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        host = self.options.host()
        device = self.options.device if self.options.device != "cpu" else f"cuda:{torch.cuda.current_device()}"
        return TransportInfo(self.kind, host, f"{host}/pid{os.getpid()}", device, PROOF_TAG)

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        if buffer.device.type != "cuda":
            raise RegistrationError(f"region {region_id}: cuda_ipc registers CUDA memory, got {buffer.device}")
        share = buffer.untyped_storage()._share_cuda_()
        device, handle, _, block_offset = share[0], share[1], share[2], share[3]
        nbytes = buffer.numel() * buffer.element_size()
        offset = block_offset + buffer.storage_offset() * buffer.element_size()
        self.regions[region_id] = buffer
        raw = cuda_rt.raw_ipc_handle(bytes(handle))
        desc = DESCRIPTOR.pack(os.getpid(), device, raw, offset, nbytes, buffer.data_ptr())
        return RegionInfo(region_id, nbytes, str(buffer.device), desc)

    def deregister(self, region_id: int) -> None:
        self.regions.pop(region_id, None)

    async def connect(self, peer: PeerInfo, key: bytes = b"") -> "CudaIpcConnection":
        """One-sided: the descriptors are the capability (the controller hands them only to the senders a
        plan names); ``key`` is not checked here."""
        regions = {}
        for info in peer.regions:
            try:
                regions[info.region_id] = DESCRIPTOR.unpack(info.descriptor)
            except struct.error as exc:
                raise TransportError(f"region {info.region_id}: not a cuda_ipc descriptor", peer=f"receiver/{peer.rank}") from exc
        return CudaIpcConnection(self, regions, f"receiver/{peer.rank}", peer.transport.data == PROOF_TAG)

    def base_pointer(self, desc: tuple, local_device: int) -> int:
        pid, device, handle, offset, _, raw = desc
        cuda_rt.enable_peer_access(local_device, device)  # else the copy is staged through the host
        if pid == os.getpid():
            return raw - offset  # our own memory: no IPC mapping (CUDA refuses to open it here)
        key = (handle, local_device)
        base = self.mappings.get(key)
        if base is None:
            base = self.mappings[key] = cuda_rt.open_ipc_handle(handle, local_device)
        return base

    async def await_proofs(self, proofs: dict[int, bytes], timeout_s: float) -> dict[int, str]:
        """Target side: wait for each sender's proof event; sender rank -> why it is not confirmed."""
        return await await_each_proof(proofs, timeout_s,
                                      lambda proof: cuda_rt.wait_event(self._proof_event(proof), self.spin_s))

    def _proof_event(self, proof: bytes) -> torch.cuda.Event:
        magic, pid, _, handle = PROOF.unpack(proof)
        if magic != PROOF_MAGIC:
            raise KeyError(f"not a cuda_ipc proof (magic {magic!r})")
        if pid == os.getpid():
            return _OWN_EVENTS[handle]
        event = self.opened_events.get(handle)
        if event is None:
            device = torch.device(self.options.device if self.options.device != "cpu" else "cuda")
            event = self.opened_events[handle] = torch.cuda.Event.from_ipc_handle(device, handle)
        return event

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        return {}

    def strays(self, epoch: int) -> dict[int, list[int]]:
        return {}  # (one-sided: writes are not observed here; checksums check the content)

    def forget_strays(self, epoch: int) -> None:
        return None

    def close_epoch(self, epoch: int) -> None:
        return None

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        for (handle, device), base in list(self.mappings.items()):
            try:
                cuda_rt.close_ipc_handle(base, device)
            except TransportError:
                pass
        self.mappings.clear()
        self.opened_events.clear()
        self.copies.close()


class CudaIpcConnection:
    # depth: zero-copy and cheap to complete, so queue deep; batch: rows per batch of copies (docs/TRANSPORTS.md);
    # compiled rows read CUDA memory in place, pitched sources included (on the same GPU one kernel launch
    # for all of them, to another GPU a cudaMemcpy2DAsync each)
    abilities = Abilities(devices=frozenset({"cpu", "cuda"}), depth=64, compiles=True,
                          direct_devices=frozenset({"cuda"}), pitched_rows=True, submits=True, batch=16,
                          seals=True, writes_in_place=True)
    generation = 0  # the target's regions are fixed for the connection's life (a new plan connects anew)
    chunk_rows = 256  # rows per batch call of a compiled replay to another GPU (bench/diagnostics/copy_batches.py)

    def __init__(self, owner: CudaIpcTransport, regions: dict[int, tuple], peer: str, proofs: bool = False) -> None:
        self.owner = owner
        self.regions = regions
        self.peer = peer
        self.proofs = proofs  # the target checks delivery proofs (it advertised PROOF_TAG)
        self._unsealed: set[int] = set()  # devices with copies queued since the last seal
        self.sent_count = 0
        self.sent_bytes = 0
        self.closed = False
        self._issued = 0
        self.lane = owner.copies.new_lane()
        self.targets = frozenset(desc[1] for desc in regions.values())  # the target's devices
        owner.live.add(self)
        self._ordered: dict[int, int] = {}  # device -> the round (epoch) whose producer work we are after
        self._bases: dict[tuple[int, int], int] = {}  # (region, local device) -> mapped address of its byte 0
        self._events: dict[int, list[torch.cuda.Event]] = {}  # device -> its completion events seen complete
        self._event_device: dict[int, int] = {}  # id(completion event) -> the device it belongs to
        self._waited: dict[int, object] = {}  # id(copy stream) -> the last transform event it was made to wait for
        self.completions = cuda_rt.EventPoller(self._recycle, owner.spin_s)

    def __repr__(self) -> str:
        return f"<CudaIpcConnection to {self.peer} sent={self.sent_count}/{self.sent_bytes} bytes>"

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        await self.submit(src, dst_region, dst_offset, epoch, after)

    def submit(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
               after: Optional[torch.cuda.Event] = None) -> asyncio.Future:
        """``write`` in two halves: queue the copy now, return a future that completes with it (the
        pipeline drives many writes this way without a task each)."""
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        desc, nbytes = self._bounds(src, dst_region, dst_offset)
        self.sent_count += 1
        self.sent_bytes += nbytes
        if not nbytes:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        device = src.device.index if src.device.type == "cuda" else desc[1]
        dst = self._base(dst_region, desc, device) + dst_offset
        if src.device.type == "cuda":
            self._after_producer(device, epoch)
        stream = self.owner.copies.stream(device, self.lane, self._issued)
        self._issued += 1
        self._unsealed.add(device)
        self._wait_for(stream, after)
        cuda_rt.memcpy_async(dst, src.data_ptr(), nbytes, stream)
        return self._completion(device, stream)

    def submit_many(self, rows: Sequence[Row], epoch: int) -> list[asyncio.Future]:
        """``submit`` for many rows at once, a future per row: rows of one GPU's memory go as one batch
        of copies (``cuda_rt.memcpy_batch_async``) on one copy stream, behind each row's ``after``, with
        one completion for all of them; anything else (host sources, a mix of devices) row by row.
        Every row is checked before any is queued: a bad one queues none."""
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        checked = [self._bounds(src, region, offset) for src, region, offset, _ in rows]
        devices = {src.device.index if src.device.type == "cuda" else None for src, *_ in rows}
        if len(rows) < 2 or len(devices) != 1 or None in devices:
            return [self.submit(src, region, offset, epoch, after) for src, region, offset, after in rows]
        device = devices.pop()
        self._after_producer(device, epoch)
        stream = self.owner.copies.stream(device, self.lane, self._issued)
        self._issued += 1
        self._unsealed.add(device)
        for *_, after in rows:
            self._wait_for(stream, after)
        copies = [(self._base(region, desc, device) + offset, src.data_ptr(), nbytes)
                  for (src, region, offset, _), (desc, nbytes) in zip(rows, checked) if nbytes]
        cuda_rt.memcpy_batch_async(copies, stream, device, checked[0][0][1])
        self.sent_count += len(rows)
        self.sent_bytes += sum(nbytes for _, nbytes in checked)
        return [self._completion(device, stream)] * len(rows)

    def compile(self, rows: Sequence[CopyRow]) -> IpcTable:
        """A plan's direct rows (``weightsync.engine.datapath.compiled``) as launches made once
        (``cuda_ipc_tables``); a row that does not fit its region raises ``StagingError`` naming the
        parameter."""
        placed = []
        for row in rows:
            desc = self.regions.get(row.region)
            if desc is None or row.offset + row.nbytes > desc[4]:
                where = "no such region" if desc is None else f"region of {desc[4]} bytes"
                raise StagingError(row.name, f"{row.nbytes} bytes at region {row.region}+{row.offset} do not fit "
                                             f"the target ({where}, {self.peer})")
            device = row.src.device.index
            placed.append((row, device, desc[1], self._base(row.region, desc, device) + row.offset))
        return compile_table(placed, self.owner, self.chunk_rows)

    def replay(self, table: IpcTable, epoch: int) -> list[asyncio.Future]:
        """Queue a compiled table's launches on the copy streams, in turn; a completion per launch."""
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        done = []
        for device, launch in table.launches:
            self._after_producer(device, epoch)
            stream = self.owner.copies.stream(device, self.lane, self._issued)
            self._issued += 1
            self._unsealed.add(device)
            launch.launch(stream)
            done.append(self._completion(device, stream))
        self.sent_count += table.count
        self.sent_bytes += table.nbytes
        return done

    def _bounds(self, src: torch.Tensor, dst_region: int, dst_offset: int) -> tuple[tuple, int]:
        """(the target region's descriptor, byte count) of a write of ``src`` at region+offset; raises
        ``RegistrationError`` where it does not fit."""
        desc = self.regions.get(dst_region)
        nbytes = src.numel() * src.element_size()
        if desc is None or dst_offset + nbytes > desc[4]:
            size = "missing" if desc is None else f"{desc[4]} bytes"
            raise RegistrationError(f"write of {nbytes} bytes at region {dst_region}+{dst_offset} is out of bounds "
                                    f"(region {size})", peer=self.peer)
        return desc, nbytes

    def _after_producer(self, device: int, epoch: int) -> None:
        """Copy streams follow the producer's stream, once per round: the weights are final by then."""
        if self._ordered.get(device) != epoch:
            self.owner.copies.order_after_producer(device, self.lane)
            self._ordered[device] = epoch

    def address(self, dst_region: int, dst_offset: int, nbytes: int, device: torch.device) -> Optional[int]:
        """Where ``nbytes`` at ``dst_offset`` of the target's region are, for work on ``device`` (a CUDA
        device with peer access to the target's); None where they cannot be reached or are out of bounds."""
        desc = self.regions.get(dst_region)
        if self.closed or desc is None or device.type != "cuda" or dst_offset + nbytes > desc[4]:
            return None
        index = cuda_rt.device_index(device)
        if not cuda_rt.enable_peer_access(index, desc[1]):
            return None
        return self._base(dst_region, desc, index) + dst_offset

    def submit_written(self, device: torch.device, dst_region: int, dst_offset: int, nbytes: int, epoch: int,
                       after: Optional[torch.cuda.Event], count: int = 1) -> asyncio.Future:
        """Bytes that device work (marked complete by ``after``) stored at ``address(...)``: counted and
        sealed as ``count`` writes; the future completes once that work has."""
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        self.sent_count += count
        self.sent_bytes += nbytes
        index = cuda_rt.device_index(device)
        stream = self.owner.copies.stream(index, self.lane, -1)
        self._unsealed.add(index)
        self._wait_for(stream, after)
        return self._completion(index, stream)

    def _wait_for(self, stream: torch.cuda.Stream, after: Optional[torch.cuda.Event]) -> None:
        """``stream`` waits on the device for ``after`` (a transform's or kernel's event), once per event
        per stream (a group's rows share one)."""
        if after is not None and self._waited.get(id(stream)) is not after:
            stream.wait_event(after)
            self._waited[id(stream)] = after

    def _completion(self, device: int, stream: torch.cuda.Stream) -> asyncio.Future:
        """A future for the work queued so far on ``stream`` (an event of ``device``: events are bound to
        the device they were first recorded on, so the pool keeps them per device)."""
        pool = self._events.get(device)
        if pool:
            done = pool.pop()
        else:
            done = torch.cuda.Event()
            self._event_device[id(done)] = device  # (pooled events live as long as the connection)
        done.record(stream)
        return self.completions.wait(done)

    def _recycle(self, event: torch.cuda.Event) -> None:
        self._events.setdefault(self._event_device[id(event)], []).append(event)

    def _base(self, region: int, desc: tuple, device: int) -> int:
        base = self._bases.get((region, device))
        if base is None:
            base = self._bases[(region, device)] = self.owner.base_pointer(desc, device) + desc[3]
        return base

    def seal(self) -> Optional[bytes]:
        """A delivery proof for every copy queued so far (before they complete), or ``None`` where the
        target does not check proofs or the copies span several devices (one event cannot cover them)."""
        devices, self._unsealed = self._unsealed, set()
        if self.closed or not self.proofs or len(devices) != 1:
            return None
        return self.owner.copies.seal(devices.pop(), self.lane)

    async def fence(self) -> None:
        if self.closed:
            raise ConnectionClosed("fence on a closed connection", peer=self.peer)
        # every write awaited its own completion event: all of it is in the target's memory already

    async def close(self) -> None:
        self.closed = True
        self.owner.live.discard(self)
        self.completions.cancel()
