"""The codec: ``Envelope`` <-> a list of two frames, ``[header, body]``, both MessagePack maps.

How this works: ``encode`` validates the body against its schema, builds the header (protocol
version, type, message id, parent id, sender identity, update version) and packs both with
``use_bin_type=True`` in field-declaration order, so equal envelopes give equal bytes. ``decode``
enforces the frame count and the size limits first, unpacks with extension types refused, decodes
the header, applies the version rule (same major; a ``reject`` is readable from any major), then
validates the body strictly. Whatever the bytes, ``decode`` raises nothing but ``ProtocolError``.

ZeroMQ routing-identity and empty delimiter frames are the socket owner's business (``roles``):
this module sees only the two protocol frames.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import msgpack

from . import errors
from .messages import MESSAGE_TYPES, Message, Reject
from .schema import U32, U64, Violation, from_wire, struct, to_wire

PROTOCOL_VERSION: tuple[int, int] = (3, 4)

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """Size limits applied at encode and decode."""

    max_frame_bytes: int = 64 * MiB
    max_message_bytes: int = 96 * MiB


DEFAULT_LIMITS = Limits()


@struct
class Header:
    major: U32
    minor: U32
    type: str
    msg_id: U64
    parent_id: Optional[U64]
    sender: str
    version: Optional[U64]


@dataclasses.dataclass(frozen=True)
class Envelope:
    """A message with its header fields. ``version`` is the update version it concerns, if any."""

    body: Message
    msg_id: int
    sender: str
    parent_id: Optional[int] = None
    version: Optional[int] = None
    proto: tuple[int, int] = PROTOCOL_VERSION

    @property
    def type(self) -> str:
        return self.body.TYPE


def pack_map(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode(env: Envelope, limits: Limits = DEFAULT_LIMITS, body_frame: Optional[bytes] = None) -> list[bytes]:
    """Validate and serialise; raises ``InvalidMessage`` naming the field that is wrong.

    ``body_frame``: ``encode_body(env.body)``, made earlier (a controller encodes a plan's tables in its
    planning thread, off the event loop)."""
    body_type = message_type(env.body)
    header = Header(
        major=env.proto[0],
        minor=env.proto[1],
        type=body_type.TYPE,
        msg_id=env.msg_id,
        parent_id=env.parent_id,
        sender=env.sender,
        version=env.version,
    )
    body = body_frame if body_frame is not None else _encode_struct(env.body, body_type.TYPE)
    frames = [_encode_struct(header, "header"), body]
    check_sizes(frames, limits, errors.InvalidMessage)
    return frames


def encode_body(body: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """A message's body frame alone, validated (for ``encode(..., body_frame=)``)."""
    frame = _encode_struct(body, message_type(body).TYPE)
    check_sizes([frame], limits, errors.InvalidMessage)
    return frame


def message_type(body: Any) -> type:
    body_type = type(body)
    if MESSAGE_TYPES.get(getattr(body_type, "TYPE", None)) is not body_type:
        raise errors.InvalidMessage("<body>", f"{body_type.__name__} is not a protocol message")
    return body_type


def _encode_struct(obj: Any, label: str) -> bytes:
    try:
        return pack_map(to_wire(obj))
    except Violation as v:
        raise errors.InvalidMessage(f"{label}.{v.path}" if v.path else label, v.detail) from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise errors.InvalidMessage(label, f"not serialisable: {exc}") from exc


def check_sizes(frames: Sequence[Any], limits: Limits, exc_type: type) -> None:
    total = 0
    for i, frame in enumerate(frames):
        size = len(frame)
        total += size
        if size > limits.max_frame_bytes:
            raise exc_type(f"frames[{i}]", f"{size} bytes exceed the frame limit of {limits.max_frame_bytes}")
    if total > limits.max_message_bytes:
        raise exc_type("<frames>", f"{total} bytes exceed the message limit of {limits.max_message_bytes}")


class _TooLarge(errors.MessageTooLarge):
    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field


def _refuse_ext(code: int, data: bytes) -> Any:
    raise Violation("type", "<frame>", f"MessagePack extension type {code} is not allowed")


def _unpack(frame: Any, which: str, limits: Limits) -> Any:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise errors.MalformedFrames(f"{which} frame is {type(frame).__name__}, not bytes")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            timestamp=0,
        )
    except Violation as v:
        raise errors.WrongType(which, v.detail) from None
    except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise errors.MalformedFrames(f"{which} frame is not valid MessagePack: {exc!r}") from None


def _field_error(v: Violation, prefix: str) -> errors.FieldError:
    cls = errors.FIELD_ERRORS[v.kind]
    return cls(f"{prefix}.{v.path}" if v.path else prefix, v.detail)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Parse and validate two frames. Raises only ``ProtocolError`` subclasses."""
    try:
        return _decode(frames, limits)
    except errors.ProtocolError:
        raise
    except Exception as exc:  # defence in depth: nothing but ProtocolError may escape
        raise errors.MalformedFrames(f"undecodable message: {exc!r}") from None


def _decode(frames: Sequence[Any], limits: Limits) -> Envelope:
    if not isinstance(frames, (list, tuple)) or len(frames) != 2:
        n = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise errors.MalformedFrames(f"expected 2 frames [header, body], got {n}")
    for f in frames:
        if not isinstance(f, (bytes, bytearray, memoryview)):
            raise errors.MalformedFrames(f"frame is {type(f).__name__}, not bytes")
    check_sizes(frames, limits, _TooLarge)
    raw_header = _unpack(frames[0], "header", limits)
    try:
        header = from_wire(Header, raw_header)
    except Violation as v:
        raise _field_error(v, "header") from None
    theirs = (header.major, header.minor)
    if header.major != PROTOCOL_VERSION[0] and header.type != Reject.TYPE:
        raise errors.VersionMismatch(PROTOCOL_VERSION, theirs, header)
    cls = MESSAGE_TYPES.get(header.type)
    if cls is None:
        raise errors.UnknownMessageType(header.type)
    raw_body = _unpack(frames[1], "body", limits)
    try:
        body = from_wire(cls, raw_body)
    except Violation as v:
        raise _field_error(v, header.type) from None
    return Envelope(
        body=body,
        msg_id=header.msg_id,
        sender=header.sender,
        parent_id=header.parent_id,
        version=header.version,
        proto=theirs,
    )
