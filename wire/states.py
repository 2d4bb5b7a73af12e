"""The session state machine of one worker as seen by both ends, as a transition table (h11-style).

How this works: a worker (sender or receiver) and the controller each keep a ``Session`` for the
worker's session. Both use the same ``TRANSITIONS`` table, keyed by (role, state, origin, message
type), where ``origin`` is who sent the message. ``Session.send`` checks a message we are about to
send (an illegal one is our bug: ``LocalIllegalTransition``); ``Session.receive`` checks one we got
(an illegal one is the peer's: ``RemoteIllegalTransition``). Both move the state. No I/O here.

Round shape: begin -> (sender) writes_done -> commit (a sender holding an ``arm`` pushes with
``armed_push`` instead, which stands for its begin); (receiver) fence -> fence_ack -> commit ->
commit_ack, or, as the only receiver of a round, fence_commit -> commit_ack (or fence_ack, not ok).
``abort`` returns any in-round state to READY. Heartbeat and error are legal in every joined state
and change nothing; ``leave`` from either side closes the session.
"""

from __future__ import annotations

import enum
from typing import Optional

from . import messages as m
from .errors import LocalIllegalTransition, RemoteIllegalTransition


class State(enum.Enum):
    NEW = "NEW"
    HELLO_SENT = "HELLO_SENT"
    JOINED = "JOINED"
    PLAN_RECEIVED = "PLAN_RECEIVED"
    READY = "READY"
    WRITING = "WRITING"
    WRITTEN = "WRITTEN"
    RECEIVING = "RECEIVING"
    FENCING = "FENCING"
    FENCED = "FENCED"
    COMMIT_FENCING = "COMMIT_FENCING"  # one-phase: verifying, will apply on its own if that passes
    COMMIT_FENCED = "COMMIT_FENCED"  # one-phase: verdict sent; applying (ok) or waiting for abort
    APPLYING = "APPLYING"
    CLOSED = "CLOSED"


class Origin(enum.Enum):
    WORKER = "worker"
    CONTROLLER = "controller"


S, R = m.Role.SENDER, m.Role.RECEIVER
W, C = Origin.WORKER, Origin.CONTROLLER

_BOTH_ROLES = (S, R)
JOINED_STATES = (
    State.JOINED,
    State.PLAN_RECEIVED,
    State.READY,
    State.WRITING,
    State.WRITTEN,
    State.RECEIVING,
    State.FENCING,
    State.FENCED,
    State.COMMIT_FENCING,
    State.COMMIT_FENCED,
    State.APPLYING,
)
ROUND_STATES = {
    S: (State.WRITING, State.WRITTEN),
    R: (State.RECEIVING, State.FENCING, State.FENCED, State.COMMIT_FENCING, State.COMMIT_FENCED),
}


def _build() -> dict[tuple[m.Role, State, Origin, str], State]:
    t: dict[tuple[m.Role, State, Origin, str], State] = {}
    for role in _BOTH_ROLES:
        t[role, State.NEW, W, m.Hello.TYPE] = State.HELLO_SENT
        t[role, State.HELLO_SENT, C, m.Welcome.TYPE] = State.JOINED
        t[role, State.HELLO_SENT, C, m.Reject.TYPE] = State.CLOSED
        t[role, State.HELLO_SENT, C, m.Error.TYPE] = State.HELLO_SENT
        t[role, State.JOINED, C, m.Plan.TYPE] = State.PLAN_RECEIVED
        t[role, State.READY, C, m.Plan.TYPE] = State.PLAN_RECEIVED
        t[role, State.PLAN_RECEIVED, W, m.PlanAck.TYPE] = State.READY
        for state in JOINED_STATES:
            for origin in (W, C):
                t[role, state, origin, m.Heartbeat.TYPE] = state
                t[role, state, origin, m.Error.TYPE] = state
                t[role, state, origin, m.Leave.TYPE] = State.CLOSED
        for state in ROUND_STATES[role]:
            t[role, state, C, m.Abort.TYPE] = State.READY
    # a sender's round: it asks for one with push, the controller starts it with begin. A push may
    # cross a new plan or a begin in flight, so it is legal in those states too and changes nothing.
    for state in (State.PLAN_RECEIVED, State.READY, State.WRITING, State.WRITTEN):
        t[S, state, W, m.Push.TYPE] = state
    # a push under an arm: the sender writes from now, and no begin comes for it while the arm's plan holds
    t[S, State.READY, W, m.ArmedPush.TYPE] = State.WRITING
    t[S, State.PLAN_RECEIVED, W, m.ArmedPush.TYPE] = State.PLAN_RECEIVED  # (crossed a plan: begun under that one)
    t[S, State.WRITING, C, m.Plan.TYPE] = State.PLAN_RECEIVED  # a plan made while an armed push waits for its round
    t[S, State.WRITTEN, C, m.Plan.TYPE] = State.PLAN_RECEIVED
    t[S, State.PLAN_RECEIVED, W, m.WritesDone.TYPE] = State.PLAN_RECEIVED  # (an armed one that crossed that plan)
    # the next round's parameters, once the last is applied everywhere: before a one-phase round's commit
    t[S, State.READY, C, m.Arm.TYPE] = State.READY
    t[S, State.WRITTEN, C, m.Arm.TYPE] = State.WRITTEN
    t[S, State.READY, C, m.UpdateBegin.TYPE] = State.WRITING
    t[S, State.WRITING, W, m.WritesDone.TYPE] = State.WRITTEN
    t[S, State.WRITTEN, C, m.Commit.TYPE] = State.READY
    t[S, State.READY, W, m.WritesDone.TYPE] = State.READY  # crossed the controller's abort: ignored
    t[S, State.READY, C, m.Abort.TYPE] = State.READY  # the round it pushed for failed before its begin
    # a receiver's round
    t[R, State.READY, C, m.UpdateBegin.TYPE] = State.RECEIVING
    t[R, State.RECEIVING, W, m.BeginAck.TYPE] = State.RECEIVING  # in place: serving paused, writes may start
    t[R, State.RECEIVING, C, m.Fence.TYPE] = State.FENCING
    t[R, State.FENCING, W, m.FenceAck.TYPE] = State.FENCED
    t[R, State.FENCED, C, m.Commit.TYPE] = State.APPLYING
    t[R, State.APPLYING, W, m.CommitAck.TYPE] = State.READY
    # a round with one receiver: fence and commit in one exchange (the receiver applies on its own
    # verdict; a failed verification is answered by abort as above)
    t[R, State.RECEIVING, C, m.FenceCommit.TYPE] = State.COMMIT_FENCING
    t[R, State.COMMIT_FENCING, W, m.CommitAck.TYPE] = State.READY  # verified and applied: one message
    t[R, State.COMMIT_FENCING, W, m.FenceAck.TYPE] = State.COMMIT_FENCED  # a failed verification (or 1.0 peers)
    t[R, State.COMMIT_FENCED, W, m.CommitAck.TYPE] = State.READY
    return t


TRANSITIONS = _build()


class Session:
    """One worker's session state; ``side`` says which end we are."""

    def __init__(self, role: m.Role, side: Origin) -> None:
        self.role = m.Role(role)
        self.side = side
        self.state = State.NEW

    def __repr__(self) -> str:
        return f"<Session {self.role.value} as {self.side.value}: {self.state.value}>"

    def send(self, msg_type: str) -> State:
        return self._step(self.side, msg_type, LocalIllegalTransition)

    def receive(self, msg_type: str) -> State:
        other = Origin.CONTROLLER if self.side is Origin.WORKER else Origin.WORKER
        return self._step(other, msg_type, RemoteIllegalTransition)

    def accept(self, msg_type: str, version: Optional[int] = None) -> Optional[m.Error]:
        """Receive a message; if it is illegal here, leave the state as it is and return the
        ``error`` (code PROTOCOL, naming role, state and type) that the spec says to answer with."""
        try:
            self.receive(msg_type)
        except RemoteIllegalTransition as exc:
            return m.Error(m.ErrorCode.PROTOCOL, str(exc), msg_type, version)
        return None

    def allowed(self, origin: Origin, msg_type: str) -> bool:
        return (self.role, self.state, origin, msg_type) in TRANSITIONS

    def _step(self, origin: Origin, msg_type: str, exc: type) -> State:
        nxt = TRANSITIONS.get((self.role, self.state, origin, msg_type))
        if nxt is None:
            raise exc(self.role.value, self.state.value, msg_type, origin.value)
        self.state = nxt
        return nxt
