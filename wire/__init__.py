"""weightsync.wire: the sans-IO control protocol (messages, codec, session state machine).

Imports neither zmq nor asyncio. See docs/PROTOCOL.md for the specification.
"""

from . import errors
from .codec import DEFAULT_LIMITS, PROTOCOL_VERSION, Envelope, Header, Limits, decode, encode, encode_body
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError, WeightSyncError
from .manifest import DTYPE_SIZES, Manifest, RegionInfo, ShardSpec, Slice, TensorSpec, TransportInfo, dtype_size
from .messages import *  # noqa: F401,F403  (the message catalogue)
from .messages import MESSAGE_TYPES, SESSIONLESS, AbortReason, ErrorCode, Message, RejectCode, Role
from .routing import ExpectedEntry, PeerInfo, ReceiverTable, SenderTable, Transfer
from .states import TRANSITIONS, Origin, Session, State

__all__ = [
    "errors",
    "DEFAULT_LIMITS",
    "PROTOCOL_VERSION",
    "Envelope",
    "Header",
    "Limits",
    "decode",
    "encode",
    "encode_body",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "WeightSyncError",
    "DTYPE_SIZES",
    "Manifest",
    "RegionInfo",
    "ShardSpec",
    "Slice",
    "TensorSpec",
    "TransportInfo",
    "dtype_size",
    "MESSAGE_TYPES",
    "SESSIONLESS",
    "AbortReason",
    "ErrorCode",
    "Message",
    "RejectCode",
    "Role",
    "ExpectedEntry",
    "PeerInfo",
    "ReceiverTable",
    "SenderTable",
    "Transfer",
    "TRANSITIONS",
    "Origin",
    "Session",
    "State",
]
