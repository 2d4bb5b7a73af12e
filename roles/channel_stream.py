"""Session streams: a session's control messages on a TCP connection of its own, driven from the event loop.

How this works. A ZeroMQ hop passes the sending process's I/O thread and the receiving one's, each
woken from sleep; a plain stream is read and written by the event loops themselves (one H100: a round
trip of 174 us against 38 back to back, docs/TRANSPORTS.md). So after ``welcome`` a worker that offered
the capability ``stream`` dials the port the welcome names and the session's messages go there, both
ways, for the rest of the session (docs/PROTOCOL.md, *Session streams*; the bytes: ``wire.stream``).

- ``Listener`` (the controller's channel): a listening socket on the host it binds. Each connection
  does the handshake (``handshake_s`` at most), then its first record must be a token the channel
  issued (``expect``) and not yet used; the connection then carries that routing id's session, and its
  messages reach the channel's inbox as if from the ROUTER (``[routing id, *frames]``). A connection
  that fails any of it is closed and counted (``refused``).
- ``dial`` (a worker's channel): connects, does the client's half and sends the token.
- ``Link``: one connection past its handshake, on a non-blocking socket the loop watches. ``send``
  writes at once and keeps what the kernel did not take for when the socket is writable; ``pump`` reads
  what has arrived, opens each record and hands its frames on (``deliver``). ``pump`` also runs where
  the owner asks what was delivered (``ControlChannel.delivered``): bytes a held loop left in the
  kernel's buffer are read then, as ZeroMQ's I/O thread would have. A closed peer, a record that does
  not open or does not parse, or a write error closes the link (``on_closed``, once).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Optional

from weightsync.engine.aio import within
from weightsync.roles.channel_io import Pump
from weightsync.wire import stream as ws
from weightsync.wire.errors import ProtocolError

log = logging.getLogger("weightsync")

_READ = 1 << 16


def _tune(sock: socket.socket, dscp: int) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if dscp:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)


async def _read_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return bytes(data)


class Link:
    def __init__(self, sock: socket.socket, send_key: Optional[bytes], recv_key: Optional[bytes], max_record: int,
                 deliver: Callable[[list], None], on_closed: Callable[["Link", str], None], name: str,
                 room: Callable[[], bool] = lambda: True, opener: Optional[ws.Sealer] = None) -> None:
        self.sock, self.name = sock, name
        sock.setblocking(False)
        self.sealer, self.opener = ws.Sealer(send_key), opener if opener is not None else ws.Sealer(recv_key)
        self.framer = ws.Framer(max_record)
        self.deliver, self.on_closed, self.room = deliver, on_closed, room
        self.out = bytearray()  # what the kernel did not take yet
        self.sent = self.received = 0
        self.closed: Optional[str] = None
        self.reading = False
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.resume()

    def __repr__(self) -> str:
        state = f" closed ({self.closed})" if self.closed else ""
        return f"<Link {self.name} sent={self.sent} received={self.received} queued={len(self.out)}{state}>"

    def send(self, frames: list) -> bool:
        """Queue one message (its frames); False where the link is closed."""
        if self.closed:
            return False
        data = ws.record(self.sealer.seal(ws.pack(frames)))
        self.sent += 1
        if self.out:
            return self._queue(data)
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self.close(f"write failed: {exc}")
            return False
        if n < len(data):
            self.loop.add_writer(self.fd, self._flush)
            return self._queue(data[n:])
        return True

    def _queue(self, data: bytes) -> bool:
        """Keep what the kernel did not take; a peer that leaves more than a few messages' worth unread
        (a process stopped, or one that reads nothing) has its stream closed."""
        self.out += data
        if len(self.out) > 4 * self.framer.max_record:
            self.close(f"its peer left {len(self.out)} bytes unread")
            return False
        return True

    def _flush(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(f"write failed: {exc}")
            return
        del self.out[:n]
        if not self.out:
            self.loop.remove_writer(self.fd)

    def resume(self) -> None:
        """Watch the socket again (after ``room`` said the owner's inbox was full) and read what waits."""
        if self.closed or self.reading:
            return
        self.reading = True
        self.loop.add_reader(self.fd, self.pump)
        self.pump()

    def pump(self) -> None:
        """Read what has arrived and hand on every whole record (stops while ``room`` says no)."""
        while not self.closed:
            if not self.room():
                self.reading = False
                self.loop.remove_reader(self.fd)
                return
            try:
                data = self.sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"read failed: {exc}")
                return
            if not data:
                self.close("closed by the peer")
                return
            try:
                for sealed in self.framer.feed(data):
                    frames = ws.unpack(self.opener.open(sealed))
                    self.received += 1
                    self.deliver(frames)
            except ProtocolError as exc:
                self.close(f"{type(exc).__name__}: {exc}")
                return
            if len(data) < _READ:  # (it took all there was: the loop's watch says when more comes)
                return

    def close(self, why: str = "closed") -> None:
        if self.closed:
            return
        self.closed = why
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
        try:  # (best effort: what is queued goes, and nothing unread is left, which would make the close a
            #    reset that can discard what the peer has not read yet)
            if self.out:
                self.sock.send(self.out)
            for _ in range(16):
                if not self.sock.recv(_READ):
                    break
        except OSError:
            pass
        self.sock.close()
        self.on_closed(self, why)


async def dial(host: str, port: int, token: bytes, auth_key: Optional[bytes], *, dscp: int, max_record: int,
               deliver: Callable[[list], None], on_closed: Callable[[Link, str], None], name: str,
               timeout: float, room: Callable[[], bool] = lambda: True) -> Link:
    """A worker's side: connect, prove the key, send the session's token; the link."""
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock, dscp)
        key = ws.stream_key(auth_key)

        async def handshake() -> tuple[bytes, bytes]:
            await loop.sock_connect(sock, (host.strip("[]"), port))
            first = ws.opening()
            await loop.sock_sendall(sock, first)
            proof, server_nonce = ws.client_proof(key, first[len(ws.MAGIC):], await _read_exactly(loop, sock, ws.ANSWER_BYTES))
            await loop.sock_sendall(sock, proof)
            return first[len(ws.MAGIC):], server_nonce

        client_nonce, server_nonce = await within(handshake(), timeout)
        keys = ws.direction_keys(key, client_nonce, server_nonce) if auth_key is not None else (None, None)
    except BaseException:
        sock.close()
        raise
    link = Link(sock, keys[0], keys[1], max_record, deliver, on_closed, name, room)
    link.send([token])
    return link


class Listener:
    """The controller's side: accepts session streams for the tokens it issued (``expect``)."""

    def __init__(self, host: str, port: int, auth_key: Optional[bytes], *, dscp: int, max_record: int,
                 attached: Callable[[bytes, Link], None], refused: Callable[[str, str], None],
                 deliver: Callable[[bytes, list], None], closed: Callable[[bytes, Link, str], None],
                 room: Callable[[], bool], handshake_s: float = 5.0, max_pending: int = 1024) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), port))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.key, self.auth_key, self.dscp, self.max_record = ws.stream_key(auth_key), auth_key, dscp, max_record
        self.attached, self.refused, self.deliver, self.closed, self.room = attached, refused, deliver, closed, room
        self.handshake_s, self.max_pending = handshake_s, max_pending
        self.tokens: dict[bytes, bytes] = {}  # token -> routing id, until used
        self.pending: set[asyncio.Task] = set()
        self._accepting = asyncio.ensure_future(self._accept())

    def __repr__(self) -> str:
        return f"<Listener port={self.port} tokens={len(self.tokens)} handshaking={len(self.pending)}>"

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sock)
            except OSError as exc:  # (out of descriptors, most likely: those in their handshake end, then more)
                log.warning("session streams: accept failed: %r", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self.pending) >= self.max_pending:
                conn.close()
                self.refused(str(addr[0]), "too many connections in their handshake")
                continue
            task = asyncio.ensure_future(self._admit(conn, str(addr[0])))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _admit(self, conn: socket.socket, where: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            _tune(conn, self.dscp)

            async def handshake() -> tuple[bytes, bytes, bytes]:
                answer, client_nonce, server_nonce = ws.server_answer(self.key, await _read_exactly(loop, conn, ws.OPENING_BYTES))
                await loop.sock_sendall(conn, answer)
                ws.check_client_proof(self.key, client_nonce, server_nonce, await _read_exactly(loop, conn, ws.PROOF_BYTES))
                keys = ws.direction_keys(self.key, client_nonce, server_nonce) if self.auth_key is not None else (None, None)
                opener = ws.Sealer(keys[0])
                size = 4 + len(ws.pack([bytes(ws.TOKEN_BYTES)])) + (ws.TAG_BYTES if keys[0] is not None else 0)
                sealed = await _read_exactly(loop, conn, size)  # (the token's record alone: the rest is the link's)
                if sealed[:4] != (size - 4).to_bytes(4, "little"):
                    raise ws.Malformed("its first record is not a token")
                return keys, opener, ws.unpack(opener.open(sealed[4:]))

            keys, opener, frames = await within(handshake(), self.handshake_s)
            token = frames[0] if len(frames) == 1 else b""
            identity = self.tokens.pop(token, None)
            if identity is None:
                raise ws.StreamRefused("a token this controller did not issue, or one already used")
        except (ProtocolError, OSError, asyncio.TimeoutError) as exc:
            conn.close()
            self.refused(where, f"{type(exc).__name__}: {exc}")
            return
        except BaseException:
            conn.close()
            raise
        link = Link(conn, keys[1], None, self.max_record, lambda frames: self.deliver(identity, frames),
                    lambda link, why: self.closed(identity, link, why), identity.decode(errors="replace"), self.room,
                    opener=opener)  # (it opened the token: its count goes on)
        self.attached(identity, link)

    def close(self) -> None:
        self._accepting.cancel()
        for task in self.pending:
            task.cancel()
        self.sock.close()


class StreamClosed(ConnectionError):
    """The session's stream closed (the controller went away, or refused or dropped the stream)."""


class StreamEnded(StreamClosed):
    """A session's stream closed from the worker's side or on the way (a ROUTER's ``recv`` raises it
    after every message that stream delivered): ``identity``'s session is over."""

    def __init__(self, identity: bytes, why: str) -> None:
        super().__init__(f"the session's stream {why}")
        self.identity, self.why = identity, why


class Streams:
    """A control channel's session streams (the channel's part): a ROUTER's ``listener`` and a stream per
    routing id in ``links``, or a DEALER's one (``links[b""]``), and where each message goes (``route``)."""

    def __init__(self, io: "Pump", name: str, auth_key: Optional[bytes], dscp: int, max_record: int,
                 refused: Callable[[str, str], None]) -> None:
        self.io, self.name, self.auth_key, self.dscp, self.max_record = io, name, auth_key, dscp, max_record
        self.refused = refused
        self.listener: Optional[Listener] = None  # (a ROUTER's)
        self.links: dict[bytes, Link] = {}  # routing id (a DEALER's own: b"") -> its attached stream
        self.expected: dict[bytes, list] = {}  # routing id -> what was sent it before its stream attached
        self.streaming = False  # (a DEALER that attached: nothing goes by its socket any more)
        self._wake: Callable[[], None] = lambda: None

    def __repr__(self) -> str:
        return f"<Streams {self.name} links={len(self.links)} expected={len(self.expected)}>"

    def listen(self, host: str, port: int, wake: Callable[[], None]) -> int:
        self._wake = wake  # (whoever waits for a stream to attach)
        self.listener = Listener(host, port, self.auth_key, dscp=self.dscp, max_record=self.max_record,
                                 attached=self._attached, refused=self.refused,
                                 deliver=lambda identity, frames: self.io.deliver([identity, *frames]),
                                 closed=self._closed, room=self.io.room)
        return self.listener.port

    def expect(self, identity: bytes, token: bytes) -> None:
        self.listener.tokens[token] = identity
        self.expected[identity] = []

    async def attach(self, host: str, port: int, token: bytes, timeout: float) -> None:
        link = await dial(host, port, token, self.auth_key, dscp=self.dscp, max_record=self.max_record,
                          deliver=self.io.deliver, on_closed=lambda link, why: self._closed(b"", link, why),
                          name=self.name, timeout=timeout, room=self.io.room)
        if link.closed:
            raise StreamClosed(f"the session's stream {link.closed}")
        self.links[b""] = link
        self.streaming = self.io.socket_done = True
        self.io.sources.append(link.resume)

    def _attached(self, identity: bytes, link: Link) -> None:
        waiting = self.expected.pop(identity, None)
        if waiting is None or link.closed:  # (its session ended meanwhile)
            link.close("its session is over")
            return
        self.links[identity] = link
        self.io.sources.append(link.resume)
        for frames in waiting:
            link.send(frames)
        self._wake()

    def _closed(self, identity: bytes, link: Link, why: str) -> None:
        if self.links.get(identity) is link:  # (not ended here: ``forget`` and ``close`` take it out first)
            del self.links[identity]
            log.info("control channel %s: stream of %r %s", self.name, identity, why)
            if not self.streaming:  # (a ROUTER's: the owner hears it after what the stream delivered)
                self.io.end(StreamEnded(identity, why))
        if link.resume in self.io.sources:
            self.io.sources.remove(link.resume)
        if self.streaming:  # (a DEALER's: its session is over)
            self.io.broken = StreamClosed(f"the session's stream {why}")
            self.io.wake()

    def route(self, key: bytes, frames: list) -> bool:
        """Send ``frames`` to ``key``'s stream, or keep them until it attaches: whether it took them (a
        DEALER that attached takes everything: a stream that closed drops it)."""
        if not (self.links or self.expected or self.streaming):
            return False
        link = self.links.get(key)
        if link is not None:
            link.send(frames)
            return True
        waiting = self.expected.get(key)
        if waiting is not None:
            waiting.append(frames)
            return True
        return self.streaming

    def pump(self) -> None:
        for link in list(self.links.values()):
            link.pump()

    def forget(self, identity: bytes) -> None:
        self.expected.pop(identity, None)
        if self.listener is not None:
            self.listener.tokens = {t: i for t, i in self.listener.tokens.items() if i != identity}
        link = self.links.pop(identity, None)
        if link is not None:
            link.close("its session is over")

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        links, self.links = self.links, {}
        for link in links.values():
            link.close("the channel closed")
