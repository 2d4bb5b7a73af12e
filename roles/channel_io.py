"""A ZeroMQ socket driven straight from the event loop: the control channel's sends and receives.

How this works. ``zmq.asyncio`` gives every send and receive a future of its own and its own poll
state; on a round of small control messages that bookkeeping was most of a hop's Python time
(``bench/diagnostics/round_in_process.py --profile``, docs/TRANSPORTS.md). ``Pump``
drives a plain socket instead: a send goes out at once without blocking (``NOBLOCK``; ZeroMQ takes a
multipart message whole or not at all) and only one that finds no room waits, in order, in ``outbox``;
received messages go to ``inbox``, and ``recv`` waits on one future while it is empty.

ZeroMQ's descriptor (``ZMQ_FD``) is edge-triggered and only a hint: it signals when the socket's state
may have changed, and any send or receive on the socket can consume that signal. So ``pump`` (run when
the descriptor is readable, after every send, and before ``recv`` waits) reads ``ZMQ_EVENTS`` and
moves messages in and out until nothing moves; reading the events is what re-arms the descriptor.
``inbox`` holds at most ``max_inbox`` messages; beyond that ZeroMQ's own queue and high-water mark hold
the rest (``recv`` pumps again once the inbox is empty). ``close`` cancels what still waits, as closing a
``zmq.asyncio`` socket does.

Session streams (``roles.channel_stream``) put what they read into the same inbox (``deliver``), so the
owner reads one sequence; ``pump`` also calls each ``sources`` hook (a stream that stopped reading while
the inbox was full reads again), and a ROUTER's stream that ends puts its exception there (``end``).
``broken``: once set (the session's stream closed), ``recv`` raises it
when the inbox is empty; ``socket_done``: the socket is left alone (a DEALER's session moved to its stream).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Optional

import zmq

# (plain ints: the enum flags cost a call to enum code on every test, a pump reads them many times a message)
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class Pump:
    def __init__(self, raw: zmq.Socket, max_inbox: int = 1024) -> None:
        self.raw, self.max_inbox = raw, max_inbox
        self.inbox: collections.deque = collections.deque()  # received multipart messages (lists of bytes)
        self.taken = 0  # messages moved from the socket into ``inbox`` so far
        self.outbox: collections.deque = collections.deque()  # (frames, future): sends waiting for room, in order
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.fd: Optional[int] = None
        self.waiter: Optional[asyncio.Future] = None
        self.closed = False
        self.sources: list = []  # hooks ``pump`` calls: streams that deliver here (``deliver``)
        self.broken: Optional[BaseException] = None  # raised by ``recv`` once the inbox is empty
        self.socket_done = False  # a DEALER whose session moved to a stream: its socket carries nothing more

    def __repr__(self) -> str:
        return f"<Pump inbox={len(self.inbox)} outbox={len(self.outbox)}{' closed' if self.closed else ''}>"

    def _attach(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching the socket (a socket used from a later loop moves to it)."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop and not self.closed:
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
            self.loop, self.fd = loop, self.raw.getsockopt(zmq.FD)
            loop.add_reader(self.fd, self.pump)
        return loop

    def send(self, frames: list) -> asyncio.Future:
        """Hand ``frames`` (one multipart message) to the socket: the future completes when it took them."""
        sending = self._attach().create_future()
        if self.closed:
            sending.cancel()
            return sending
        if self.outbox:  # (behind earlier sends still waiting: order is kept)
            self.outbox.append((frames, sending))
        else:
            try:
                self.raw.send_multipart(frames, _NOBLOCK, copy=False)
            except zmq.Again:
                self.outbox.append((frames, sending))
            except zmq.ZMQError as exc:
                sending.set_exception(exc)
            else:
                sending.set_result(None)
        self.pump()  # (the send may have consumed the descriptor's signal)
        return sending

    def room(self) -> bool:
        """Whether the inbox takes more (a stream reads only while it does)."""
        return len(self.inbox) < self.max_inbox

    def deliver(self, frames: list) -> None:
        """A message read elsewhere (a session stream), after those already in the inbox."""
        self.inbox.append(frames)
        self.taken += 1
        self.wake()

    def end(self, ended: BaseException) -> None:
        """A session's stream ended: ``recv`` raises ``ended`` in its turn, after what came before it."""
        self.inbox.append(ended)
        self.wake()

    def wake(self) -> None:
        """Wake a waiting ``recv`` (a message came, or ``broken`` was set)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def recv(self) -> list:
        """The next message (a list of frames, bytes)."""
        self._attach()
        if not self.inbox:
            self.pump()
        while not self.inbox:
            if self.closed:
                raise asyncio.CancelledError()
            if self.broken is not None:
                raise self.broken
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.inbox.popleft()

    def pump(self) -> None:
        """Move messages in and out until nothing moves (reading the events re-arms the descriptor)."""
        if self.closed:
            return
        raw, outbox = self.raw, self.outbox
        while not self.socket_done:
            events = raw.getsockopt(_EVENTS)
            moved = False
            if events & _POLLIN and len(self.inbox) < self.max_inbox:
                self.inbox.append(raw.recv_multipart(_NOBLOCK))
                self.taken += 1
                moved = True
            while outbox and outbox[0][1].done():  # (cancelled while waiting: dropped whole)
                outbox.popleft()
            if outbox and events & _POLLOUT:
                frames, sending = outbox[0]
                try:
                    raw.send_multipart(frames, _NOBLOCK, copy=False)
                except zmq.Again:
                    pass
                except zmq.ZMQError as exc:
                    outbox.popleft()
                    sending.set_exception(exc)
                    moved = True
                else:
                    outbox.popleft()
                    sending.set_result(None)
                    moved = True
            if not moved:
                break
        for source in self.sources:
            source()
        if self.inbox and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        """Stop watching the socket (before it closes) and cancel every send and receive still waiting."""
        if self.closed:
            return
        self.closed = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        for _, sending in self.outbox:
            sending.cancel()
        self.outbox.clear()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.cancel()
