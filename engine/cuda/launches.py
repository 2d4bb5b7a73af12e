"""A Triton kernel launched with fixed arguments every round, without Triton's per-call binding.

How this works. ``kernel[grid](*args, **meta)`` binds the arguments, specialises them (alignment,
values of 1), looks the compiled kernel up and enters two context managers for the device and the
stream: about 25-45 us of host time a launch on an H100 or H200, where the launch itself costs 5-8
(``bench/diagnostics/launch_cost.py``). A compiled round replays the same launches with the same
arguments every round (a plan's copy tables), so ``Launch`` does that work once: ``JITFunction.warmup``
compiles (or finds) the kernel for exactly these arguments, as an ordinary launch would, and every
round calls the compiled kernel's own launcher (``CompiledKernel[grid](*args, stream=)``, the
interface Triton gives compiled kernels) on the round's stream.

The way is checked once per device before it is used (``direct_works``): a copy kernel launched the
direct way on scratch memory must copy exactly what it should. Where that check fails or raises (a
Triton whose compiled kernels launch another way), or ``warmup`` does, launches go through
``kernel[grid]``, logged once per kernel; the bytes a launch moves are the same either way
(``tests/engine/test_launches.py``). The check uses the copy kernel's own shape, so the compile it
costs (once per process, before a member joins: ``warm.py``) is the one the rounds' copies need.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("weightsync")

_checked: dict[int, bool] = {}  # device -> whether the direct way copied right there
_told: set = set()  # kernels whose warmup failed (logged once each)
_lock = threading.Lock()


class Launch:
    """``fn[(grid,)](*args, **meta)`` on a given stream, as often as asked. ``direct``: None, the direct
    way where ``direct_works`` on the device; True, the direct way unchecked (the check itself); False,
    Triton's launcher. The ``direct`` property tells the way taken."""

    def __init__(self, fn: Any, grid: int, args: tuple, meta: dict, device: int, *,
                 direct: Optional[bool] = None) -> None:
        self.fn, self.grid, self.args, self.meta, self.device = fn, grid, args, meta, device
        self._direct: Optional[Callable] = None
        self._every: tuple = ()
        if direct or (direct is None and direct_works(device)):
            self._direct, self._every = _compiled(fn, grid, args, meta, device)

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def __repr__(self) -> str:
        return f"<Launch {getattr(self.fn, '__name__', self.fn)} grid={self.grid} {'direct' if self.direct else 'triton'}>"

    def __call__(self, stream: torch.cuda.Stream) -> None:
        if self._direct is not None:
            if torch.cuda.current_device() != self.device:  # (the kernel is loaded in its device's context)
                with torch.cuda.device(self.device):
                    return self._direct(*self._every, stream=stream.cuda_stream)
            return self._direct(*self._every, stream=stream.cuda_stream)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self.fn[(self.grid,)](*self.args, **self.meta)


def _compiled(fn: Any, grid: int, args: tuple, meta: dict, device: int) -> tuple:
    """(the compiled kernel's launcher for ``grid``, every argument in the kernel's order), or (None, ())
    where Triton does not give one."""
    options = {k: v for k, v in meta.items() if k.startswith("num_")}  # (launch options, not arguments)
    try:
        bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in meta.items() if k not in options})
        with torch.cuda.device(device):
            kernel = fn.warmup(*args, grid=(grid,), **meta)
            runner = kernel[(grid, 1, 1)]
    except Exception as exc:  # (another Triton: the ordinary launch)
        name = getattr(fn, "__name__", repr(fn))
        if name not in _told:
            _told.add(name)
            log.info("weightsync: %s launches through Triton's launcher: %r", name, exc)
        return None, ()
    return runner, tuple(bound.arguments.values())


def direct_works(device: int) -> bool:
    """Whether a copy kernel launched the direct way copies exactly right on ``device`` (checked once)."""
    with _lock:
        ok = _checked.get(device)
        if ok is None:
            ok = _checked[device] = _check(device)
        return ok


def _check(device: int) -> bool:
    try:
        from .copy_kernel import CopyKernel  # (imports Triton)

        with torch.cuda.device(device):
            src = torch.arange(1, 3 * 65536 + 1, dtype=torch.int32, device=f"cuda:{device}")
            dst = torch.zeros_like(src)
            spans = [(0, 1000), (1024, 40960), (50000, 50004), (60000, 190000)]  # (words: several pieces)
            copies = [(dst.data_ptr() + 4 * a, src.data_ptr() + 4 * a, 4 * (b - a)) for a, b in spans]
            stream = torch.cuda.Stream(device)
            kernel = CopyKernel(copies, device, direct=True)
            if not kernel.launcher.direct:
                return False  # (its warmup failed: ``_compiled`` said why)
            kernel.launch(stream)
            stream.synchronize()
            want = torch.zeros_like(src)
            for a, b in spans:
                want[a:b] = src[a:b]
            ok = bool(torch.equal(dst, want))
    except Exception as exc:
        log.warning("weightsync: launching compiled kernels directly failed on cuda:%d (%r): Triton's launcher "
                    "it is", device, exc)
        return False
    if not ok:
        log.warning("weightsync: a copy kernel launched directly on cuda:%d copied wrong bytes: Triton's "
                    "launcher it is", device)
    return ok
