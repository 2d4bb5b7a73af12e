"""A TCP listener whose close never strands a connection it accepted.

How this works: asyncio's own server (``loop.create_server``) accepts a connection in one loop step and
builds its transport in a task of its own; if the server closes in between, that task fails on the
closed server (CPython 3.11: ``Server._attach`` asserts that it is open), the error is dropped unless
the loop runs in debug mode, and the accepted socket stays open and silent until a garbage collection
frees it. The peer that connected then waits for a first byte that never comes (a weightsync sender,
its whole ``connect_timeout_s``). ``Listener`` accepts in a reader callback of its own, closes at once
what it accepts once closing, and hands every other connection to ``loop.connect_accepted_socket``,
which needs no server: its protocol is made and connected whatever happens to the listener after, and
a protocol that sees its owner closing closes it (``tcp_agent.AgentProtocol.connection_made``). A peer
connecting while the listener closes therefore always hears a reset or an end of stream.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Optional

log = logging.getLogger("weightsync")

BACKLOG = 128


class Listener:
    def __init__(self, protocol_factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self.protocol_factory = protocol_factory
        self.sock: Optional[socket.socket] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.closing = False
        self.accepted = 0
        self.closed_at_accept = 0  # connections accepted while closing, closed at once
        self._handing: set[asyncio.Future] = set()  # connections being handed to their protocol

    def __repr__(self) -> str:
        where = "%s:%s" % self.sock.getsockname()[:2] if self.sock is not None else "not listening"
        return (f"<Listener {where} accepted={self.accepted} handing={len(self._handing)} "
                f"closed_at_accept={self.closed_at_accept} closing={self.closing}>")

    def start(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: any free port) from the running loop; returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (as an initiator dials: ``tcp_connect``)
        address = socket.getaddrinfo(host.strip("[]"), port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (IPv6 only, as asyncio's servers bind it)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock, self.loop = sock, asyncio.get_running_loop()
        self.loop.add_reader(sock.fileno(), self._accept)
        return sock.getsockname()[1]

    def _accept(self) -> None:
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # (out of descriptors, say: the connection waits in the backlog for the next try)
                log.warning("listener %r: accept failed: %s", self, exc)
                return
            if self.closing:
                self.closed_at_accept += 1
                conn.close()
                continue
            self.accepted += 1
            conn.setblocking(False)
            handing = asyncio.ensure_future(self.loop.connect_accepted_socket(self.protocol_factory, conn))
            self._handing.add(handing)
            handing.add_done_callback(self._handed)

    def _handed(self, handing: asyncio.Future) -> None:
        self._handing.discard(handing)
        if not handing.cancelled() and handing.exception() is not None:
            log.warning("listener %r: an accepted connection got no transport: %r", self, handing.exception())

    def close(self) -> None:
        """Stop listening: connections not yet accepted are reset by the kernel, and any accepted from
        here on are closed; each one accepted before is its protocol's to close."""
        self.closing = True
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
