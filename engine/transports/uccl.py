"""UCCL P2P (RDMA between hosts), wrapped for asyncio. Optional: ``pip install 'weightsync[rdma]'``.

How this works. Nothing is imported or built until it can work: ``uccl_unavailable_reason`` probes
for CUDA, an RDMA device (``/sys/class/infiniband``; uccl 0.1.1 aborts the whole process without
one, unless the caller runs UCCL's tcp mode, ``TransportOptions.uccl_tcp``) and the package. Every
blocking UCCL call (endpoint, connect, accept, reg, send/recv) runs in a worker thread, never on the
event loop. Target: an accept thread takes each incoming connection and serves it: advertisement
requests and fences, two-sided. uccl 0.1.1's ``write_async(conn, mr, ptr, size, meta)`` has no offset:
the 64-byte ``meta`` from ``advertise`` names one remote range. So the initiator asks the target to
advertise each destination (region, offset, size) once and caches the blob: routing tables are
static, so only the first round pays for it. Initiator: ``connect`` once per receiver, then
``write_async`` one-sided and drive ``poll_async`` from the loop, polling each transfer id until
done exactly once (the id is freed when it reports done). ``fence`` sends (count, bytes) two-sided on the same connection and
waits for the target's echo: on UCCL's tcp mode an initiator's completion is not delivery, a message
that follows the writes on the same connection is.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
import struct
import threading
from typing import Any, Optional

import torch

from wire import PeerInfo, RegionInfo, TransportInfo

from .. import cuda_rt
from ..errors import ConnectionClosed, RegistrationError, TransportError, TransportUnavailable
from ..transport import SourceCounters, TransportOptions, wait_after

log = logging.getLogger("weightsync")

FENCE = struct.Struct("<QQQ")  # sequence, writes, bytes
BLOB = 64


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


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


def _ok(result: Any, what: str) -> Any:
    """UCCL returns (ok, value...) tuples or bare bools; turn failure into TransportError."""
    if isinstance(result, tuple):
        if not result[0]:
            raise TransportError(f"uccl {what} failed")
        return result[1] if len(result) == 2 else result[1:]
    if result is False:
        raise TransportError(f"uccl {what} failed")
    return result


class UcclTransport:
    kind = "uccl"
    devices = frozenset({"cuda"})

    def __init__(self, options: TransportOptions = TransportOptions()) -> None:
        reason = uccl_unavailable_reason(options)
        if reason is not None:
            raise TransportUnavailable(f"transport 'uccl' cannot run here: {reason}")
        self.options = options
        self.p2p = _p2p()
        self.gpu = torch.device(options.device).index or 0 if options.device.startswith("cuda") else 0
        self.ep: Any = None
        self.rank = -1
        self.regions: dict[int, tuple[torch.Tensor, int]] = {}  # region id -> (buffer, mr id)
        self.sources: dict[tuple[int, int], int] = {}  # (base pointer, size) -> mr id (whole blocks)
        self._counters: dict[tuple[int, int], SourceCounters] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<UcclTransport gpu={self.gpu} regions={len(self.regions)} source_blocks={len(self.sources)}>"

    async def start(self, rank: int) -> TransportInfo:
        self.rank = rank
        self.ep = await asyncio.to_thread(self._make_endpoint)
        meta = bytes(self.ep.get_metadata())
        host = self.options.host_id or socket.gethostname()
        accept = threading.Thread(target=self._accept_loop, name="uccl-accept", daemon=True)
        accept.start()
        self._threads.append(accept)
        return TransportInfo(self.kind, host, f"{host}:uccl", self.options.device, meta)

    def _make_endpoint(self):
        try:
            return self.p2p.Endpoint(self.gpu)  # 0.1.1: Endpoint(local_gpu_idx)
        except TypeError:
            return self.p2p.Endpoint(self.gpu, max(1, (os.cpu_count() or 4) // 4))  # newer builds

    # --- registration ---------------------------------------------------------------------------

    def register(self, region_id: int, buffer: torch.Tensor) -> RegionInfo:
        if buffer.device.type != "cuda":
            raise RegistrationError(f"region {region_id}: uccl registers CUDA memory, got {buffer.device}")
        nbytes = buffer.numel() * buffer.element_size()
        mr = _ok(self.ep.reg(buffer.data_ptr(), nbytes), "reg")
        self.regions[region_id] = (buffer, mr)
        return RegionInfo(region_id, nbytes, str(buffer.device), struct.pack("<IQ", region_id, nbytes))

    def deregister(self, region_id: int) -> None:
        entry = self.regions.pop(region_id, None)
        if entry is not None and hasattr(self.ep, "dereg"):
            self.ep.dereg(entry[1])

    def source_mr(self, src: torch.Tensor) -> int:
        """The memory registration of the whole caching-allocator block holding ``src`` (cached)."""
        from ..cuda_blocks import block_of

        base, size = block_of(src)
        key = (base, size)
        mr = self.sources.get(key)
        if mr is None:
            mr = self.sources[key] = _ok(self.ep.reg(base, size), "reg (source block)")
        return mr

    # --- target side ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                res = self.ep.accept()
            except Exception as exc:  # the endpoint is going away
                log.debug("uccl accept stopped: %r", exc)
                return
            if not res or not res[0]:
                continue
            conn_id = res[-1]
            t = threading.Thread(target=self._serve, args=(conn_id,), name=f"uccl-serve-{conn_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn_id: int) -> None:
        """Answer one connection's requests until it closes: hello, advertise, fence."""
        ctl = torch.zeros(4096, dtype=torch.uint8, device=f"cuda:{self.gpu}")
        ctl_mr = _ok(self.ep.reg(ctl.data_ptr(), ctl.numel()), "reg (control)")
        source = -1
        while not self._stop.is_set():
            try:
                raw = _recv(self.ep, conn_id, ctl_mr, ctl, FENCE.size)
            except TransportError:
                return
            a, b, c = FENCE.unpack(raw)
            if a >> 63:  # hello: who we serve
                source = a & 0xFFFFFFFF
            elif a >> 62:  # advertise region (a & 0xFFFF) bytes b .. b+c
                _send(self.ep, conn_id, ctl_mr, ctl, _as_tensor(self._advertise(conn_id, a & 0xFFFF, b, c)))
            else:  # fence: sequence a, count b, bytes | epoch << 48 in c
                with self.lock:
                    self._counters[(source, c >> 48)] = SourceCounters(b, c & ((1 << 48) - 1))
                _send(self.ep, conn_id, ctl_mr, ctl, _as_tensor(raw))

    def _advertise(self, conn_id: int, region_id: int, offset: int, size: int) -> bytes:
        entry = self.regions.get(region_id)
        if entry is None or offset + size > entry[0].numel():
            return b"\0" * BLOB  # refused: the initiator raises RegistrationError
        buffer, mr = entry
        blob = _ok(self.ep.advertise(conn_id, mr, buffer.data_ptr() + offset, size), "advertise")
        return bytes(blob)[:BLOB].ljust(BLOB, b"\0")

    # --- initiator side -------------------------------------------------------------------------

    async def connect(self, peer: PeerInfo) -> "UcclConnection":
        name = f"receiver/{peer.rank}"
        try:
            ip, port, bdf = self.p2p.Endpoint.parse_metadata(peer.transport.data)  # 0.1.1: (ip, port, gpu bdf)
        except Exception as exc:
            raise TransportError(f"cannot parse the peer's uccl metadata: {exc!r}", peer=name) from exc
        conn_id = await asyncio.to_thread(lambda: _ok(self.ep.connect(ip, bdf, remote_port=port), "connect"))
        conn = UcclConnection(self, conn_id, name)
        await asyncio.to_thread(conn.handshake, self.rank)
        return conn

    def counters(self, epoch: int) -> dict[int, SourceCounters]:
        with self.lock:
            return {src: c for (src, e), c in self._counters.items() if e == epoch & 0xFFFF}

    def close_epoch(self, epoch: int) -> None:
        with self.lock:
            self._counters = {k: c for k, c in self._counters.items() if k[1] > epoch & 0xFFFF}

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        self._stop.set()


def _send(ep, conn_id: int, mr: int, ctl: torch.Tensor, data: torch.Tensor) -> None:
    n = data.numel()
    ctl[:n].copy_(data)
    torch.cuda.current_stream(ctl.device).synchronize()
    _ok(ep.send(conn_id, mr, ctl.data_ptr(), n), "send")


def _recv(ep, conn_id: int, mr: int, ctl: torch.Tensor, n: int) -> bytes:
    _ok(ep.recv(conn_id, mr, ctl.data_ptr(), n), "recv")
    return bytes(ctl[:n].cpu().numpy())


class UcclConnection:
    devices = frozenset({"cuda"})

    def __init__(self, owner: UcclTransport, conn_id: int, peer: str) -> None:
        self.owner = owner
        self.conn_id = conn_id
        self.peer = peer
        self.blobs: dict[tuple[int, int, int], bytes] = {}
        self._lock = asyncio.Lock()
        self.sent_count = 0
        self.sent_bytes = 0
        self.closed = False
        self._seq = 0
        self._ctl = torch.zeros(4096, dtype=torch.uint8, device=f"cuda:{owner.gpu}")
        self._ctl_mr: Optional[int] = None
        self._epoch = 0
        self._ordered = -1

    def handshake(self, rank: int) -> None:
        """Say who we are (blocking: run in a thread)."""
        self._ctl_mr = _ok(self.owner.ep.reg(self._ctl.data_ptr(), self._ctl.numel()), "reg (control)")
        _send(self.owner.ep, self.conn_id, self._ctl_mr, self._ctl, _as_tensor(FENCE.pack((1 << 63) | rank, 0, 0)))

    def _blob(self, region: int, offset: int, size: int) -> bytes:
        """The target's advertisement of one destination range (asked once, then cached)."""
        key = (region, offset, size)
        blob = self.blobs.get(key)
        if blob is None:
            ep = self.owner.ep
            _send(ep, self.conn_id, self._ctl_mr, self._ctl, _as_tensor(FENCE.pack((1 << 62) | region, offset, size)))
            blob = _recv(ep, self.conn_id, self._ctl_mr, self._ctl, BLOB)
            if blob == b"\0" * BLOB:
                raise RegistrationError(f"target refused region {region} bytes {offset}+{size} (out of bounds?)",
                                        peer=self.peer)
            self.blobs[key] = blob
        return blob

    async def write(self, src: torch.Tensor, dst_region: int, dst_offset: int, epoch: int,
                    after: Optional[torch.cuda.Event] = None) -> None:
        await wait_after(after)
        if self.closed:
            raise ConnectionClosed("write on a closed connection", peer=self.peer)
        nbytes = src.numel() * src.element_size()
        self._epoch = epoch
        if nbytes:
            ep = self.owner.ep
            async with self._lock:  # control messages on this connection are request/reply
                blob = await asyncio.to_thread(self._blob, dst_region, dst_offset, nbytes)
            mr = self.owner.source_mr(src)
            if self._ordered != epoch:  # once per round: the producer's work is done (UCCL's streams are its own)
                await cuda_rt.stream_done(src.device)
                self._ordered = epoch
            tid = _ok(ep.write_async(self.conn_id, mr, src.data_ptr(), nbytes, blob), "write_async")
            while True:  # poll this transfer id until done, exactly once done
                if _ok(ep.poll_async(tid), "poll_async"):
                    break
                await asyncio.sleep(0)
        self.sent_count += 1
        self.sent_bytes += nbytes

    async def fence(self) -> None:
        self._seq += 1
        msg = FENCE.pack(self._seq, self.sent_count, self.sent_bytes | ((self._epoch & 0xFFFF) << 48))
        ep = self.owner.ep

        def roundtrip() -> bytes:
            _send(ep, self.conn_id, self._ctl_mr, self._ctl, _as_tensor(msg))
            return _recv(ep, self.conn_id, self._ctl_mr, self._ctl, FENCE.size)

        async with self._lock:
            echo = await asyncio.to_thread(roundtrip)
        if echo != msg:
            raise TransportError("fence echo does not match what was sent", peer=self.peer)

    async def close(self) -> None:
        self.closed = True
