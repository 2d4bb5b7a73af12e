"""A worker's heartbeats from a thread of its own: its session lives while the caller holds the event loop.

How this works. A trainer's step is most often synchronous compute between two pushes, seconds to
minutes long, and while it runs the worker's event loop runs nothing: its heartbeats stop, and a
controller drops a worker it has not heard for ``timeout_s`` (5 s by default). So, where the
controller's ``welcome`` offers the capability ``pulse`` (docs/PROTOCOL.md, *Heartbeats*), each
session also starts a ``Pulse``: a thread with a DEALER socket of its own, whose routing id is the
session's followed by ``+pulse``, that reads nothing and sends ``heartbeat`` every ``heartbeat_ms``
while the loop's own heartbeat task has missed two of its beats (``beat``: a loop that runs adds no
messages; signed like every message where there is a key, over CURVE like the session's own socket). The
controller takes such a heartbeat as a sign of life of the session whose routing id it extends, when it
names that session's worker, and answers nothing. The thread ends with the session (``stop``), once
the session's loops are over (``alive``: a receive loop that ended, or was cancelled), and with the
process: a killed worker falls silent as before. The pulse says the process lives, not that its
loop does: a round that needs the worker waits for the loop as it always did (``round_timeout_s``).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional

import zmq

from weightsync.wire import Envelope, Limits, encode
from weightsync.wire import messages as m
from weightsync.wire.auth import sign

from .channel import curve_keys

SUFFIX = b"+pulse"  # a pulse's routing id: the session's, then this


class Pulse:
    def __init__(self, addr: str, identity: bytes, name: str, period_s: float, *, limits: Limits,
                 auth_key: Optional[bytes] = None, dscp: int = 0, alive: Callable[[], bool] = lambda: True) -> None:
        self.addr, self.identity, self.name, self.period_s = addr, identity + SUFFIX, name, period_s
        self.alive = alive  # (read from the thread: the session's loops are not over)
        self.limits, self.auth_key, self.dscp = limits, auth_key, dscp
        self.sent = 0
        self.beaten = time.monotonic()  # when the loop's own heartbeat task last ran (``beat``)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-pulse-{name}", daemon=True)

    def __repr__(self) -> str:
        return f"<Pulse {self.name} every {self.period_s}s sent={self.sent}{' stopped' if self._stop.is_set() else ''}>"

    def start(self) -> "Pulse":
        self._thread.start()
        return self

    def beat(self) -> None:
        """The loop's own heartbeat ran: no pulse is needed until it misses two."""
        self.beaten = time.monotonic()

    def stop(self) -> None:
        """Stop sending; returns once the thread has closed its socket (it wakes at once)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _socket(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.TOS, self.dscp << 2)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.SNDHWM, 4)  # (a controller not reading: a few pulses queue, the rest are dropped)
        if self.auth_key is not None:
            keys = curve_keys(self.auth_key)
            sock.curve_serverkey = keys["server_public"]
            sock.curve_publickey = keys["client_public"]
            sock.curve_secretkey = keys["client_secret"]
        sock.connect(self.addr)
        return sock

    def _run(self) -> None:
        ctx = zmq.Context(io_threads=1)
        sock = self._socket(ctx)
        ids = itertools.count(1)
        try:
            while not self._stop.wait(self.period_s) and self.alive():
                if time.monotonic() - self.beaten < 2 * self.period_s:
                    continue  # (the loop beats: nothing to add)
                frames = encode(Envelope(m.Heartbeat(self.sent + 1), next(ids), self.name, None, None), self.limits)
                if self.auth_key is not None:
                    frames = sign(frames, self.auth_key)
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:  # (no connection yet, or its queue is full)
                    pass
        finally:
            sock.close(0)
            ctx.term()
