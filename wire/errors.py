"""Errors of the control protocol, grouped by who broke it (the h11 split).

``LocalProtocolError``: *you* broke the protocol (tried to send an invalid message, or one that is
illegal in the current state). ``RemoteProtocolError``: the *peer* did (sent bytes that do not decode,
or a message that is illegal in the current state). Every error names the culprit: the field path for
codec errors, the role/state/message for state-machine errors.

``WeightSyncError`` is the root of every error this project raises; the engine and roles errors
(``weightsync.engine.errors``) derive from it too, so ``except WeightSyncError`` catches all of them.
"""

from __future__ import annotations


class WeightSyncError(Exception):
    """Root of all weightsync errors."""


class ProtocolError(WeightSyncError):
    """Something is wrong with a control-plane message or the order of messages."""


class LocalProtocolError(ProtocolError):
    """We were about to break the protocol: an invalid message or an illegal send."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol: undecodable bytes or an illegal message."""


# --- codec: bytes from a peer that cannot be decoded -------------------------------------------


class DecodeError(RemoteProtocolError):
    """Frames that cannot be turned into a message."""


class MalformedFrames(DecodeError):
    """Wrong frame count, or a frame that is not valid MessagePack."""


class MessageTooLarge(DecodeError):
    """A frame or the whole message exceeds the configured limit."""


class UnknownMessageType(DecodeError):
    """The header names a message type this protocol version does not define."""

    def __init__(self, type_name: object) -> None:
        super().__init__(f"unknown message type {type_name!r}")
        self.type_name = type_name


class VersionMismatch(DecodeError):
    """The peer speaks another major version; ``header`` is kept so a Reject can answer it."""

    def __init__(self, ours: tuple[int, int], theirs: tuple[int, int], header: object) -> None:
        super().__init__(
            f"protocol version mismatch: ours is {ours[0]}.{ours[1]}, peer's is "
            f"{theirs[0]}.{theirs[1]} (the major version must match)"
        )
        self.ours = ours
        self.theirs = theirs
        self.header = header


class FieldError(DecodeError):
    """A field of a decoded message is missing, extra, of the wrong type or has a bad value."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"field {field!r}: {detail}")
        self.field = field
        self.detail = detail


class MissingField(FieldError):
    pass


class ExtraField(FieldError):
    pass


class WrongType(FieldError):
    pass


class InvalidValue(FieldError):
    pass


# --- encode: a message we built is invalid --------------------------------------------------------


class InvalidMessage(LocalProtocolError):
    """A message we tried to encode violates the schema; names the field."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"cannot encode: field {field!r}: {detail}")
        self.field = field
        self.detail = detail


# --- state machine ------------------------------------------------------------------------------


class IllegalTransition(ProtocolError):
    """A message that is not allowed in the current state of the peer's session."""

    def __init__(self, role: str, state: str, message: str, origin: str) -> None:
        super().__init__(
            f"{message} from the {origin} is illegal for a {role} in state {state}"
        )
        self.role = role
        self.state = state
        self.message = message
        self.origin = origin


class LocalIllegalTransition(IllegalTransition, LocalProtocolError):
    pass


class RemoteIllegalTransition(IllegalTransition, RemoteProtocolError):
    pass


FIELD_ERRORS = {
    "missing": MissingField,
    "extra": ExtraField,
    "type": WrongType,
    "value": InvalidValue,
}
