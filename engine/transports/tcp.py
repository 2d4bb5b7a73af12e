"""The TCP transport: real sockets, pure asyncio, zero-copy on both ends.

How this works. Target side: an asyncio server whose per-connection ``_AgentProtocol`` is a
``BufferedProtocol`` state machine. For a WRITE it hands the event loop a memoryview of the
destination region at (region, offset) as the receive buffer, so the kernel copies straight from the
socket into tensor memory (``recv_into``). A write that is out of bounds is drained into a scratch
buffer and recorded as an error, never applied. For a FENCE it answers with the cumulative count and
bytes it has landed from that connection, and any errors.

Initiator side: ``TcpConnection.write`` sends a 21-byte header and the payload with ``sendmsg``
straight from the tensor's memory (no copy), waiting for writability when the socket is full; it
completes when the kernel has taken every byte (the source may then be reused). Writes on one
connection are serialised by a FIFO lock; several connections progress at once. A frame that has
started is always finished, even when its writer is cancelled (half a frame would desynchronise the
stream). ``fence`` sends a
FENCE, awaits the matching ACK and compares the target's counts with ours.

Authentication (``weightsync.engine.dataauth``): on accept the target sends CHALLENGE (a 16-byte nonce); the
initiator answers HELLO followed by a 32-byte proof of its pair key. Until a HELLO verifies, any other
frame closes the connection; a refused HELLO is counted, logged with the peer's address, and closes
it. Every WRITE is checked against the guard (the sender still named by the current plan, the region
open), else drained and reported at the fence, never applied.

Frame (little-endian): op u8, a u32, b u64, c u64, epoch u64. CHALLENGE (target -> initiator): b, c =
the nonce's two halves. HELLO: a=source rank, b=magic|version, then 32 bytes of proof.
WRITE: a=region, b=offset, c=nbytes, epoch=round, then nbytes of payload. FENCE: b=sequence number.
A WRITE whose epoch the target has closed (a late write of an aborted round) is drained, not applied.
ACK (target -> initiator): op u8, seq u64, count u64, nbytes u64, error-text length u16, error text.
WRITE_RUN: several rows that land back to back, one frame (b = offset | rows << 48). The target's side
is ``tcp_agent``; the frame format and a compiled table's frames are ``tcp_frames``. docs/TRANSPORTS.md
has the full description.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import socket
import struct
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from .. import dataauth
from ..datapath.tensors import byte_view
from ..errors import ConnectionClosed, StagingError, TransportError
from ..transport import Abilities, EpochCounts, TransportOptions, await_each_proof, wait_after

from . import tcp_connect
from .listen import Listener
from .tcp_agent import AgentProtocol as _AgentProtocol, FrontDoor
from .tcp_frames import (ACK, HEADER, MAGIC, OP_ACK, OP_FENCE, OP_HELLO, OP_WRITE, PROOF, PROOF_MAGIC,
                         PROOF_TAG, Frames, chunked)

if TYPE_CHECKING:
    from ..datapath.compiled import CopyRow

EARLY_SEAL_BYTES = 16 << 20  # a lane seals before its fence only up to this much (0.13 s at 1 Gbit/s)
SUBMIT_BATCH = 64  # staged rows a lane's writer hands ``submit_many`` at once (one task, few ``sendmsg``)


class TcpTransport(EpochCounts):
    kind = "tcp"
    proof_magic = PROOF_MAGIC
    devices: frozenset = frozenset()  # GPU sources are staged through pinned host memory

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        self.options = options
        self.rank = -1
        self.regions: dict[int, memoryview] = {}
        self._mirrors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # region -> (pinned host mirror, buffer)
        self._dirty: set[int] = set()  # mirrored regions written since the last settle
        EpochCounts.__init__(self)
        self._server: Optional[Listener] = None
        self._agents: set[_AgentProtocol] = set()
        self.closing = False
        self.address = ""
        self.connect_retries = 0  # connects begun again on a fresh socket (``connect_attempt_s``)
        self.guard = dataauth.DataGuard()
        self.door = FrontDoor(options.max_unauthenticated, options.max_unauthenticated_per_address)

    def __repr__(self) -> str:
        return (f"<TcpTransport {self.address or 'not started'} regions={len(self.regions)} agents={len(self._agents)} "
                f"refused={self.guard.refused} connect_retries={self.connect_retries}>")

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        self.guard.listeners.append(self._stop_closed_writes)  # (the guard may be auto's, shared)
        self._server = Listener(lambda: _AgentProtocol(self))  # (never strands a connection it accepted)
        port = self._server.start(self.options.bind_host, self.options.port)
        host = self.options.advertise_host or self.options.bind_host
        self.address = f"{host}:{port}"
        host_id = self.options.host()
        return TransportInfo(self.kind, host_id, self.address, self.options.device, PROOF_TAG)

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        """CPU buffers are written in place; a CUDA buffer lands in a pinned host mirror first and is
        copied to the device by ``settle`` (at the fence)."""
        host = buffer
        if buffer.device.type != "cpu":
            host = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
            self._mirrors[region_id] = (host, buffer)
        else:
            self._mirrors.pop(region_id, None)
        self.regions[region_id] = byte_view(host)  # the view keeps the buffer alive
        size = buffer.numel() * buffer.element_size()
        return RegionInfo(region_id, size, str(buffer.device), struct.pack("<IQ", region_id, size))

    def deregister(self, region_id: int) -> None:
        self.regions.pop(region_id, None)
        self._mirrors.pop(region_id, None)

    @property
    def stable_regions(self) -> bool:
        """A host region is the memory it was registered with (written through a memoryview of it); a
        CUDA region is uploaded from its mirror into the tensor it was given."""
        return not self._mirrors

    async def settle(self) -> None:
        """Upload the mirrors that TCP wrote into since the last settle, and only those: another
        transport (cuda_ipc under ``auto``) may have written the device buffer directly."""
        dirty, self._dirty = self._dirty, set()
        for region_id in sorted(dirty):
            mirror = self._mirrors.get(region_id)
            if mirror is not None:
                await asyncio.to_thread(_upload, *mirror)

    async def connect(self, peer: PeerInfo, key: bytes = b"") -> "TcpConnection":
        """Connect to ``peer`` (``tcp_connect.dial``: within ``connect_timeout_s``, a fresh socket every
        ``connect_attempt_s`` until it is answered), read its challenge and prove ``key``."""
        name = f"receiver/{peer.rank}"
        sock, nonce = await tcp_connect.dial(peer.transport.address, name, self.options, self._retried)
        conn = TcpConnection(sock, name, {r.region_id: r.nbytes for r in peer.regions}, nonce,
                             proofs=peer.transport.data == PROOF_TAG)
        await conn.hello(self.rank, dataauth.prove(key, nonce, self.rank) if key else bytes(dataauth.PROOF_BYTES))
        return conn

    def _retried(self) -> None:
        self.connect_retries += 1

    async def await_proofs(self, proofs: dict[int, bytes], timeout_s: float) -> dict[int, str]:
        """Target side: wait until each sender's connection named in its proof (by its challenge) has
        proven that sender's key and landed the writes the proof counts; sender rank -> why not (no
        open connection has the challenge, another sender's has, it closed first, or the writes did not
        arrive within ``timeout_s``)."""
        failed: dict[int, str] = {}
        for src, proof in sorted(proofs.items()):
            failed.update(await await_each_proof({src: proof}, timeout_s, functools.partial(self._landed, src)))
        return failed

    def _landed(self, src: int, proof: bytes) -> asyncio.Future:
        magic, nonce, count, nbytes = PROOF.unpack(proof)
        if magic != PROOF_MAGIC:
            raise KeyError(f"not a tcp proof (magic {magic!r})")
        for agent in self._agents:  # (the connection exists: the sender had its challenge from it)
            if agent.nonce == nonce:
                if agent.key is not None and agent.source != src:
                    raise KeyError(f"it names a connection of sender/{agent.source}")
                return agent.landed_by(src, count, nbytes)
        raise KeyError("no open connection has its challenge")

    def close_epoch(self, epoch: int) -> None:
        super().close_epoch(epoch)
        self._stop_closed_writes()

    def _stop_closed_writes(self) -> None:
        """A write whose payload is still arriving lands nowhere once its round closed or its region
        stopped being open (a shadow buffer that just became live): the rest of it is drained."""
        for agent in self._agents:
            agent.stop_if_closed()


    async def close(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()
            for agent in list(self._agents):
                agent.transport.close()
            self._server = None


def _upload(host: torch.Tensor, device_buffer: torch.Tensor) -> None:
    device_buffer.copy_(host, non_blocking=True)
    torch.cuda.current_stream(device_buffer.device).synchronize()


class TcpConnection:
    """Initiator side of one connection to a receiver's agent."""

    # GPU sources are staged through pinned host memory; compiled rows (ready-made frames) read CPU memory
    abilities = Abilities(devices=frozenset({"cpu"}), compiles=True, direct_devices=frozenset({"cpu"}),
                          submits=True, batch=SUBMIT_BATCH, seals=True, delta_auto=True)
    generation = 0  # the target's regions are fixed for the connection's life (a new plan connects anew)

    def __init__(self, sock: socket.socket, peer: str, sizes: dict[int, int], nonce: bytes = bytes(16),
                 proofs: bool = False) -> None:
        self.sock = sock
        self.peer = peer
        self.sizes = sizes  # region -> bytes, as the target registered them (compiled tables are checked against it)
        self.nonce = nonce  # the target's challenge: names this connection in a delivery proof
        self.proofs = proofs  # the target checks delivery proofs (it advertised PROOF_TAG)
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.issued_count = 0  # writes queued (counted when issued, before they reach the socket): a seal's
        self.issued_bytes = 0
        self.sent_count = 0  # writes the socket took (what a fence compares)
        self.sent_bytes = 0
        self._fenced_bytes = 0  # sent_bytes as of the last fence the target acknowledged
        self._seq = 0
        self._acks: dict[int, asyncio.Future] = {}
        self._closed = False
        self._write_waiter: Optional[asyncio.Future] = None  # the writer waiting for room in the socket, if any
        self._reader = asyncio.ensure_future(self._read_acks())

    def __repr__(self) -> str:
        return f"<TcpConnection to {self.peer} sent={self.sent_count} writes/{self.sent_bytes} bytes>"

    async def hello(self, rank: int, proof: bytes) -> None:
        async with self.lock:
            await self._send([HEADER.pack(OP_HELLO, rank, MAGIC, 0, 0), proof])

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        left = self._issue(1, src.numel() * src.element_size())
        try:
            await self._write(src, dst_region, dst_offset, epoch, after, left)
        finally:
            self._unissue(left)

    def submit(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
               after: Optional[torch.cuda.Event] = None) -> asyncio.Future:
        """``write`` in two halves: counted as issued now (a ``seal`` from here covers it), sent in a task
        (frames go out in issue order: the connection's lock is FIFO); the task is its completion."""
        if self._closed:
            raise ConnectionClosed("connection is closed", peer=self.peer)
        left = self._issue(1, src.numel() * src.element_size())
        task = asyncio.ensure_future(self._write(src, dst_region, dst_offset, epoch, after, left))
        task.add_done_callback(lambda _: self._unissue(left))
        return task

    def submit_many(self, rows: Sequence[tuple[torch.Tensor, int, int, Optional[torch.cuda.Event]]],
                    epoch: int) -> list[asyncio.Future]:
        """``submit`` of many rows (source, region, offset, after): counted as issued now, their frames sent
        by one task, many per ``sendmsg`` (chunks as a compiled table's: ``tcp_frames.chunked``); that
        task's future stands for every row."""
        if self._closed:
            raise ConnectionClosed("connection is closed", peer=self.peer)
        left = self._issue(len(rows), sum(src.numel() * src.element_size() for src, *_ in rows))
        task = asyncio.ensure_future(self._write_many(rows, epoch, left))
        task.add_done_callback(lambda _: self._unissue(left))
        return [task] * len(rows)

    async def _write_many(self, rows, epoch: int, left: list[int]) -> None:
        for *_, after in rows:
            await wait_after(after)
        frames = []
        for src, region, offset, _ in rows:
            payload = byte_view(src)
            header = memoryview(HEADER.pack(OP_WRITE, region, offset, len(payload), epoch))
            frames.append(([header, payload] if len(payload) else [header], 1, len(payload)))
        async with self.lock:
            for views, count, nbytes in chunked(frames):
                try:
                    await self._send_views(views)
                finally:  # a chunk that started is finished (``_send_views``), even when cancelled: it counts
                    self._sent(left, count, nbytes)

    def seal(self) -> Optional[bytes]:
        """A delivery proof of every write issued so far: the target waits until this connection (named
        by its challenge) has landed that many writes and bytes (``TcpTransport.await_proofs``), so
        ``writes_done`` need not wait for a fence's round trip. None where the target does not check,
        and where more than ``EARLY_SEAL_BYTES`` were issued since the last fence: the receiver's
        verdict would wait on bulk data still crossing the link (while its loop hears no controller),
        where a fence's round trip is small beside the transfer anyway."""
        if not self.proofs or self._closed or self.issued_bytes - self._fenced_bytes > EARLY_SEAL_BYTES:
            return None
        return PROOF.pack(PROOF_MAGIC, self.nonce, self.issued_count, self.issued_bytes)

    def _issue(self, count: int, nbytes: int) -> list[int]:
        """Count writes as issued; -> their [count, bytes] not yet sent, which the sending lowers."""
        self.issued_count += count
        self.issued_bytes += nbytes
        return [count, nbytes]

    def _unissue(self, left: list[int]) -> None:
        """Writes issued but never sent (cancelled with a failed round, even before their task started,
        or failed before their frame did) leave the issued count: a later seal must not wait for them."""
        self.issued_count -= left[0]
        self.issued_bytes -= left[1]
        left[0] = left[1] = 0

    def _sent(self, left: list[int], count: int, nbytes: int) -> None:
        self.sent_count += count
        self.sent_bytes += nbytes
        left[0] -= count
        left[1] -= nbytes

    async def _write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                     after: Optional[torch.cuda.Event], left: list[int]) -> None:
        await wait_after(after)
        payload = byte_view(src)
        header = HEADER.pack(OP_WRITE, dst_region, dst_offset, len(payload), epoch)
        async with self.lock:
            try:
                await self._send([header, payload])
            except asyncio.CancelledError:  # (the frame was finished first: it counts)
                self._sent(left, 1, len(payload))
                raise
            self._sent(left, 1, len(payload))

    def compile(self, rows: Sequence[CopyRow]) -> "Frames":
        """A plan's direct rows as ready-made frames (``weightsync.engine.datapath.compiled``): bounds checked here, once."""
        for row in rows:
            size = self.sizes.get(row.region)
            if size is None or row.offset + row.nbytes > size:
                where = "no such region" if size is None else f"region of {size} bytes"
                raise StagingError(row.name, f"{row.nbytes} bytes at region {row.region}+{row.offset} do not fit "
                                             f"the target ({where}, {self.peer})")
        return Frames(rows)

    def replay(self, frames: "Frames", epoch: int) -> list[asyncio.Future]:
        """Send every frame of a compiled table for round ``epoch``, many per ``sendmsg``; one future."""
        if self._closed:
            raise ConnectionClosed("connection is closed", peer=self.peer)
        left = self._issue(frames.rows, frames.nbytes)
        task = asyncio.ensure_future(self._replay(frames, epoch, left))
        task.add_done_callback(lambda _: self._unissue(left))
        return [task]

    async def _replay(self, frames: "Frames", epoch: int, left: list[int]) -> None:
        async with self.lock:
            frames.stamp(epoch)
            for views, count, nbytes in frames.chunks:
                try:
                    await self._send_views(list(views))
                finally:  # a chunk that started is finished (``_send_views``), even when cancelled: it counts
                    self._sent(left, count, nbytes)

    async def fence(self) -> None:
        self._seq += 1
        seq = self._seq
        fut = self.loop.create_future()
        self._acks[seq] = fut
        async with self.lock:
            await self._send([HEADER.pack(OP_FENCE, 0, seq, 0, 0)])
            want = (self.sent_count, self.sent_bytes)
        count, nbytes, errors = await fut
        self._fenced_bytes = want[1]
        if errors:
            raise TransportError(f"target reported: {errors}", peer=self.peer)
        if (count, nbytes) != want:
            raise TransportError(f"target landed {count} writes/{nbytes} bytes, we sent {want[0]}/{want[1]}",
                                 peer=self.peer)

    async def _send(self, buffers: list) -> None:
        """Send one frame. Once any of it is on the wire the frame is finished even if the caller is
        cancelled (an aborted round): half a frame would make the target read the next frame as the
        rest of this payload. The caller's cancellation is raised after that."""
        await self._send_views([memoryview(b).cast("B") for b in buffers if len(b)])

    async def _send_views(self, views: list) -> None:
        """``_send`` of byte memoryviews (consumed)."""
        if self._closed:
            raise ConnectionClosed("connection is closed", peer=self.peer)
        if self._push(views) or not views:  # the common case: the kernel took it all at once
            return
        rest = asyncio.ensure_future(self._drain(views))
        cancelled = False
        while not rest.done():
            try:
                await asyncio.shield(rest)
            except asyncio.CancelledError:
                cancelled = True
        rest.result()
        if cancelled:
            raise asyncio.CancelledError

    def _push(self, views: list) -> bool:
        """Send what the socket takes now, trimming ``views``; True when all of it went."""
        try:
            while views:
                try:
                    sent = self.sock.sendmsg(views)
                except (BlockingIOError, InterruptedError):
                    return False
                if sent == sum(map(len, views)):  # the common case: all of it
                    views.clear()
                    return True
                ends = list(itertools.accumulate(map(len, views)))
                whole = bisect.bisect_right(ends, sent)  # buffers sent entirely
                rest = sent - (ends[whole - 1] if whole else 0)
                del views[:whole]
                if rest:
                    views[0] = views[0][rest:]
        except OSError as exc:
            self._fail(ConnectionClosed(f"send failed: {exc}", peer=self.peer))
            raise ConnectionClosed(f"send failed: {exc}", peer=self.peer) from exc
        return True

    async def _drain(self, views: list) -> None:
        while not self._push(views):
            if self._closed:
                raise ConnectionClosed("connection closed while sending", peer=self.peer)
            await self._writable()

    async def _writable(self) -> None:
        fut = self._write_waiter = self.loop.create_future()  # (failed by ``_fail``: a close wakes the writer)
        fd = self.sock.fileno()
        self.loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)
            self._write_waiter = None

    async def _read_acks(self) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = await self.loop.sock_recv(self.sock, 65536)
                if not chunk:
                    raise ConnectionClosed("receiver closed the connection", peer=self.peer)
                buf += chunk
                while len(buf) >= ACK.size:
                    op, seq, count, nbytes, tlen = ACK.unpack_from(buf)
                    if len(buf) < ACK.size + tlen:
                        break
                    text = bytes(buf[ACK.size:ACK.size + tlen]).decode(errors="replace")
                    del buf[:ACK.size + tlen]
                    fut = self._acks.pop(seq, None)
                    if op == OP_ACK and fut is not None and not fut.done():
                        fut.set_result((count, nbytes, text))
        except asyncio.CancelledError:
            raise
        except (OSError, TransportError) as exc:
            err = exc if isinstance(exc, TransportError) else ConnectionClosed(str(exc), peer=self.peer)
            self._fail(err)

    def _fail(self, exc: TransportError) -> None:
        self._closed = True
        waiter = self._write_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)  # a frame waiting for room in a dead socket ends now, not never
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # (retrieved: a fence that was cancelled meanwhile leaves nobody to read it)
        self._acks.clear()

    async def close(self) -> None:
        if not self._reader.done():
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail(ConnectionClosed("connection closed", peer=self.peer))
        self.sock.close()
