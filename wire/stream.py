"""A session stream's bytes: its handshake, its records and their sealing (pure, no I/O).

How this works. After ``welcome``, a worker and the controller move the session's messages from ZeroMQ
to a TCP connection of their own (docs/PROTOCOL.md, *Session streams*): a ZeroMQ hop passes two I/O
threads, a plain stream's none. This module is everything about that connection's bytes:

- The handshake, three fixed-size messages: the client sends ``MAGIC`` and a fresh 16-byte nonce
  (``opening``); the server answers ``MAGIC``, its own nonce and a proof that it holds the key
  (``server_proof``); the client answers its own proof (``client_proof``). Each proof is an HMAC over
  both nonces under a key derived from the shared key (``stream_key``), so a party without the key can
  complete neither side, and a replayed handshake fails against the other side's fresh nonce. Without a
  shared key the proofs are made under an empty key and prove nothing (as a ZeroMQ socket without CURVE).
- Records: each message (a list of frames) is ``pack``-ed, sealed and sent as a 4-byte little-endian
  length and the sealed bytes. With a key, ``Sealer`` encrypts and authenticates each record with
  ChaCha20-Poly1305 under a key per direction (``direction_keys``) and a nonce counting its records, so
  a record altered, dropped, repeated or reordered fails to open (``Unsealed``); without one it passes
  records through. ``Framer`` cuts a byte stream into records, refusing any over its limit.
- The first record a client sends is its session's token (from ``welcome``): that names the session
  the stream carries.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Iterator, Optional

from .errors import RemoteProtocolError

MAGIC = b"WSSTRM01"
NONCE_BYTES = 16
PROOF_BYTES = 32
OPENING_BYTES = len(MAGIC) + NONCE_BYTES  # client -> server
ANSWER_BYTES = len(MAGIC) + NONCE_BYTES + PROOF_BYTES  # server -> client
TOKEN_BYTES = 16
TAG_BYTES = 16  # a sealed record's Poly1305 tag
_LEN = struct.Struct("<I")


class StreamRefused(RemoteProtocolError):
    """A handshake that failed: wrong magic, or a proof not made with the shared key."""


class Unsealed(RemoteProtocolError):
    """A record that did not open: altered, repeated, reordered, or sealed under another key."""


class Malformed(RemoteProtocolError):
    """A record whose frames do not add up, or one over the stream's limit."""


def stream_key(auth_key: Optional[bytes]) -> bytes:
    """The key the handshake's proofs are made under (empty without a shared key)."""
    return b"" if auth_key is None else hmac.digest(auth_key, b"weightsync-stream", hashlib.sha256)


def _proof(key: bytes, side: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.digest(key, side + client_nonce + server_nonce, hashlib.sha256)


def opening(nonce: Optional[bytes] = None) -> bytes:
    """The client's first bytes: ``MAGIC`` and its nonce."""
    return MAGIC + (nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES))


def _nonce_of(data: bytes, size: int, who: str) -> bytes:
    if len(data) < size or data[:len(MAGIC)] != MAGIC:
        raise StreamRefused(f"{who} did not open a weightsync session stream")
    return data[len(MAGIC):len(MAGIC) + NONCE_BYTES]


def server_answer(key: bytes, opening_bytes: bytes, nonce: Optional[bytes] = None) -> tuple[bytes, bytes, bytes]:
    """The server's answer to a client's ``opening``: (its bytes, the client's nonce, the server's)."""
    client_nonce = _nonce_of(opening_bytes, OPENING_BYTES, "the client")
    server_nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
    return MAGIC + server_nonce + _proof(key, b"server", client_nonce, server_nonce), client_nonce, server_nonce


def client_proof(key: bytes, client_nonce: bytes, answer: bytes) -> tuple[bytes, bytes]:
    """Check the server's ``answer``; (the client's proof to send, the server's nonce). Raises
    ``StreamRefused`` where the server did not prove it holds the key."""
    server_nonce = _nonce_of(answer, ANSWER_BYTES, "the server")
    if not hmac.compare_digest(answer[len(MAGIC) + NONCE_BYTES:], _proof(key, b"server", client_nonce, server_nonce)):
        raise StreamRefused("the server's proof is not made with the shared key")
    return _proof(key, b"client", client_nonce, server_nonce), server_nonce


def check_client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, proof: bytes) -> None:
    if not hmac.compare_digest(proof, _proof(key, b"client", client_nonce, server_nonce)):
        raise StreamRefused("the client's proof is not made with the shared key")


def direction_keys(key: bytes, client_nonce: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(client -> server key, server -> client key) of one connection."""
    return (_proof(key, b"c2s", client_nonce, server_nonce), _proof(key, b"s2c", client_nonce, server_nonce))


class Sealer:
    """Seals (``seal``) or opens (``open``) one direction's records; ``key`` None: passes them through."""

    def __init__(self, key: Optional[bytes]) -> None:
        if key is not None:
            from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

            self._aead = ChaCha20Poly1305(key)
        else:
            self._aead = None
        self.count = 0  # records sealed or opened so far: the next one's nonce

    def _nonce(self) -> bytes:
        nonce = self.count.to_bytes(12, "little")
        self.count += 1
        return nonce

    def seal(self, data: bytes) -> bytes:
        return data if self._aead is None else self._aead.encrypt(self._nonce(), data, None)

    def open(self, data: bytes) -> bytes:
        if self._aead is None:
            return data
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self._nonce(), data, None)
        except InvalidTag:
            raise Unsealed(f"record {self.count - 1} did not open (altered, repeated, reordered or another key)") from None


def pack(frames: list) -> bytes:
    """A message's frames as one record's bytes: their count, then each one's length and bytes."""
    parts = [_LEN.pack(len(frames))]
    for frame in frames:
        parts.append(_LEN.pack(len(frame)))
        parts.append(bytes(frame))
    return b"".join(parts)


def unpack(data: bytes, max_frames: int = 8) -> list[bytes]:
    """``pack``'s inverse; ``Malformed`` where the lengths do not add up to the record."""
    view, at = memoryview(data), 4
    if len(data) < 4:
        raise Malformed("a record shorter than its frame count")
    (count,) = _LEN.unpack_from(view, 0)
    if count > max_frames:
        raise Malformed(f"a record of {count} frames, at most {max_frames}")
    frames = []
    for _ in range(count):
        if at + 4 > len(data):
            raise Malformed("a record cut inside a frame's length")
        (size,) = _LEN.unpack_from(view, at)
        at += 4
        if at + size > len(data):
            raise Malformed(f"a frame of {size} bytes past the record's end")
        frames.append(bytes(view[at:at + size]))
        at += size
    if at != len(data):
        raise Malformed(f"{len(data) - at} bytes after a record's last frame")
    return frames


def record(sealed: bytes) -> bytes:
    """A sealed record as the stream carries it: its length, then its bytes."""
    return _LEN.pack(len(sealed)) + sealed


class Framer:
    """Cuts received bytes into records (``feed``); a record over ``max_record`` bytes is ``Malformed``."""

    def __init__(self, max_record: int) -> None:
        self.max_record = max_record
        self.buf = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        self.buf += data
        at = 0
        while len(self.buf) - at >= 4:
            (size,) = _LEN.unpack_from(self.buf, at)
            if size > self.max_record:
                raise Malformed(f"a record of {size} bytes, over the stream's limit of {self.max_record}")
            if len(self.buf) - at - 4 < size:
                break
            yield bytes(self.buf[at + 4:at + 4 + size])
            at += 4 + size
        del self.buf[:at]
