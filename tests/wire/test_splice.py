"""Body frames made from kept parts (``wire.splice.PartsEncoder``): byte for byte ``encode_body``'s
frames, cold and with every part reused, and for broken bodies exactly ``encode_body``'s errors."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given

from strategies import bodies, plans
from weightsync.wire import PeerInfo, ReceiverTable, SenderTable, encode_body
from weightsync.wire import messages as m
from weightsync.wire.codec import Limits
from weightsync.wire.errors import InvalidMessage
from weightsync.wire.splice import PartsEncoder, array_header, map_header
from wire_samples import RECEIVER_PLAN, samples


def _encoder() -> PartsEncoder:
    return PartsEncoder(split=(m.Plan, SenderTable, ReceiverTable), shared=(PeerInfo,))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 255, 65535, 65536, 70000])
def test_headers_are_msgpacks(n):
    packer = msgpack.Packer()
    assert map_header(n) == packer.pack_map_header(n)
    assert array_header(n) == packer.pack_array_header(n)


def test_every_sample_body_is_encode_bodys_bytes_cold_and_warm():
    enc, envs = _encoder(), samples()
    for name, env in envs.items():
        assert enc.encode_body(env.body) == encode_body(env.body), name
    encoded = enc.encoded
    for name, env in envs.items():
        assert enc.encode_body(env.body) == encode_body(env.body), name
    assert enc.encoded == encoded and enc.reused > 0 and enc.fallbacks == 0  # (the second time, all kept)


@given(plans())
def test_random_plans_are_encode_bodys_bytes(body):
    enc = _encoder()
    assert enc.encode_body(body) == enc.encode_body(body) == encode_body(body)


@given(bodies)
def test_any_message_is_encode_bodys_bytes(body):
    assert _encoder().encode_body(body) == encode_body(body)


def _broken() -> dict[str, m.Plan]:
    plan = samples()["plan_keys"].body
    table = plan.sender
    t0 = table.transfers[0]
    return {
        "index out of order": dataclasses.replace(plan, sender=dataclasses.replace(
            table, transfers=(dataclasses.replace(t0, index=1),))),
        "receiver without peer info (the kept transfers, other peers)": dataclasses.replace(
            plan, sender=dataclasses.replace(table, peers=(dataclasses.replace(table.peers[0], rank=5),))),
        "a key where a peer goes": dataclasses.replace(plan, sender=dataclasses.replace(table, peers=plan.keys)),
        "no table": dataclasses.replace(plan, sender=None),
        "two tables": dataclasses.replace(plan, receiver=RECEIVER_PLAN.receiver),
        "rank out of range": dataclasses.replace(plan, sender=dataclasses.replace(table, rank=2**32)),
        "short key": dataclasses.replace(plan, keys=(m.DataKey(1, b"short"),)),
        "a transfer that is not one": dataclasses.replace(plan, sender=dataclasses.replace(
            table, transfers=(table.peers[0],))),
        "entry expected twice": dataclasses.replace(RECEIVER_PLAN, receiver=dataclasses.replace(
            RECEIVER_PLAN.receiver, entries=RECEIVER_PLAN.receiver.entries * 2)),
    }


@pytest.mark.parametrize("case", list(_broken()))
def test_a_broken_plan_raises_encode_bodys_error_with_its_parts_kept(case):
    enc = _encoder()
    for env in samples().values():  # (every valid part kept: the broken plans reuse some of them)
        enc.encode_body(env.body)
    bad = _broken()[case]
    with pytest.raises(InvalidMessage) as plain:
        encode_body(bad)
    with pytest.raises(InvalidMessage) as spliced:
        enc.encode_body(bad)
    assert str(spliced.value) == str(plain.value)


def test_a_list_for_a_tuple_is_encoded_as_encode_body_does():
    plan = samples()["plan_keys"].body
    listed = dataclasses.replace(plan, sender=dataclasses.replace(plan.sender, transfers=list(plan.sender.transfers)))
    assert _encoder().encode_body(listed) == encode_body(listed)


def test_the_limits_apply_as_in_encode_body():
    body, small = samples()["plan"].body, Limits(max_frame_bytes=64, max_message_bytes=128)
    with pytest.raises(InvalidMessage, match="frame limit"):
        _encoder().encode_body(body, small)


def test_only_the_parts_used_since_the_last_retain_are_kept():
    enc = _encoder()
    plan = samples()["plan_keys"].body
    other = dataclasses.replace(plan, sender=dataclasses.replace(
        plan.sender, transfers=tuple(dataclasses.replace(t) for t in plan.sender.transfers)))
    enc.encode_body(plan)
    enc.retain()
    enc.encode_body(other)  # (new transfers, the same peers)
    enc.retain()
    encoded = enc.encoded
    enc.encode_body(other)
    assert enc.encoded == encoded
    enc.encode_body(plan)  # (its transfers were dropped at the last retain: encoded again)
    assert enc.encoded == encoded + 1
    assert "kept=" in repr(enc) and "reused=" in repr(enc)


def test_a_list_is_not_kept_it_can_change():
    plan = samples()["plan_keys"].body
    transfers = list(plan.sender.transfers)
    listed = dataclasses.replace(plan, sender=dataclasses.replace(plan.sender, transfers=transfers))
    enc = _encoder()
    enc.encode_body(listed)
    transfers[0] = dataclasses.replace(transfers[0], nbytes=transfers[0].nbytes + 1)
    assert enc.encode_body(listed) == encode_body(listed)
