"""A small ctypes binding to the CUDA runtime that torch has already loaded, and event polling.

How this works: torch does not expose opening an IPC handle in a chosen device's context, nor a raw
pointer-to-pointer async copy (one, or many in one ``cudaMemcpyBatchAsync`` where the runtime has it),
and these decide how fast a same-host push is (see docs/TRANSPORTS.md, "Push or pull" and "Batches of
copies"). So this module finds the ``libcudart`` mapped into the process after torch
initialised CUDA (``/proc/self/maps``), binds the handful of calls needed, and raises
``TransportError`` with CUDA's own error string on failure. ``wait_event`` polls a CUDA event from the
event loop, never blocking it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import functools
import time
from typing import Callable, Optional, Sequence

import torch

from ..errors import TransportError, TransportUnavailable

CUDA_MEMCPY_DEFAULT = 4
IPC_LAZY_ENABLE_PEER_ACCESS = 1
ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise TransportUnavailable("CUDA is not available here (torch.cuda.is_available() is False)")
    torch.cuda.init()
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                path = line.split()[-1]
                break
    try:
        lib = ctypes.CDLL(path) if path else ctypes.CDLL("libcudart.so")
    except OSError as exc:
        raise TransportUnavailable(f"cannot load the CUDA runtime library: {exc}") from exc
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
    lib.cudaDeviceCanAccessPeer.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        text = _lib().cudaGetErrorString(code).decode(errors="replace")
        raise TransportError(f"{what} failed: CUDA error {code} ({text})")


class on_device:
    """Make ``device`` current for the runtime calls inside the block."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.previous = ctypes.c_int(0)

    def __enter__(self) -> None:
        _check(_lib().cudaGetDevice(ctypes.byref(self.previous)), "cudaGetDevice")
        if self.previous.value != self.device:  # (the usual case is already there: one call, not three)
            _check(_lib().cudaSetDevice(self.device), "cudaSetDevice")

    def __exit__(self, *exc) -> None:
        if self.previous.value != self.device:
            _lib().cudaSetDevice(self.previous.value)


def raw_ipc_handle(shared: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle inside torch's shareable handle.

    torch's caching allocator writes ``[version byte][type byte][payload]``: type ``c`` is a
    cudaMalloc'd block followed by its 64-byte cudaIpcMemHandle; ``e`` is an expandable segment,
    which cudaIpcOpenMemHandle cannot open. A bare 64-byte handle passes through."""
    if len(shared) == 64:
        return shared
    if len(shared) == 66 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise TransportUnavailable("cuda_ipc cannot share expandable segments: run without "
                                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    raise TransportError(f"unrecognised CUDA IPC handle ({len(shared)} bytes, starts {shared[:2]!r})")


def open_ipc_handle(handle: bytes, device: int) -> int:
    """Map another process's allocation into this one, in ``device``'s context (peer access on)."""
    h = IpcHandle()
    ctypes.memmove(ctypes.addressof(h), handle, 64)  # (h.reserved would be a bytes *copy*)
    ptr = ctypes.c_void_p()
    with on_device(device):
        _check(_lib().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS),
               "cudaIpcOpenMemHandle")
    return ptr.value or 0


def close_ipc_handle(ptr: int, device: int) -> None:
    with on_device(device):
        _check(_lib().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


@functools.lru_cache(maxsize=None)
def enable_peer_access(device: int, peer: int) -> bool:
    """Let ``device``'s kernels and copy engines reach ``peer``'s memory; returns whether they can.

    Without it a copy issued from ``device`` into ``peer``'s memory still works, but the runtime
    stages it through host memory, an order of magnitude slower than NVLink (docs/TRANSPORTS.md)."""
    if device == peer:
        return True
    can = ctypes.c_int(0)
    _check(_lib().cudaDeviceCanAccessPeer(ctypes.byref(can), device, peer), "cudaDeviceCanAccessPeer")
    if not can.value:
        return False
    with on_device(device):
        code = _lib().cudaDeviceEnablePeerAccess(peer, 0)
    if code not in (0, ERROR_PEER_ACCESS_ALREADY_ENABLED):
        _check(code, "cudaDeviceEnablePeerAccess")
    _lib().cudaGetLastError()  # clear the sticky "already enabled" status
    return True


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def memcpy_async(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """A pointer-to-pointer copy (any direction, peers included) queued on ``stream``."""
    with on_device(stream.device.index):
        _check(_lib().cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, CUDA_MEMCPY_DEFAULT,
                                      ctypes.c_void_p(stream.cuda_stream)), "cudaMemcpyAsync")


MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
MEM_LOCATION_TYPE_DEVICE = 1
ERROR_REQUIRES_NEWER_DRIVER = 36
ERROR_NOT_SUPPORTED = 801
_batch_refused = False  # the driver turned cudaMemcpyBatchAsync down once: copy one by one from then on


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def runtime_version() -> int:
    """The CUDA runtime's version, e.g. 12090 for 12.9."""
    version = ctypes.c_int(0)
    _check(_lib().cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
    return version.value


def batch_copies() -> bool:
    """Whether ``memcpy_batch_async`` makes one runtime call for many copies (CUDA 12.8 and later)."""
    return not _batch_refused and runtime_version() >= 12080 and hasattr(_lib(), "cudaMemcpyBatchAsync")


class BatchCopies:
    """Pointer copies ``(dst, src, nbytes)`` from ``src_device``'s memory to ``dst_device``'s with their
    argument arrays built once: ``launch(stream)`` queues them all in one ``cudaMemcpyBatchAsync`` (the
    driver schedules the whole list), or one ``cudaMemcpyAsync`` each where the runtime or driver lacks
    it. A compiled round keeps these across rounds (``weightsync.engine.transports.cuda_ipc``)."""

    def __init__(self, copies: Sequence[tuple[int, int, int]], src_device: int, dst_device: int) -> None:
        self.copies = [c for c in copies if c[2]]
        count = self.count = len(self.copies)
        self.dsts = (ctypes.c_void_p * count)(*(c[0] for c in self.copies))
        self.srcs = (ctypes.c_void_p * count)(*(c[1] for c in self.copies))
        self.sizes = (ctypes.c_size_t * count)(*(c[2] for c in self.copies))
        self.attrs = _MemcpyAttributes(MEMCPY_SRC_ACCESS_ORDER_STREAM, _MemLocation(MEM_LOCATION_TYPE_DEVICE, src_device),
                                       _MemLocation(MEM_LOCATION_TYPE_DEVICE, dst_device), 0)
        self.first = (ctypes.c_size_t * 1)(0)

    def launch(self, stream: torch.cuda.Stream) -> None:
        global _batch_refused
        if self.count > 1 and batch_copies():
            tail: tuple = () if runtime_version() >= 13000 else (ctypes.byref(ctypes.c_size_t(0)),)  # failIdx until 13
            with on_device(stream.device.index):
                code = _lib().cudaMemcpyBatchAsync(self.dsts, self.srcs, self.sizes, ctypes.c_size_t(self.count),
                                                   ctypes.byref(self.attrs), self.first, ctypes.c_size_t(1), *tail,
                                                   ctypes.c_void_p(stream.cuda_stream))
            if code not in (ERROR_REQUIRES_NEWER_DRIVER, ERROR_NOT_SUPPORTED):
                _check(code, "cudaMemcpyBatchAsync")
                return
            _lib().cudaGetLastError()
            _batch_refused = True
        for dst, src, nbytes in self.copies:
            memcpy_async(dst, src, nbytes, stream)


class PitchedCopies:
    """Copies ``(dst, src, width, height, pitch)``: ``height`` rows of ``width`` bytes, ``pitch`` bytes apart
    at the source, landing back to back at ``dst`` (a block of a rank's own rows: no staging copy).
    ``launch(stream)`` queues one ``cudaMemcpy2DAsync`` each (copy engines, peers included)."""

    def __init__(self, copies: Sequence[tuple[int, int, int, int, int]]) -> None:
        self.copies = [c for c in copies if c[2] and c[3]]

    def launch(self, stream: torch.cuda.Stream) -> None:
        lib, handle = _lib(), ctypes.c_void_p(stream.cuda_stream)
        with on_device(stream.device.index):
            for dst, src, width, height, pitch in self.copies:
                _check(lib.cudaMemcpy2DAsync(ctypes.c_void_p(dst), width, ctypes.c_void_p(src), pitch, width, height,
                                             CUDA_MEMCPY_DEFAULT, handle), "cudaMemcpy2DAsync")


def memcpy_batch_async(copies: Sequence[tuple[int, int, int]], stream: torch.cuda.Stream,
                       src_device: int, dst_device: int) -> None:
    """``BatchCopies(copies, src_device, dst_device).launch(stream)``: many copies per call instead of
    one each (docs/TRANSPORTS.md has what it saves)."""
    BatchCopies(copies, src_device, dst_device).launch(stream)


SPIN_S = 0.002  # after a wait starts, yield to the loop without sleeping this long (epoll sleeps >= 1 ms)
NAP_S = 0.0005


async def wait_event(event: torch.cuda.Event, spin_s: float = SPIN_S) -> None:
    """Wait for ``event`` without blocking the loop: poll it, yielding, for the first ``spin_s``; a
    longer wait is handed to a helper thread blocked in ``event.synchronize()`` (GIL released), which
    wakes the loop soon after the event instead of after a nap of a millisecond or more.

    asyncio's sleeps shorter than a millisecond still block in epoll for one, so napping would see the
    end of a round's copies late; yielding keeps every other task running. ``spin_s=math.inf`` only
    polls (``TransportOptions.busy_poll``: the wait ends within a loop iteration of the event)."""
    start = time.perf_counter()
    while not event.query():
        if time.perf_counter() - start >= spin_s:
            await asyncio.get_running_loop().run_in_executor(_waiters(), event.synchronize)
            return
        await asyncio.sleep(0)


@functools.lru_cache(maxsize=1)
def _waiters() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that block on long CUDA event waits (``wait_event``); more waits than threads queue."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="weightsync-cuda-wait")


def recorded(device: torch.device) -> torch.cuda.Event:
    """An event behind the work queued so far on ``device``'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


async def stream_done(device: torch.device) -> None:
    """Wait, without blocking the loop, for the work queued so far on ``device``'s current stream."""
    await wait_event(recorded(device))


async def pause(since: float, spin_s: float = SPIN_S) -> None:
    """One step of a poll loop that began at ``since``: yield for ``spin_s``, then nap ``NAP_S``."""
    await asyncio.sleep(0 if time.perf_counter() - since < spin_s else NAP_S)


class EventPoller:
    """Completions of a connection's CUDA events, polled from the loop by one task, oldest first.
    Events seen complete go back to ``recycle`` (if given) for reuse: no create/destroy per write."""

    def __init__(self, recycle: Optional[Callable[[torch.cuda.Event], None]] = None, spin_s: float = SPIN_S) -> None:
        self.pending: collections.deque[tuple[torch.cuda.Event, asyncio.Future]] = collections.deque()
        self.completed = 0
        self.recycle = recycle
        self.spin_s = spin_s  # (``wait_event``)
        self._task: Optional[asyncio.Task] = None

    def __repr__(self) -> str:
        return f"<EventPoller pending={len(self.pending)} completed={self.completed}>"

    def wait(self, event: torch.cuda.Event) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((event, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return fut

    async def _run(self) -> None:
        progress = time.perf_counter()
        while self.pending:
            event, fut = self.pending[0]
            happened = event.query()
            if happened or fut.done():  # a cancelled waiter's copy still runs: nothing to tell it
                self.pending.popleft()
                self.completed += 1
                if not fut.done():
                    fut.set_result(None)
                if happened and self.recycle is not None:
                    self.recycle(event)
                progress = time.perf_counter()
                continue
            await pause(progress, self.spin_s)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for _, fut in self.pending:
            fut.cancel()
        self.pending.clear()
