"""Every message of the control protocol, as typed frozen dataclasses.

How this works: each message class has a ``TYPE`` string that travels in the envelope header and
selects the class at decode. Bodies are schema-checked structs (``weightsync.wire.schema``). Workers (senders,
receivers) talk to the controller through the session messages, whose legal order is the transition
table in ``weightsync.wire.states``; ``StatusRequest``/``CommandRequest`` and their replies are sessionless
request/reply pairs for the daemon and the CLI. ``docs/PROTOCOL.md`` is the specification.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Optional

from .manifest import Manifest, TransportInfo
from .routing import ReceiverTable, SenderTable
from .schema import U32, U64, Columns, Json, Violation, struct


class Role(str, enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class RejectCode(enum.IntEnum):
    VERSION_MISMATCH = 1
    DUPLICATE_RANK = 2
    MANIFEST_MISMATCH = 3
    BAD_RANK = 4
    UNAUTHENTICATED = 5
    LIMIT_EXCEEDED = 6
    SHUTTING_DOWN = 7


class AbortReason(enum.IntEnum):
    PEER_LOST = 1
    PEER_ERROR = 2
    CHECKSUM_MISMATCH = 3
    TIMEOUT = 4
    MEMBERSHIP_CHANGED = 5
    CANCELLED = 6
    SHUTDOWN = 7


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1
    TRANSPORT = 2
    PLAN = 3
    STAGING = 4
    INTERNAL = 5
    BAD_REQUEST = 6
    UNAUTHORIZED = 7


class Message:
    """Base of all message bodies."""

    TYPE: ClassVar[str] = ""


# --- join ----------------------------------------------------------------------------------------


@struct
class Hello(Message):
    TYPE = "hello"
    role: Role
    rank: U32
    host: str
    device: str
    pid: U32
    proto_major: U32
    proto_minor: U32
    capabilities: tuple[str, ...]
    manifest: Manifest
    transport: TransportInfo
    committed: Optional[U64] = None  # the newest version this worker saw committed (a controller restarted
    #                                  after it learns the committed version from these before any round)
    landing: Optional[U32] = None  # a two-slot receiver: which slot takes the next round (None: slot 1)
    incarnation: bytes = b""  # random per worker object, the same on each of its channels (at most 16 bytes)

    def _check(self) -> None:
        if len(self.incarnation) > 16:
            raise Violation("value", "incarnation", f"{len(self.incarnation)} bytes, at most 16")


@struct
class Welcome(Message):
    TYPE = "welcome"
    session: str
    proto_major: U32
    proto_minor: U32
    heartbeat_ms: U32
    timeout_ms: U32
    capabilities: tuple[str, ...]
    committed: Optional[U64] = None  # the controller's last committed version: a (re)joining sender resumes above it
    stream_port: Optional[U32] = None  # (capability ``stream``) the port of this session's stream, on the controller's host
    stream_token: bytes = b""  # the token that stream's first record must carry (``wire.stream``), 16 bytes

    def _check(self) -> None:
        if self.stream_port is not None and not (0 < self.stream_port < 65536 and len(self.stream_token) == 16):
            raise Violation("value", "stream_port", f"port {self.stream_port} with a token of "
                            f"{len(self.stream_token)} bytes: a port in 1..65535 and 16 bytes")


@struct
class Reject(Message):
    """Refuses a join. Its layout is frozen across major versions so any peer can read it."""

    TYPE = "reject"
    code: RejectCode
    text: str
    local_major: U32
    local_minor: U32
    peer_major: U32
    peer_minor: U32


# --- plan ----------------------------------------------------------------------------------------


DATA_KEY_BYTES = 32


@struct
class DataKey:
    """The data-plane key of one (sender, receiver) pair of a plan; ``rank`` is the other end of the pair."""

    rank: U32
    key: bytes

    def _check(self) -> None:
        if len(self.key) != DATA_KEY_BYTES:
            raise Violation("value", "key", f"{len(self.key)} bytes, need {DATA_KEY_BYTES}")


@struct
class Plan(Message):
    """A routing table: ``sender`` for a sender, ``receiver`` for a receiver (exactly one is set).
    ``keys`` (optional): one data-plane key per peer the table names (a sender: its receivers; a
    receiver: its senders); every data-plane connection of the plan proves the key of its pair."""

    TYPE = "plan"
    plan_id: U64
    sender: Optional[SenderTable]
    receiver: Optional[ReceiverTable]
    keys: Columns[DataKey] = ()
    committed: Optional[U64] = None  # the controller's committed version as it plans: a worker still holding
    #                                  the outcome of an older round (it lost its session after the fence,
    #                                  or the controller restarted) learns it here

    def _check(self) -> None:
        if (self.sender is None) == (self.receiver is None):
            raise Violation("value", "sender", "exactly one of sender/receiver must be set")


@struct
class PlanAck(Message):
    TYPE = "plan_ack"
    plan_id: U64
    ok: bool
    text: str
    landing: Optional[U32] = None  # a two-slot receiver: the slot that takes the next round, when it changed
    #                                outside a round (it applied a prepared version the plan said committed)


# --- update round --------------------------------------------------------------------------------


@struct
class Push(Message):
    """Sender -> controller: this sender's weights for ``version`` are ready to go."""

    TYPE = "push"
    version: U64


@struct
class Slot:
    """Receiver ``rank`` lands this round in buffer ``slot`` (region id = table region + slot)."""

    rank: U32
    slot: U32


@struct
class Base:
    """Receiver ``rank`` holds, where this round lands, every byte of committed ``version``: a sender
    may send it the round's changes against that version (``delta``) instead of whole rows."""

    rank: U32
    version: U64


DELTA_MODES = ("", "auto", "always")  # "": whole rows only; see docs/DELTAS.md


@struct
class UpdateBegin(Message):
    """Controller -> round members: round ``version`` of plan ``plan_id`` begins. ``bases`` (to senders,
    and to each receiver its own): the receivers a delta may go to, and against which version; a
    receiver not named gets whole rows. ``delta``: the round's delta mode (``DELTA_MODES``)."""

    TYPE = "begin"
    version: U64
    plan_id: U64
    checksum: str
    landing: tuple[Slot, ...]
    bases: tuple[Base, ...] = ()
    delta: str = ""

    def _check(self) -> None:
        _check_delta(self.delta)


def _check_delta(delta: str) -> None:
    if delta not in DELTA_MODES:
        raise Violation("value", "delta", f"{delta!r} is not one of {DELTA_MODES}")


@struct
class Arm(Message):
    """Controller -> sender (capability ``arm``): the parameters the next round will begin with, sent once
    a round is applied by every receiver. The sender may push its next version with ``armed_push`` and
    write it at once under them. ``arm_id`` names this offer: the controller honours an ``armed_push``
    only while it is the current one (docs/PROTOCOL.md, 6, *Armed pushes*)."""

    TYPE = "arm"
    arm_id: U64
    plan_id: U64
    checksum: str
    landing: tuple[Slot, ...]
    bases: tuple[Base, ...] = ()
    delta: str = ""

    def _check(self) -> None:
        _check_delta(self.delta)


@struct
class ArmedPush(Message):
    """Sender -> controller: as ``push``, and this sender has started writing ``version`` under arm
    ``arm_id`` (its writes land in the arm's slots); it stands for the sender's ``begin``."""

    TYPE = "armed_push"
    version: U64
    arm_id: U64


@struct
class BeginAck(Message):
    """In-place receiver -> controller: its ``before_update`` hook has run; writes may start (receivers
    that offered capability ``begin_ack``: the controller begins the senders only after these)."""

    TYPE = "begin_ack"
    version: U64


@struct
class Checksum:
    KEPT_AS_COLUMNS: ClassVar[bool] = True  # ``columns[Checksum]`` decodes to ``wire.columns.Rows``: a
    # checked round carries one per row (4,720 for a MoE lane), read once by the receiver, passed on by C
    index: U32
    value: U64


MAX_PROOF_BYTES = 256


@struct
class DeltaRow:
    """Transfer ``index`` went as a delta of ``nbytes`` (``engine.transforms.delta``'s packed form) into
    the receiver's delta region, at the window its row maps to (``engine.datapath.deltas.window``);
    ``change``: what applying it does to the row's fingerprint, which the receiver checks."""

    index: U32
    nbytes: U64
    change: U64  # how much the row's ``fp64`` fingerprint moves (engine.datapath.checksums.fp64_change)
    changes: U64  # values it changes (its header's count: the receiver checks they agree)


@struct
class WriteSummary:
    """What one sender wrote to one receiver; ``peer_rank`` is the receiver in ``writes_done`` and the
    sender in ``fence``. ``proof`` (optional, protocol 1.0 peers never see it): empty when the writes
    were delivered before ``writes_done`` was sent; otherwise a transport-specific token the receiver
    waits on before its verdict (cuda_ipc: an interprocess CUDA event recorded behind the copies), so
    ``writes_done`` may leave while the last copies are still in flight."""

    peer_rank: U32
    count: U32
    nbytes: U64
    checksums: Columns[Checksum]  # (columns: a checked round of thousands of rows, protocol 3.0)
    proof: bytes = b""
    deltas: Columns[DeltaRow] = ()  # rows that went as deltas (``nbytes`` counts their payloads)

    def _check(self) -> None:
        if len(self.proof) > MAX_PROOF_BYTES:
            raise Violation("value", "proof", f"{len(self.proof)} bytes, at most {MAX_PROOF_BYTES}")


@struct
class WritesDone(Message):
    TYPE = "writes_done"
    version: U64
    plan_id: U64
    receivers: tuple[WriteSummary, ...]
    stage_s: float
    write_s: float
    encode_s: float = 0.0  # of ``stage_s``, the seconds spent encoding delta rows (summed over threads)
    issue_s: float = 0.0  # host seconds queueing its writes (with ``stage_s``: its rows' host cost)
    trying: bool = False  # its transport was still timing its ways this round (not the plan's steady cost)


@struct
class Fence(Message):
    """Controller -> receiver: all senders finished; verify and stage the version."""

    TYPE = "fence"
    version: U64
    checksums: tuple[WriteSummary, ...]


@struct
class FenceCommit(Message):
    """Controller -> the one receiver of a round (it offered capability ``fence_commit``): verify and,
    if that passes, apply at once and answer ``commit_ack`` (which says both); a failed verification
    is answered ``fence_ack`` with ``ok=false``. A two-phase commit with one participant needs no second
    phase."""

    TYPE = "fence_commit"
    version: U64
    checksums: tuple[WriteSummary, ...]


@struct
class FenceAck(Message):
    TYPE = "fence_ack"
    version: U64
    ok: bool
    nbytes: U64
    mismatches: tuple[str, ...]
    text: str
    blame: str = ""  # a failed verification caused by one sender's writes (refused, out of bounds, short): "sender/3"
    apply_s: float = 0.0  # seconds the verdict spent checking and applying deltas
    verify_s: float = 0.0  # seconds it spent on checksums (the round's end-to-end check)


@struct
class Commit(Message):
    """Controller -> round members: ``version`` is committed. ``arm`` (to a sender that offered
    capability ``commit_arm``, in a round whose receivers applied it before this commit): the next
    round's parameters, as an ``arm`` message would carry them, in the message the sender waits for."""

    TYPE = "commit"
    version: U64
    arm: Optional[Arm] = None


@struct
class CommitAck(Message):
    TYPE = "commit_ack"
    version: U64
    applied: bool
    text: str
    apply_s: float = 0.0  # one-phase (it answers fence_commit): its verdict's times, as ``FenceAck`` has them
    verify_s: float = 0.0


@struct
class Abort(Message):
    TYPE = "abort"
    version: U64
    reason: AbortReason
    text: str
    culprit: str


# --- liveness and errors -------------------------------------------------------------------------


@struct
class Heartbeat(Message):
    TYPE = "heartbeat"
    seq: U64


@struct
class Leave(Message):
    TYPE = "leave"
    reason: str


@struct
class Error(Message):
    TYPE = "error"
    code: ErrorCode
    text: str
    field: str
    version: Optional[U64]


# --- daemon / CLI request-reply (sessionless) ----------------------------------------------------


@struct
class StatusRequest(Message):
    TYPE = "status_request"
    detail: bool


@struct
class StatusReply(Message):
    TYPE = "status_reply"
    status: Json


@struct
class CommandRequest(Message):
    TYPE = "command_request"
    command: str
    args: Json


@struct
class CommandReply(Message):
    TYPE = "command_reply"
    ok: bool
    result: Json
    error: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Reject,
        Plan,
        PlanAck,
        Push,
        UpdateBegin,
        Arm,
        ArmedPush,
        BeginAck,
        WritesDone,
        Fence,
        FenceCommit,
        FenceAck,
        Commit,
        CommitAck,
        Abort,
        Heartbeat,
        Leave,
        Error,
        StatusRequest,
        StatusReply,
        CommandRequest,
        CommandReply,
    )
}

SESSIONLESS = frozenset({StatusRequest, StatusReply, CommandRequest, CommandReply})

__all__ = [
    "Role", "RejectCode", "AbortReason", "ErrorCode", "Message", "Checksum", "WriteSummary", "Slot", "DataKey",
    "DATA_KEY_BYTES",
    "MESSAGE_TYPES", "SESSIONLESS",
    *(cls.__name__ for cls in MESSAGE_TYPES.values()),
]
