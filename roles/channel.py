"""The control channel: a ZeroMQ socket speaking ``wire`` envelopes. The only place zmq meets wire.

How this works: ``ControlChannel`` wraps a ``zmq.asyncio`` ROUTER (controller, daemon) or DEALER
(worker, CLI) socket. ``send`` numbers messages, encodes them and, on a ROUTER, prefixes the peer's
routing id. ``recv`` returns (routing id or None, envelope); frames that do not decode raise the
wire's ``ProtocolError`` with the routing id attached, so the owner can answer and carry on. With an
``auth_key`` every message is signed and verified (``weightsync.wire.auth``) and each peer's message ids must
increase: an unauthenticated or replayed message raises ``Unauthenticated`` / ``Replayed`` and is
never handed to the owner's handlers. Every socket is created with linger 0 and closed by ``close``.
"""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Optional

import zmq
import zmq.asyncio

from weightsync.wire import DEFAULT_LIMITS, Envelope, Limits, Message, decode, encode
from weightsync.wire.auth import ReplayGuard, sign, verify
from weightsync.wire.errors import ProtocolError


def random_identity(prefix: str) -> bytes:
    return f"{prefix}/{os.getpid()}/{secrets.token_hex(4)}".encode()


class ControlChannel:
    def __init__(self, kind: int, name: str, *, limits: Limits = DEFAULT_LIMITS,
                 identity: Optional[bytes] = None, auth_key: Optional[bytes] = None) -> None:
        self.ctx = zmq.asyncio.Context()  # one per channel: closing the channel terminates it
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + 4096)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.router = kind == zmq.ROUTER
        self.auth_key = auth_key
        self.replays = ReplayGuard()
        self.name = name
        self.limits = limits
        self._ids = itertools.count(1)
        self.sent = 0
        self.received = 0

    def __repr__(self) -> str:
        kind = "ROUTER" if self.router else "DEALER"
        return f"<ControlChannel {kind} {self.name} sent={self.sent} received={self.received}>"

    def bind(self, addr: str) -> str:
        self.sock.bind(addr)
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, addr: str) -> None:
        self.sock.connect(addr)

    async def send(self, body: Message, *, to: Optional[bytes] = None, version: Optional[int] = None,
                   parent_id: Optional[int] = None, body_frame: Optional[bytes] = None) -> int:
        """``body_frame``: ``encode_body(body)`` made beforehand (off the event loop)."""
        msg_id = next(self._ids)
        frames = encode(Envelope(body, msg_id, self.name, parent_id, version), self.limits, body_frame)
        if self.auth_key is not None:
            frames = sign(frames, self.auth_key)
        if self.router:
            if to is None:
                raise ValueError("a ROUTER send needs the peer's routing id")
            frames = [to, *frames]
        await self.sock.send_multipart(frames, copy=False)
        self.sent += 1
        return msg_id

    async def recv(self) -> tuple[Optional[bytes], Envelope]:
        frames = await self.sock.recv_multipart()
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

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
