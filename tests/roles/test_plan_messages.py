"""The controller's plan messages, made and encoded in its planning thread (``planning.plan_messages``)."""

from __future__ import annotations

import dataclasses

import pytest

from plan_helpers import participant, tensor
from weightsync.engine.errors import PlanError
from weightsync.engine.plan import PlanCache, plan
from weightsync.roles.planning import MessageCache, plan_messages
from weightsync.wire import Envelope, Limits, Role, decode, encode
from weightsync.wire.errors import InvalidMessage


def _members():
    senders = [participant(s, [tensor("w", (8, 4), shard=(0, 4 * s, 4 * s + 4), gatherable=True),
                               tensor("b", (4,))], host=f"t{s}") for s in range(2)]
    receivers = [participant(r, [tensor("w", (8, 4)), tensor("b", (4,))], host=f"i{r}") for r in range(3)]
    return senders, receivers


def _routing():
    return plan(*_members(), plan_id=7)


def test_every_member_gets_its_table_and_the_frame_is_its_body_encoded():
    routing = _routing()
    messages = plan_messages(routing)
    assert set(messages) == {(Role.SENDER, s) for s in routing.senders} | {(Role.RECEIVER, r) for r in routing.receivers}
    for (role, rank), (body, frame) in messages.items():
        assert body.plan_id == 7
        table = body.sender if role is Role.SENDER else body.receiver
        assert table == (routing.senders if role is Role.SENDER else routing.receivers)[rank]
        env = Envelope(body, 1, "controller")
        assert encode(env, body_frame=frame) == encode(env)
        assert decode(encode(env, body_frame=frame)).body == body


def test_each_pair_the_plan_routes_shares_one_key_and_each_plan_has_fresh_keys():
    routing = _routing()
    first, second = plan_messages(routing), plan_messages(routing)
    for (role, rank), (body, _) in first.items():
        if role is Role.RECEIVER:
            assert [k.rank for k in body.keys] == sorted({e.src_rank for e in body.receiver.entries})
            continue
        assert {k.rank for k in body.keys} == {p.rank for p in body.sender.peers}
        for key in body.keys:
            receiver_keys = {k.rank: k.key for k in first[(Role.RECEIVER, key.rank)][0].keys}
            assert receiver_keys[rank] == key.key
            assert key.key not in {k.key for k in second[(Role.SENDER, rank)][0].keys}
    pairs = sum(len(body.keys) for (role, _), (body, _) in first.items() if role is Role.SENDER)
    assert pairs == sum(len(t.peers) for t in routing.senders.values()) > 0


def test_a_table_the_control_channel_would_refuse_is_a_plan_error_naming_its_member():
    routing = _routing()
    biggest = max(routing.receivers, key=lambda r: len(routing.receivers[r].entries))
    small = Limits(max_frame_bytes=200, max_message_bytes=400)
    with pytest.raises(PlanError, match="cannot be sent.*frame limit") as info:
        plan_messages(routing, small)
    assert info.value.ranks and info.value.ranks[0].split("/")[0] in ("sender", "receiver")
    assert isinstance(info.value.__cause__, InvalidMessage)
    assert plan_messages(routing, Limits())[(Role.RECEIVER, biggest)][1]  # (the default limits take it)


def test_keys_follow_the_secret_and_both_sessions():
    routing = _routing()
    secret = bytes(32)
    sessions = {(Role.SENDER, 0): b"s0", (Role.SENDER, 1): b"s1", (Role.RECEIVER, 0): b"r0",
                (Role.RECEIVER, 1): b"r1", (Role.RECEIVER, 2): b"r2"}

    def keys(messages):
        return {(role, rank, k.rank): k.key for (role, rank), (body, _) in messages.items() for k in body.keys}

    first = keys(plan_messages(routing, Limits(), secret, sessions))
    assert keys(plan_messages(routing, Limits(), secret, sessions)) == first  # the same processes: the same keys
    restarted = keys(plan_messages(routing, Limits(), secret, {**sessions, (Role.RECEIVER, 2): b"r2-again"}))
    changed = {k for k in first if first[k] != restarted[k]}
    assert changed and all((role is Role.RECEIVER and rank == 2) or (role is Role.SENDER and peer == 2)
                           for role, rank, peer in changed)


def _sessions(senders, receivers, restarted=None):
    out = {(Role.SENDER, p.rank): b"s%d" % p.rank for p in senders}
    out.update({(Role.RECEIVER, p.rank): b"r%d" % p.rank + (b"-again" if p.rank == restarted else b"") for p in receivers})
    return out


def test_with_the_cache_a_replan_is_a_fresh_encodes_bytes_and_only_a_restarted_members_keys_change():
    senders, receivers = _members()
    plans, messages = PlanCache(), MessageCache()
    first = plan_messages(plan(senders, receivers, plan_id=7, cache=plans), sessions=_sessions(senders, receivers),
                          cache=messages)
    moved = dataclasses.replace(receivers[2].transport, address="i2:1234")  # (the same host: patched)
    receivers[2] = dataclasses.replace(receivers[2], manifest=dataclasses.replace(receivers[2].manifest), transport=moved)
    routing = plan(senders, receivers, plan_id=8, cache=plans)
    assert plans.patched == 1
    reused = messages.parts.reused
    second = plan_messages(routing, sessions=_sessions(senders, receivers, restarted=2), cache=messages)
    assert messages.parts.reused > reused  # (the tables, peers and keys that stayed)
    fresh = plan_messages(routing, secret=messages.secret, sessions=_sessions(senders, receivers, restarted=2))
    assert {k: frame for k, (_, frame) in second.items()} == {k: frame for k, (_, frame) in fresh.items()}
    for s in routing.senders:
        before = {k.rank: k.key for k in first[(Role.SENDER, s)][0].keys}
        after = {k.rank: k.key for k in second[(Role.SENDER, s)][0].keys}
        assert set(before) == set(after) and 2 in after
        assert {r for r in after if after[r] != before[r]} == {2}
    assert "senders=2" in repr(messages)


def test_a_cache_serves_one_secret():
    with pytest.raises(ValueError, match="another secret"):
        plan_messages(_routing(), secret=b"x" * 32, cache=MessageCache(b"y" * 32))
