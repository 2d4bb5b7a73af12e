"""The control channel: a ZeroMQ socket speaking ``wire`` envelopes. The only place zmq meets wire.

How this works: ``ControlChannel`` wraps a ZeroMQ ROUTER (controller, daemon) or DEALER (worker, CLI)
socket, driven from the event loop by ``channel_io.Pump`` (``sock``, a ``zmq.asyncio`` socket, is there
for options and monitoring; the channel's own sends and receives never go through its futures).
``send`` numbers messages, encodes them and, on a ROUTER, prefixes the peer's routing id. ``recv``
returns (routing id or None, envelope); frames that do not decode raise the wire's ``ProtocolError``
with the routing id attached, so the owner can answer and carry on.

With an ``auth_key`` the connection itself is authenticated and encrypted with ZeroMQ CURVE: the
binding side is the CURVE server, the connecting side its client, and both key pairs are derived from
the one shared key (``curve_keys``), so configuration stays one secret. A peer without the key cannot
complete the handshake (it does not know the server's public key, and the ZAP handler admits only
the derived client key), so it can neither send a message (a replay from a new connection included)
nor receive one (a hijacked routing id included), and a passive observer sees only ciphertext (the
plans' data-plane keys included). Refused handshakes are counted (``refused``) and logged once per
address and window (``engine.logs.Repeats``). Every control packet carries DSCP ``dscp`` (default CS6,
network control), so a link that schedules by class keeps heartbeats and verdicts ahead of a data
plane that fills it (a TCP data plane shares the link unmarked). On top, every message is signed and verified
(``weightsync.wire.auth``) and each peer's message ids must increase: an unauthenticated or replayed
message raises ``Unauthenticated`` / ``Replayed`` and is never handed to the owner's handlers. Every
socket is created with linger 0 and closed by ``close``.

Session streams (``roles.channel_stream``, docs/PROTOCOL.md *Session streams*): a ROUTER that
``listen_stream``s issues a token per session (``expect``); what it sends that session from then on
waits until the session's stream attaches, then goes there, and what the stream brings reaches ``recv``
as if from the ROUTER. A DEALER that ``attach``es sends and receives on its stream from then on, and
``recv`` raises ``StreamClosed`` once the stream closed and nothing is left to read; a ROUTER's ``recv``
raises ``StreamEnded`` (naming the routing id) where a session's stream closed from the other side or on
the way, after every message that stream brought. Messages on a
stream are signed, numbered and checked exactly as on the socket; with a key the stream itself is
authenticated and encrypted (``wire.stream``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import secrets
from typing import Optional

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from weightsync.engine.logs import Repeats
from weightsync.roles.channel_io import Pump
from weightsync.roles.channel_stream import StreamClosed, StreamEnded, Streams
from weightsync.wire import DEFAULT_LIMITS, Envelope, Limits, Message, decode, encode
from weightsync.wire import messages as m
from weightsync.engine.aio import Waiters, within
from weightsync.engine.errors import ConfigError, ControllerLost
from weightsync.engine.transport import is_loopback
from weightsync.wire.auth import MIN_KEY_BYTES, ReplayGuard, sign, verify
from weightsync.wire.errors import ProtocolError

log = logging.getLogger("weightsync")

ZAP_DOMAIN = "weightsync"
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def endpoint_host(addr: str) -> Optional[str]:
    """The host of a ZeroMQ tcp:// endpoint (brackets kept off an IPv6 one); None for any other."""
    if not addr.startswith("tcp://"):
        return None
    host = addr.removeprefix("tcp://").rpartition(":")[0]
    return host.strip("[]") if host and host != "*" else "0.0.0.0"


def random_identity(prefix: str) -> bytes:
    return f"{prefix}/{os.getpid()}/{secrets.token_hex(4)}".encode()


CONTROL_DSCP = 48  # CS6, "network control": a network that schedules by DSCP sends heartbeats first


def check_dscp(field: str, dscp: int) -> None:
    """A DSCP is an int in 0..63 (0 leaves packets unmarked)."""
    if not isinstance(dscp, int) or isinstance(dscp, bool) or not 0 <= dscp <= 63:
        raise ConfigError(field, f"a DSCP is an int in 0..63, got {dscp!r}")


def check_auth_key(key: Optional[bytes]) -> None:
    """An auth key is bytes of at least ``MIN_KEY_BYTES`` (or None: no authentication)."""
    if key is None:
        return
    if not isinstance(key, bytes):
        raise ConfigError("auth_key", f"must be bytes, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError("auth_key", f"needs at least {MIN_KEY_BYTES} bytes, got {len(key)} "
                          f"(make one with: head -c 32 /dev/urandom > key)")


def check_exposure(field: str, where: str, key: Optional[bytes]) -> None:
    """A socket bound where other hosts reach it (``where``: a host, or a ZeroMQ tcp endpoint) needs an
    auth key: ``ConfigError`` naming ``field`` otherwise. ipc:// and inproc:// endpoints are local."""
    if key is not None or where.startswith(("ipc://", "inproc://")):
        return
    host = where.removeprefix("tcp://").rpartition(":")[0] if where.startswith("tcp://") else where
    if not is_loopback(host):
        raise ConfigError(field, f"{where!r} is reachable from other hosts: give an auth key (--auth-key-file), "
                          f"or bind loopback")


def curve_keys(auth_key: bytes) -> dict[str, bytes]:
    """The CURVE key pairs of the shared key (z85): the binding side's (``server_public``,
    ``server_secret``) and the connecting side's (``client_public``, ``client_secret``). Each secret is
    an HMAC-SHA256 of the shared key under its own label; neither reveals the shared key."""
    out = {}
    for side in ("server", "client"):
        secret = z85.encode(hmac.digest(auth_key, f"weightsync-curve-{side}".encode(), hashlib.sha256))
        out[f"{side}_secret"], out[f"{side}_public"] = secret, zmq.curve_public(secret)
    return out


class _AllowDerivedClient:
    """The ZAP handler's verdict: only the client key derived from the shared key joins."""

    def __init__(self, client_public: bytes, refused: Repeats) -> None:
        self.client_public = client_public
        self.refused = refused

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        self.refused.log(("zap", key), f"control channel: refused a CURVE client key {key[:8]!r}... (not the shared key's)")
        return False


class ControlChannel:
    def __init__(self, kind: int, name: str, *, limits: Limits = DEFAULT_LIMITS,
                 identity: Optional[bytes] = None, auth_key: Optional[bytes] = None,
                 dscp: int = CONTROL_DSCP) -> None:
        check_dscp("dscp", dscp)
        self.ctx = zmq.asyncio.Context()  # one per channel: closing the channel terminates it
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.TOS, dscp << 2)  # (the DS field's upper six bits; set before bind/connect)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + 4096)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.router = kind == zmq.ROUTER
        check_auth_key(auth_key)
        self.auth_key = auth_key
        self.keys = curve_keys(auth_key) if auth_key is not None else None
        self.replays = ReplayGuard()
        self.name = name
        self.limits = limits
        self._ids = itertools.count(1)
        self.sent = 0
        self.received = 0
        self.refused = 0  # connections that failed the CURVE handshake or the ZAP check (binding side)
        self.refusals = Repeats(log)
        self._authenticator = None
        self._monitor: Optional[asyncio.Task] = None
        self._monitor_sock: Optional[zmq.asyncio.Socket] = None
        self._waiters = Waiters()
        self._io = Pump(zmq.Socket.shadow(self.sock.underlying))  # (sends and receives: ``channel_io``)
        self.streams = Streams(self._io, name, auth_key, dscp, limits.max_message_bytes + 4096 + 64,
                               self._stream_refused)  # (session streams: ``roles.channel_stream``)

    def __repr__(self) -> str:
        kind = "ROUTER" if self.router else "DEALER"
        secure = " curve" if self.keys else ""
        streams = f" streams={len(self.streams.links)}" if self.streams.links or self.streams.listener else ""
        return (f"<ControlChannel {kind}{secure} {self.name} sent={self.sent} received={self.received}"
                f" refused={self.refused}{streams}>")

    def listen_stream(self, host: str, port: int = 0) -> int:
        """A ROUTER's listener for session streams on ``host`` (the one it binds) and ``port`` (0: any): its port."""
        return self.streams.listen(host, port, self._waiters.wake)

    def expect(self, identity: bytes, token: bytes) -> None:
        """``identity``'s stream will come with ``token``; what is sent it waits for that stream from now on."""
        self.streams.expect(identity, token)

    async def attach(self, host: str, port: int, token: bytes, timeout: float) -> None:
        """A DEALER's session moves to its stream: every send and receive from now on."""
        await self.streams.attach(host, port, token, timeout)

    async def attach_to(self, controller_addr: str, welcome: m.Welcome, timeout: float) -> None:
        """``attach`` to the stream ``welcome`` names, on the host ``controller_addr`` reached; a stream that
        cannot be made raises ``ControllerLost`` (logged: the worker joins again on ZeroMQ alone)."""
        host = endpoint_host(controller_addr) or "127.0.0.1"
        try:
            await self.attach(host, welcome.stream_port, welcome.stream_token, timeout)
        except (OSError, ProtocolError, asyncio.TimeoutError) as exc:
            log.warning("%s: session stream to %s:%s failed (%r): joining again on ZeroMQ alone",
                        self.name, host, welcome.stream_port, exc)
            raise ControllerLost(f"session stream to {host}:{welcome.stream_port} failed: {exc!r}") from exc

    async def wait_attached(self, identity: bytes) -> None:
        """Until ``identity``'s session stream has attached (a ROUTER's)."""
        await self._waiters.wait(lambda: identity in self.streams.links)

    def _stream_refused(self, where: str, why: str) -> None:
        self.refused += 1
        self._waiters.wake()
        self.refusals.log(("stream", where), f"control channel {self.name}: refused a session stream from {where}: {why}")

    def bind(self, addr: str) -> str:
        """Bind; with a key, as the CURVE server behind a ZAP handler that admits the derived client
        key only (the authenticator runs on this channel's context, in the event loop)."""
        if self.keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._authenticator = AsyncioAuthenticator(self.ctx, log=logging.getLogger("weightsync.zap"))
            self._authenticator.start()
            self._authenticator.configure_curve_callback(
                ZAP_DOMAIN, _AllowDerivedClient(self.keys["client_public"], self.refusals))
            self.sock.curve_server = True
            self.sock.curve_secretkey = self.keys["server_secret"]
            self.sock.zap_domain = ZAP_DOMAIN.encode()
            self._monitor_sock = self.sock.get_monitor_socket(_FAILED)
            self._monitor = asyncio.ensure_future(self._watch(self._monitor_sock))
        self.sock.bind(addr)
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, addr: str) -> None:
        if self.keys is not None:
            self.sock.curve_serverkey = self.keys["server_public"]
            self.sock.curve_publickey = self.keys["client_public"]
            self.sock.curve_secretkey = self.keys["client_secret"]
        self.sock.connect(addr)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Count and log (aggregated per address) every connection whose handshake failed: a peer
        without the key, a replay of captured bytes, a client key the ZAP handler refused."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.ZMQError:  # (the monitor closed)
                return
            self.refused += 1
            self._waiters.wake()
            where = event.get("endpoint", b"?")
            where = where.decode(errors="replace") if isinstance(where, bytes) else str(where)
            self.refusals.log(("handshake", where),
                              f"control channel {self.name}: refused a connection at {where}: "
                              f"handshake failed (event {event['event']}, error {event['value']}): no shared key")

    async def wait_refused(self, count: int) -> None:
        """Until ``count`` connections have been refused at the handshake (binding side, with a key)."""
        await self._waiters.wait(lambda: self.refused >= count)

    async def send(self, body: Message, *, to: Optional[bytes] = None, version: Optional[int] = None,
                   parent_id: Optional[int] = None, body_frame: Optional[bytes] = None,
                   timeout: Optional[float] = None) -> int:
        """``body_frame``: ``encode_body(body)`` made beforehand (off the event loop). With ``timeout``,
        a message not queued within that many seconds is dropped with ``zmq.Again``: a DEALER whose
        only connection ended in a failed handshake (a key or mechanism mismatch) has no pipe left, a
        send there waits forever, and every later send (pyzmq queues them) waits behind it."""
        msg_id, sending = self._queue(body, to, version, parent_id, body_frame)
        if timeout is None:
            await sending
        else:
            try:  # (cancelling a queued send takes it out of the queue whole)
                await within(sending, timeout)
            except asyncio.TimeoutError:
                log.debug("%s: %s not queued within %.2fs (no connection)", self.name, body.TYPE, timeout)
                raise zmq.Again() from None
        self.sent += 1
        return msg_id

    def post(self, body: Message, *, to: Optional[bytes] = None, version: Optional[int] = None,
             parent_id: Optional[int] = None, body_frame: Optional[bytes] = None) -> asyncio.Future:
        """``send`` without waiting, for a message that must leave now rather than when a task gets its
        turn: ZeroMQ takes it during this call (or, where earlier sends still wait for room, queues it
        behind them, in order); the future completes when it is taken (await it for a failure)."""
        _, sending = self._queue(body, to, version, parent_id, body_frame)
        sending.add_done_callback(self._posted)
        return sending

    def _posted(self, sending: asyncio.Future) -> None:
        if not sending.cancelled() and sending.exception() is None:
            self.sent += 1

    def _queue(self, body: Message, to: Optional[bytes], version: Optional[int], parent_id: Optional[int],
               body_frame: Optional[bytes]) -> tuple[int, asyncio.Future]:
        """Encode, sign and hand ``body`` to the socket: (its message id, the socket's send future)."""
        msg_id = next(self._ids)
        frames = encode(Envelope(body, msg_id, self.name, parent_id, version), self.limits, body_frame)
        if self.auth_key is not None:
            frames = sign(frames, self.auth_key)
        if self.streams.route(to if self.router else b"", frames):
            taken = asyncio.get_running_loop().create_future()
            taken.set_result(None)  # (a closed stream drops it, as ZeroMQ drops what goes to a peer gone)
            return msg_id, taken
        if self.router:
            if to is None:
                raise ValueError("a ROUTER send needs the peer's routing id")
            frames = [to, *frames]
        return msg_id, self._io.send(frames)

    def delivered(self) -> int:
        """How many messages this channel has taken from its socket, once it has taken every one delivered
        to the process by now; ``recv`` hands them out in that order (``received`` counts those)."""
        self._io.pump()
        self.streams.pump()  # (bytes a held loop left in the kernel's buffer)
        return self._io.taken

    async def recv(self) -> tuple[Optional[bytes], Envelope]:
        frames = await self._io.recv()
        if isinstance(frames, StreamEnded):  # (a session's stream ended: after what it delivered)
            raise frames
        self.received += 1
        peer = None
        if self.router:
            peer, frames = frames[0], frames[1:]
        try:
            if self.auth_key is not None:
                frames = verify(frames, self.auth_key)
            env = decode(frames, self.limits)
            if self.auth_key is not None:
                self.replays.check(peer or b"", env.msg_id)
            return peer, env
        except ProtocolError as exc:
            exc.peer = peer  # type: ignore[attr-defined]
            raise

    def forget(self, peer: bytes) -> None:
        """A peer's session is over: drop what was kept for it (its replay guard entry, its stream)."""
        self.replays.forget(peer)
        self.streams.forget(peer)

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor_sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.refusals.flush()
        self.streams.close()
        self._io.close()
        self.sock.close(linger=0)
        self.ctx.term()
