"""The session state machine, driven from its transition table."""

from __future__ import annotations

import itertools

import pytest

from weightsync.wire import TRANSITIONS, Origin, Session, State, errors
from weightsync.wire import messages as m

ROLES = (m.Role.SENDER, m.Role.RECEIVER)
SESSION_TYPES = sorted(t for t, cls in m.MESSAGE_TYPES.items() if cls not in m.SESSIONLESS)


def _other(side: Origin) -> Origin:
    return Origin.CONTROLLER if side is Origin.WORKER else Origin.WORKER


def _at(role, state, side) -> Session:
    s = Session(role, side)
    s.state = state
    return s


@pytest.mark.parametrize("key", sorted(TRANSITIONS, key=lambda k: (k[0].value, k[1].value, k[2].value, k[3])),
                         ids=lambda k: f"{k[0].value}-{k[1].value}-{k[2].value}-{k[3]}")
def test_every_legal_transition_both_ends(key):
    role, state, origin, msg = key
    # the originator sends it, the other end receives it; both land in the same state
    sender_side = _at(role, state, origin)
    receiver_side = _at(role, state, _other(origin))
    assert sender_side.send(msg) is TRANSITIONS[key]
    assert receiver_side.receive(msg) is TRANSITIONS[key]


def test_every_illegal_transition_is_typed_and_named():
    checked = 0
    for role, state, origin, msg in itertools.product(ROLES, State, Origin, SESSION_TYPES):
        if (role, state, origin, msg) in TRANSITIONS:
            continue
        local = _at(role, state, origin)
        with pytest.raises(errors.LocalIllegalTransition) as e:
            local.send(msg)
        assert (e.value.role, e.value.state, e.value.message) == (role.value, state.value, msg)
        assert local.state is state  # an illegal message changes nothing
        remote = _at(role, state, _other(origin))
        with pytest.raises(errors.RemoteIllegalTransition) as e:
            remote.receive(msg)
        assert isinstance(e.value, errors.RemoteProtocolError)
        checked += 1
    assert checked > 300


def _run(role, steps):
    worker, ctrl = Session(role, Origin.WORKER), Session(role, Origin.CONTROLLER)
    for origin, msg in steps:
        if origin is Origin.WORKER:
            worker.send(msg)
            ctrl.receive(msg)
        else:
            ctrl.send(msg)
            worker.receive(msg)
        assert worker.state is ctrl.state
    return worker.state


W, C = Origin.WORKER, Origin.CONTROLLER
JOIN = [(W, "hello"), (C, "welcome"), (C, "plan"), (W, "plan_ack")]


def test_sender_round_and_abort():
    steps = JOIN + [(W, "push"), (C, "begin"), (W, "writes_done"), (C, "commit")]
    assert _run(m.Role.SENDER, steps) is State.READY
    assert _run(m.Role.SENDER, JOIN + [(C, "begin"), (W, "error"), (C, "abort")]) is State.READY
    assert _run(m.Role.SENDER, JOIN + [(C, "begin"), (W, "writes_done"), (C, "abort"), (C, "plan"),
                                       (W, "plan_ack"), (C, "begin")]) is State.WRITING


def test_receiver_round_fence_commit():
    steps = JOIN + [(C, "begin"), (C, "fence"), (W, "fence_ack"), (C, "commit"), (W, "commit_ack")]
    assert _run(m.Role.RECEIVER, steps) is State.READY
    assert _run(m.Role.RECEIVER, JOIN + [(C, "begin"), (C, "fence"), (W, "fence_ack"), (C, "abort")]) is State.READY


def test_receiver_one_phase_round():
    assert _run(m.Role.RECEIVER, JOIN + [(C, "begin"), (C, "fence_commit"), (W, "commit_ack")]) is State.READY
    failed = JOIN + [(C, "begin"), (C, "fence_commit"), (W, "fence_ack"), (C, "abort")]
    assert _run(m.Role.RECEIVER, failed) is State.READY
    with pytest.raises(errors.LocalIllegalTransition):  # commit_ack is not an answer to a plain fence
        _run(m.Role.RECEIVER, JOIN + [(C, "begin"), (C, "fence"), (W, "commit_ack")])


def test_reject_and_leave_close():
    assert _run(m.Role.SENDER, [(W, "hello"), (C, "reject")]) is State.CLOSED
    assert _run(m.Role.RECEIVER, JOIN + [(W, "heartbeat"), (C, "heartbeat"), (W, "leave")]) is State.CLOSED


def test_commit_is_never_abortable_after_it_is_applied():
    s = _at(m.Role.RECEIVER, State.APPLYING, Origin.WORKER)
    with pytest.raises(errors.RemoteIllegalTransition, match="abort from the controller is illegal for a receiver in state APPLYING"):
        s.receive("abort")


def test_accept_answers_an_illegal_message_with_a_protocol_error():
    s = _at(m.Role.SENDER, State.JOINED, Origin.WORKER)
    err = s.accept("commit", 4)
    assert s.state is State.JOINED and err.code == m.ErrorCode.PROTOCOL and err.field == "commit"
    assert err.version == 4 and "sender in state JOINED" in err.text
    assert s.accept("plan") is None and s.state is State.PLAN_RECEIVED


def test_sender_armed_push_stands_for_begin_and_a_plan_may_cross_it():
    round_ = [(W, "push"), (C, "begin"), (W, "writes_done"), (C, "commit")]
    armed = [(C, "arm"), (W, "armed_push"), (W, "writes_done"), (C, "arm"), (C, "commit")]  # (one-phase: arm, then commit)
    assert _run(m.Role.SENDER, JOIN + round_ + armed) is State.READY
    # a plan made while an armed push waits for its round: that round begins under the new plan
    assert _run(m.Role.SENDER, JOIN + round_ + [(C, "arm"), (W, "armed_push"), (C, "plan"), (W, "plan_ack"),
                                                (C, "begin"), (W, "writes_done"), (C, "commit")]) is State.READY
    # one that crossed the armed push: the controller reads it after sending the plan
    assert _run(m.Role.SENDER, JOIN + round_ + [(C, "arm"), (C, "plan"), (W, "armed_push"), (W, "plan_ack")]) is State.READY
    # writes under an arm that does not hold: abort from writing or written
    assert _run(m.Role.SENDER, JOIN + [(C, "arm"), (W, "armed_push"), (W, "writes_done"), (C, "abort")]) is State.READY
