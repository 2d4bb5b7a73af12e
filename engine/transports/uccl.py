"""UCCL P2P (RDMA between hosts), wrapped for asyncio. Optional: ``pip install 'weightsync[rdma]'``.

How this works. Nothing is imported or built until it can work: ``uccl_unavailable_reason`` probes
for CUDA, an RDMA device (``/sys/class/infiniband``; uccl 0.1.1 aborts the whole process without
one, unless the caller runs UCCL's tcp mode, ``TransportOptions.uccl_tcp``) and the package.

Bytes go one-sided through UCCL; everything else goes over a small side channel, one asyncio TCP
session per connection (loopback unless ``bind_host`` says otherwise):

- HELLO(rank) -> READY, then the initiator's UCCL ``connect`` and the target's ``accept`` are paired
  inside that session (one pairing at a time per target, so identities never depend on timing);
  ACCEPTED carries the descriptor of this session's fence mailbox at the target.
- ADVERTISE(region, offset, size) -> the 64-byte descriptor ``write_async`` needs (uccl 0.1.1 takes
  no offset: one descriptor per destination range). Routing tables are static, so the initiator
  asks once per range and caches it.
- FENCE(seq, count, bytes, epoch) -> echo once the mailbox holds ``seq``; the target records what
  this source says it wrote.

Why not UCCL's own two-sided ``send``/``recv`` for control: in UCCL's tcp mode a connection is an NCCL
communicator, a one-sided write is an ``ncclRecv`` posted by UCCL's control thread on the target, and
a control ``recv`` waiting on the same communicator is matched, in posting order, against the next
write's ``ncclSend``: it swallows the write (hang or truncation). Blocking UCCL calls also spin.

Delivery. The initiator's completion of a write is not delivery on tcp mode (notes/uccl-0.1.1.md), and
neither is a read issued after the writes (measured on the 2-GPU machine: the read completed while
later writes were still on their way). So ``fence`` writes its sequence number into the mailbox as one
more one-sided write on the same connection, and the target answers the FENCE only once it reads that
number there: the connection's writes land in order, so everything before it has landed. Over RDMA an
initiator's completion already means placement, and the mailbox adds one small write. In tcp mode
one operation is in flight per connection (``_one_at_a_time``). Each transfer id is polled until done
exactly once; a cancelled write keeps being polled by a shielded task holding its source. This module
is the transport (and the target's side channel); ``uccl_connection`` is the initiator's connection.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from weightsync.wire import PeerInfo, RegionInfo, TransportInfo

from .. import dataauth
from ..aio import within
from ..cuda import cuda_rt
from ..errors import ConnectionClosed, RegistrationError, TransportError, TransportUnavailable
from ..transport import EpochCounts, SourceCounters, TransportOptions
from .listen import Listener
from .uccl_frames import (BLOB, FENCE_TIMEOUT_S, FRAME, MAGIC, MAILBOX, OP_ACCEPTED, OP_ADVERTISE, OP_CHALLENGE,
                          OP_FENCE, OP_HELLO, PAIRING_TIMEOUT_S, REFUSED, ok as _ok)

if TYPE_CHECKING:
    from .uccl_connection import UcclConnection

log = logging.getLogger("weightsync")


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def uccl_unavailable_reason(options: TransportOptions) -> Optional[str]:
    if not torch.cuda.is_available():
        return "uccl needs CUDA (torch.cuda.is_available() is False)"
    if not rdma_devices() and not options.uccl_tcp:
        return ("no RDMA device in /sys/class/infiniband (uccl 0.1.1 would abort the process); "
                "enable UCCL's tcp mode (uccl_tcp) to run without one")
    if importlib.util.find_spec("uccl") is None:
        return "uccl is not installed (pip install 'weightsync[rdma]'; Python >= 3.12, x86-64)"
    return None


def _p2p():
    try:
        from uccl import p2p
    except Exception as exc:  # ImportError, OSError (libcudart), anything the extension raises
        raise TransportUnavailable(f"uccl.p2p cannot be imported: {exc!r}") from exc
    return p2p


def _off_loop(fn: Callable[[], Any]) -> asyncio.Future:
    """Run a blocking UCCL call in a daemon thread: one that never returns (a peer that died
    mid-handshake) must not hold up the process's exit, as an executor thread would."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, exc: Optional[BaseException]) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:  # handed to the awaiting task
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=run, name="uccl-call", daemon=True).start()
    return fut


def _memory_block(t: torch.Tensor) -> tuple[int, int]:
    """The whole allocation holding ``t``: a caching-allocator segment on CUDA, else its storage."""
    if t.is_cuda:
        from ..cuda.cuda_blocks import block_of

        return block_of(t)
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


async def _read_hello(reader: asyncio.StreamReader) -> tuple[int, bytes, int, int]:
    """The initiator's HELLO and proof: (source rank, proof, magic, op); no proof unless it is a HELLO."""
    op, source, magic, *_ = await _read_frame(reader)
    if op != OP_HELLO or magic != MAGIC:
        return source, b"", magic, op
    return source, await reader.readexactly(dataauth.PROOF_BYTES), magic, op


def _peername(writer: asyncio.StreamWriter) -> str:
    return "%s:%s" % tuple(writer.get_extra_info("peername") or ("?", "?"))[:2]


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, ...]:
    return FRAME.unpack(await reader.readexactly(FRAME.size))


class _Mailbox:
    """A session's fence mailbox at the target: one registered int64 the initiator writes a fence's
    sequence number into, read back here without blocking the loop."""

    def __init__(self, device: str, reg: Callable[[int, int, str], int]) -> None:
        self.cell = torch.zeros(1, dtype=torch.int64, device=device)
        self.entry = (self.cell, reg(self.cell.data_ptr(), 8, "reg (fence mailbox)"), self.cell.data_ptr())
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=self.cell.is_cuda)

    async def _read(self) -> int:
        if self.cell.is_cuda:
            self.host.copy_(self.cell, non_blocking=True)
            await cuda_rt.stream_done(self.cell.device)
        else:
            self.host.copy_(self.cell)
        return int(self.host[0])

    async def holds(self, seq: int, timeout_s: float) -> bool:
        since = time.perf_counter()
        while await self._read() != seq:
            if time.perf_counter() - since > timeout_s:
                return False
            await cuda_rt.pause(since)
        return True


class UcclTransport(EpochCounts):
    stable_regions = True  # a region is the memory it was registered with (``transport.Transport``)
    kind = "uccl"
    devices = frozenset({"cuda"})

    def __init__(self, options: TransportOptions = TransportOptions(), p2p: Any = None) -> None:
        """``p2p``: the module providing ``Endpoint`` (uccl's, unless a test gives a stand-in)."""
        if p2p is None:
            reason = uccl_unavailable_reason(options)
            if reason is not None:
                raise TransportUnavailable(f"transport 'uccl' cannot run here: {reason}")
            p2p = _p2p()
        self.options = options
        self.p2p = p2p
        device = torch.device(options.device)
        self.gpu = device.index or 0 if device.type == "cuda" else 0
        self.ep: Any = None
        self.rank = -1
        self.regions: dict[int, tuple[torch.Tensor, int, int]] = {}  # region id -> (buffer, mr id, its address then)
        self.blocks: dict[tuple[int, int], int] = {}  # (base, size) of a whole source allocation -> mr id
        EpochCounts.__init__(self)  # (source, epoch) -> what the source reported at its fence
        self._server: Optional[Listener] = None
        self._sessions: dict[asyncio.StreamWriter, asyncio.Task] = {}
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # side-channel sessions not yet authenticated, oldest first
        self._pairing = asyncio.Lock()
        self._stalled: Optional[str] = None
        self.guard = dataauth.DataGuard()  # the side channel's hello proves the pair key (engine.dataauth)

    def __repr__(self) -> str:
        return (f"<UcclTransport gpu={self.gpu} regions={len(self.regions)} source_blocks={len(self.blocks)} "
                f"sessions={len(self._sessions)}>")

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        self.ep = await _off_loop(self._make_endpoint)
        self._server = Listener(lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._session))
        port = self._server.start(self.options.bind_host, self.options.port)  # (never strands a connection)
        host = self.options.host()
        address = f"{self.options.advertise_host or self.options.bind_host}:{port}"
        return TransportInfo(self.kind, host, address, self.options.device, bytes(self.ep.get_metadata()))

    def _make_endpoint(self):
        try:
            return self.p2p.Endpoint(self.gpu)  # 0.1.1: Endpoint(local_gpu_idx)
        except TypeError:
            return self.p2p.Endpoint(self.gpu, max(1, (os.cpu_count() or 4) // 4))  # newer builds

    def _reg(self, ptr: int, size: int, what: str) -> int:
        return _ok(self.ep.reg(ptr, size), what)


    # --- registration ---------------------------------------------------------------------------

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        if buffer.device.type != torch.device(self.options.device).type:
            raise RegistrationError(f"region {region_id}: this uccl endpoint registers {self.options.device} "
                                    f"memory, got {buffer.device}")
        nbytes = buffer.numel() * buffer.element_size()
        mr = self._reg(buffer.data_ptr(), nbytes, f"reg (region {region_id})")
        self.regions[region_id] = (buffer, mr, buffer.data_ptr())
        return RegionInfo(region_id, nbytes, str(buffer.device), struct.pack("<IQ", region_id, nbytes))

    def deregister(self, region_id: int) -> None:
        entry = self.regions.pop(region_id, None)
        if entry is not None and hasattr(self.ep, "dereg"):
            self.ep.dereg(entry[1])

    def source_mr(self, src: torch.Tensor) -> int:
        """The memory registration of the whole allocation holding ``src`` (made once, then cached)."""
        key = _memory_block(src)
        mr = self.blocks.get(key)
        if mr is None:
            mr = self.blocks[key] = self._reg(key[0], key[1], "reg (source block)")
        return mr

    # --- target side: one side-channel session per incoming connection -----------------------------

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:  # (accepted as the transport closed: ended, not left silent)
            writer.close()
            return
        self._sessions[writer] = asyncio.current_task()
        source = -1
        try:
            nonce = dataauth.new_nonce()
            writer.write(FRAME.pack(OP_CHALLENGE, 0, int.from_bytes(nonce[:8], "little"),
                                    int.from_bytes(nonce[8:], "little"), 0, 0))
            self._waiting[writer] = None  # (the front door: bounded, oldest evicted, deadline below)
            while len(self._waiting) > self.options.max_unauthenticated:
                oldest = next(iter(self._waiting))
                self._waiting.pop(oldest)
                self.guard.refuse(_peername(oldest), "closed, not authenticated: over "
                                  f"{self.options.max_unauthenticated} unauthenticated connections", "evicted")
                oldest.close()
            try:
                source, proof, magic, op = await within(_read_hello(reader), self.options.handshake_timeout_s)
            except asyncio.TimeoutError:
                self.guard.refuse(_peername(writer), f"no authenticated hello within "
                                  f"{self.options.handshake_timeout_s}s", "handshake timeout")
                return
            finally:
                self._waiting.pop(writer, None)
            if op != OP_HELLO or magic != MAGIC:
                self.guard.refuse(_peername(writer), f"bad hello (op {op}, magic {magic:#x})", "bad hello")
                return
            if self.guard.admit(source, nonce, proof, _peername(writer)) is None:
                return  # refused before any RDMA pairing: no descriptor reaches it
            conn_id = await self._pair(writer, source)
            mailbox = _Mailbox(self.options.device, self._reg)
            blob = self._advertise(conn_id, MAILBOX, 0, 8, mailbox.entry)
            writer.write(FRAME.pack(OP_ACCEPTED, 0, conn_id, 0, 0, 0) + blob)
            while True:
                op, a, b, c, d, e = await _read_frame(reader)
                if op == OP_ADVERTISE:
                    writer.write(self._advertise(conn_id, a, b, c))
                elif op == OP_FENCE:  # b: sequence, c: writes, d: bytes, e: epoch
                    landed = await mailbox.holds(b, FENCE_TIMEOUT_S)
                    if landed and e > self.closed_epoch:
                        self._counters[(source, e)] = SourceCounters(c, d)
                    writer.write(FRAME.pack(op, 0 if landed else 1, b, c, d, e))
                else:
                    log.error("uccl side channel: unknown op %d from sender/%d: closing", op, source)
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the initiator closed its connection
        except TransportError as exc:
            log.error("uccl: session with sender/%d failed: %s", source, exc)
        finally:
            self._sessions.pop(writer, None)
            writer.close()

    async def _pair(self, writer: asyncio.StreamWriter, source: int) -> int:
        """UCCL ``accept`` paired with this session's initiator: READY is sent only while holding the
        pairing lock, and the initiator calls ``connect`` only after READY."""
        async with self._pairing:
            if self._stalled:
                raise TransportError(f"an earlier UCCL pairing never completed ({self._stalled})")
            writer.write(FRAME.pack(OP_HELLO, self.rank, MAGIC, 0, 0, 0))
            await writer.drain()
            accepted = _off_loop(self.ep.accept)
            try:
                result = await within(asyncio.shield(accepted), PAIRING_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._stalled = f"sender/{source} did not connect within {PAIRING_TIMEOUT_S:.0f}s"
                raise TransportError(self._stalled) from None
        return int(_ok(result, "accept")[-1])  # 0.1.1: (ok, remote ip, remote gpu, conn id)

    def _advertise(self, conn_id: int, region_id: int, offset: int, size: int,
                   entry: Optional[tuple[torch.Tensor, int, int]] = None) -> bytes:
        entry = entry or self.regions.get(region_id)
        if entry is None:
            return REFUSED  # the initiator raises RegistrationError
        buffer, mr, address = entry  # (the address registered: a shadow receiver may swap what owns it)
        if offset + size > buffer.numel() * buffer.element_size():
            return REFUSED
        blob = _ok(self.ep.advertise(conn_id, mr, address + offset, size), "advertise")
        return bytes(blob)[:BLOB].ljust(BLOB, b"\0")

    # --- initiator side -------------------------------------------------------------------------

    async def connect(self, peer: PeerInfo, key: bytes = b"") -> "UcclConnection":
        name = f"receiver/{peer.rank}"
        try:
            ip, port, bdf = self.p2p.Endpoint.parse_metadata(peer.transport.data)  # 0.1.1: (ip, port, gpu bdf)
            side_host, _, side_port = peer.transport.address.rpartition(":")
            reader, writer = await asyncio.open_connection(side_host, int(side_port))
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot reach the peer's uccl side channel {peer.transport.address!r}: {exc}",
                                 peer=name) from exc
        except Exception as exc:  # whatever parse_metadata raises on a bad blob
            raise TransportError(f"cannot parse the peer's uccl metadata: {exc!r}", peer=name) from exc
        try:
            op, _, lo, hi, *_ = await _read_frame(reader)
            if op != OP_CHALLENGE:
                raise TransportError(f"the peer's uccl side channel sent op {op}, not a challenge", peer=name)
            nonce = lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
            proof = dataauth.prove(key, nonce, self.rank) if key else bytes(dataauth.PROOF_BYTES)
            writer.write(FRAME.pack(OP_HELLO, self.rank, MAGIC, 0, 0, 0) + proof)
            op, _, magic, *_ = await _read_frame(reader)
            if op != OP_HELLO or magic != MAGIC:
                raise TransportError(f"the peer's uccl side channel speaks another version ({magic:#x})", peer=name)
            conn_id = _ok(await _off_loop(lambda: self.ep.connect(ip, bdf, remote_port=port)), "connect", name)
            op, *_ = await _read_frame(reader)
            mailbox = await reader.readexactly(BLOB)
        except asyncio.IncompleteReadError as exc:
            writer.close()
            raise ConnectionClosed("the peer closed its uccl side channel during the handshake (our pair key "
                                   "refused?)", peer=name) from exc
        except BaseException:
            writer.close()
            raise
        if op != OP_ACCEPTED or mailbox == REFUSED:
            writer.close()
            raise TransportError("the peer did not accept the uccl connection", peer=name)
        from .uccl_connection import UcclConnection  # (imported when first used: it needs CUDA's bindings)

        return UcclConnection(self, conn_id, name, reader, writer, mailbox)

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        sessions = list(self._sessions.items())
        for writer, _ in sessions:
            writer.close()  # the session's read sees EOF and it ends
        await asyncio.gather(*(task for _, task in sessions), return_exceptions=True)
