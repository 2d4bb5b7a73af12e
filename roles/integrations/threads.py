"""Running weightsync beside code that is not async: a background event loop and a generation gate.

How this works. An inference engine's worker (vLLM's) or a plain generation loop owns its thread and
calls the model synchronously. ``BackgroundLoop`` runs an asyncio loop in a daemon thread of the same
process; a ``WeightReceiver`` lives there, and the owning thread talks to it through ``call`` (run a
coroutine there, wait for its result with a watchdog timeout).

``GenerationGate`` keeps generation and in-place updates apart. An in-place receiver writes into the
live parameters between ``begin`` and ``commit``; the gate's ``before_update`` (given to the receiver)
takes the gate, waiting for the forward pass in progress to finish, and ``after_update`` gives it back
at commit or abort. Generation runs each forward pass inside ``with gate:`` (or through ``wrap``): a pass
sees one whole version, never a half-applied one, and generation resumes as soon as the round ends.
Where several processes generate in lockstep (tensor parallel), a per-process gate could close on one
rank between two steps while another is inside a step waiting for it; there generation holds the gate
(``hold``) and gives it up only while it waits for a version (``release``): updates land between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio event loop in a daemon thread. ``call(coro_fn, ...)`` runs there and returns its result."""

    def __init__(self, name: str = "weightsync-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "running" if self._thread.is_alive() else "closed"
        return f"<BackgroundLoop {self._thread.name} {state}>"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> "concurrent.futures.Future[T]":
        """Start ``fn(*args)`` on the loop; returns a thread-safe future."""
        async def runner() -> T:
            return await fn(*args)
        return asyncio.run_coroutine_threadsafe(runner(), self.loop)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: Optional[float] = None) -> T:
        """Run ``fn(*args)`` on the loop and wait for it (``timeout`` is a watchdog: TimeoutError)."""
        future = self.submit(fn, *args)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not finish within {timeout} s") from None

    def close(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


class GenerationGate:
    """A mutex between forward passes and in-place updates, with counters for ``status``.

    ``hold_on_abort``: after an aborted round the parameters are half written, so the gate stays closed
    (generation waits) until a later round commits or ``open`` is called. ``windows``: generation holds
    the gate and lends it only through ``open_window(v)`` .. ``close_window()``, and only to updates of
    versions up to ``v`` (a later round waits for the next window, never for a generation step)."""

    def __init__(self, hold_on_abort: bool = True, windows: bool = False) -> None:
        self.hold_on_abort = hold_on_abort
        self.windows = windows  # updates only inside a window that generation opens (``open_window``)
        self._window: Optional[int] = None  # the newest version that may land in the open window
        self._cv = threading.Condition()
        self._lock = threading.Lock()
        self._held_for: Optional[int] = None  # the version an update holds the gate for
        self.updates = 0  # rounds that held the gate
        self.passes = 0  # forward passes that went through
        self.paused_s = 0.0  # total time updates held the gate
        self._since = 0.0

    def __repr__(self) -> str:
        held = f"held for v{self._held_for}" if self._held_for is not None else "open"
        return f"<GenerationGate {held} updates={self.updates} passes={self.passes} paused={self.paused_s:.3f}s>"

    @property
    def held(self) -> bool:
        return self._held_for is not None

    def hold(self, timeout: Optional[float] = None) -> None:
        """Generation takes the gate (waits while an update holds it; ``timeout`` is a watchdog)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            state = "an aborted round left the model half written" if self._held_for is not None else "busy"
            raise TimeoutError(f"generation gate not free within {timeout} s ({state})")
        self.passes += 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "GenerationGate":
        self.hold()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` that runs inside the gate (for a model's ``forward``)."""
        def gated(*args: Any, **kwargs: Any) -> T:
            with self:
                return fn(*args, **kwargs)
        gated.__wrapped__ = fn  # type: ignore[attr-defined]
        return gated

    async def before_update(self, version: int) -> None:
        """The receiver's ``before_update``: wait for the pass in progress (or, with ``windows``, for a
        window that admits ``version``), then hold the gate."""
        if self._held_for is not None:  # still closed after an aborted round
            self._held_for = version
            return
        cancelled = threading.Event()
        taken = asyncio.get_running_loop().run_in_executor(None, self._take, version, cancelled)
        try:
            await asyncio.shield(taken)
        except asyncio.CancelledError:  # the round ended while we waited: give the gate back if we got it
            cancelled.set()
            with self._cv:
                self._cv.notify_all()
            taken.add_done_callback(lambda f: f.result() and self._lock.release())
            raise
        self._held_for = version
        self._since = time.perf_counter()

    def _take(self, version: int, cancelled: threading.Event) -> bool:
        if self.windows:
            with self._cv:
                self._cv.wait_for(lambda: cancelled.is_set() or (self._window is not None and version <= self._window))
        if cancelled.is_set():
            return False
        self._lock.acquire()
        if cancelled.is_set():
            self._lock.release()
            return False
        return True

    def open_window(self, version: int, release: bool = True) -> None:
        """(``windows``) Let updates up to ``version`` land; ``release``: generation gives the gate up now."""
        with self._cv:
            self._window = version
            self._cv.notify_all()
        if release:
            self.release()

    def close_window(self) -> None:
        """(``windows``) No further update may start; one in progress finishes (``hold`` waits for it)."""
        with self._cv:
            self._window = None

    def after_update(self, version: int, ok: bool) -> None:
        """The receiver's ``after_update`` (commit or abort): generation resumes, unless the round
        aborted and ``hold_on_abort``."""
        if self._held_for is None or (not ok and self.hold_on_abort):
            return
        self.open()

    def open(self) -> None:
        """Release the gate now (after a commit, or to serve a half-written model on purpose)."""
        if self._held_for is None:
            return
        self._held_for = None
        self.updates += 1
        self.paused_s += time.perf_counter() - self._since
        self._lock.release()
