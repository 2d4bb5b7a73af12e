"""Message authentication for the control plane: HMAC-SHA256 over the protocol frames (pure, no I/O).

How this works: with a shared key, every message carries a third frame, ``tag = HMAC-SHA256(key,
len(f0) || f0 || len(f1) || f1)`` (lengths as 4-byte big-endian). ``verify`` recomputes and compares in
constant time. Replays are refused by the socket owner, which requires each peer's ``msg_id`` to
increase (``ReplayGuard``). Why HMAC and not ZeroMQ CURVE: it works with any libzmq build, needs one
key file instead of per-peer key pairs, and authenticates every message (including the order, with the
replay guard). It does not encrypt: the control plane carries manifests and routing tables, never
tensor bytes or secrets.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from .errors import RemoteProtocolError

TAG_BYTES = 32
MIN_KEY_BYTES = 16


class Unauthenticated(RemoteProtocolError):
    """A message without a valid tag (no key, wrong key, or altered in flight)."""


class Replayed(RemoteProtocolError):
    """A message whose id is not newer than the last one accepted from that peer."""


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"an authentication key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def _mac(key: bytes, frames: Sequence[bytes]) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        m.update(len(f).to_bytes(4, "big"))
        m.update(f)
    return m.digest()


def sign(frames: Sequence[bytes], key: bytes) -> list[bytes]:
    """The frames with their tag appended."""
    return [*frames, _mac(key, frames)]


def verify(frames: Sequence[bytes], key: bytes) -> list[bytes]:
    """The protocol frames without the tag; raises ``Unauthenticated`` if the tag is missing or wrong."""
    if len(frames) != 3:
        raise Unauthenticated(f"expected 2 frames and a tag, got {len(frames)} frames")
    *body, tag = frames
    if len(tag) != TAG_BYTES or not hmac.compare_digest(bytes(tag), _mac(key, [bytes(f) for f in body])):
        raise Unauthenticated("bad message tag (wrong key, or altered in flight)")
    return body


class ReplayGuard:
    """Accept each peer's messages only with strictly increasing ids."""

    def __init__(self) -> None:
        self.last: dict[bytes, int] = {}

    def check(self, peer: bytes, msg_id: int) -> None:
        if msg_id <= self.last.get(peer, 0):
            raise Replayed(f"message id {msg_id} from {peer!r} is not newer than {self.last[peer]}")
        self.last[peer] = msg_id

    def forget(self, peer: bytes) -> None:
        self.last.pop(peer, None)
