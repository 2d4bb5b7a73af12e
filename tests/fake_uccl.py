"""A stand-in for ``uccl.p2p`` on CPU memory that behaves as UCCL 0.1.1's tcp mode does where it matters.

- ``connect`` blocks until the target's ``accept`` takes it (as UCCL's do).
- A write reports completion at the initiator before its bytes land at the target (measured on
  UCCL's tcp mode, notes/uccl-0.1.1.md). A connection's bytes land later, in order, one write every
  ``LATENCY_S``, from a delivery thread: a fence that did not wait for them would let the target see
  the old bytes, and the tests would notice.
- Two operations in flight on one connection are recorded in ``problems`` (UCCL's tcp mode may post
  them to NCCL in another order than announced, landing one write's bytes in another's place).
- Transfer ids must be polled until done exactly once: polling one again (a use-after-free in UCCL)
  or leaving one unpolled (a leak) is recorded in ``problems``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import queue
import struct
import threading

from weightsync.engine.transports.uccl import UcclTransport

META = struct.Struct("<16sH16s")
BLOB = struct.Struct("<QQQ")
_endpoints: dict[int, "Endpoint"] = {}
_ports = itertools.count(41000)
_ids = itertools.count(1)
_lock = threading.Lock()
problems: list[str] = []
LATENCY_S = 0.01  # from sending a write to its bytes landing
POLLS = 6  # polls until an operation reports done: long enough for others to be issued meanwhile


class _Link:
    """One connection's delivery: bytes land in the order they were sent, some time after sending."""

    def __init__(self) -> None:
        self.queued: queue.Queue = queue.Queue()  # (dst, bytes) sent but not yet landed; None: stop
        self.in_flight = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._deliver, daemon=True, name="fake-uccl-delivery")
        self.thread.start()

    def _deliver(self) -> None:
        """Land each write ``LATENCY_S`` after it was taken (the network's latency, emulated; nothing
        here synchronises a test), in order, until the link is stopped."""
        while True:
            item = self.queued.get()
            if item is None or self.stopped.wait(LATENCY_S):
                return
            ctypes.memmove(item[0], item[1], len(item[1]))

    def stop(self) -> None:
        """No write lands after this returns (the target's memory may be freed next): the thread is
        woken, drops what is still queued and is joined."""
        self.stopped.set()
        self.queued.put(None)
        self.thread.join()


class Endpoint:
    def __init__(self, local_gpu_idx: int, *_: int) -> None:
        self.gpu = local_gpu_idx
        self.port = next(_ports)
        self.mrs: dict[int, tuple[int, int]] = {}
        self.conns: dict[int, _Link] = {}
        self.incoming: queue.Queue = queue.Queue()
        self.transfers: dict[int, list] = {}  # id -> [polls left before done, action, done, link]
        with _lock:
            _endpoints[self.port] = self

    def get_metadata(self) -> bytes:
        return META.pack(b"127.0.0.1", self.port, f"gpu{self.gpu}".encode())

    @staticmethod
    def parse_metadata(data: bytes):
        ip, port, bdf = META.unpack(data)
        return ip.rstrip(b"\0").decode(), port, bdf.rstrip(b"\0").decode()

    def accept(self):
        link, conn_id, accepted = self.incoming.get()
        self.conns[conn_id] = link
        accepted.set()
        return True, "127.0.0.1", 0, conn_id

    def connect(self, ip: str, bdf: str, remote_port: int):
        target = _endpoints[remote_port]
        link, accepted = _Link(), threading.Event()
        mine, theirs = next(_ids), next(_ids)
        target.incoming.put((link, theirs, accepted))
        accepted.wait()
        self.conns[mine] = link
        return True, mine

    def reg(self, ptr: int, size: int):
        mr = next(_ids)
        self.mrs[mr] = (ptr, size)
        return True, mr

    def dereg(self, mr: int) -> bool:
        return self.mrs.pop(mr, None) is not None

    def _covers(self, mr: int, ptr: int, size: int) -> bool:
        base, n = self.mrs.get(mr, (0, -1))
        return base <= ptr and ptr + size <= base + n

    def advertise(self, conn_id: int, mr: int, ptr: int, size: int):
        if conn_id not in self.conns or not self._covers(mr, ptr, size):
            return False, b""
        return True, BLOB.pack(ptr, size, mr).ljust(64, b"\0")

    def _start(self, link: _Link, action) -> tuple[bool, int]:
        if link.in_flight:  # UCCL's tcp mode would post the two NCCL operations in either order
            problems.append("two operations in flight on one connection")
        link.in_flight += 1
        tid = next(_ids)
        self.transfers[tid] = [POLLS, action, False, link]  # issued on the first poll, done on the last
        return True, tid

    def write_async(self, conn_id: int, mr: int, ptr: int, size: int, blob: bytes):
        dst, dst_size, _ = BLOB.unpack(blob[:BLOB.size])
        if not self._covers(mr, ptr, size) or size != dst_size:
            return False, 0
        link = self.conns[conn_id]
        return self._start(link, lambda: link.queued.put((dst, ctypes.string_at(ptr, size))))  # read now

    def poll_async(self, tid: int):
        entry = self.transfers.get(tid)
        if entry is None or entry[2]:
            problems.append(f"transfer {tid} polled after it was reported done")
            return False, False
        if entry[0] == POLLS:  # the request is issued on the first poll
            entry[1]()
        entry[0] -= 1
        if entry[0] < 0:
            entry[2] = True
            entry[3].in_flight -= 1
            return True, True
        return True, False

    def outstanding(self) -> list[int]:
        return [tid for tid, entry in self.transfers.items() if not entry[2]]

    def stop(self) -> None:
        for link in self.conns.values():
            link.stop()


class _Module:
    Endpoint = Endpoint


class FakeUcclTransport(UcclTransport):
    """The real transport over the stand-in endpoint (registered as backend ``uccl_fake`` in tests)."""

    def __init__(self, options) -> None:
        super().__init__(dataclasses.replace(options, uccl_tcp=True), p2p=_Module)

    async def close(self) -> None:
        await super().close()
        if self.ep is not None:  # (a real endpoint's threads end with the process)
            self.ep.stop()
