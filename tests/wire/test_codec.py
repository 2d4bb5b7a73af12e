"""The codec: golden vectors both ways, property round trips, and typed, field-naming errors."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import msgpack
import pytest
from hypothesis import given, settings

from weightsync import wire
from strategies import bodies
from weightsync.wire import Envelope, TensorSpec, decode, encode, encode_body, errors
from weightsync.wire import messages as m
from wire_samples import MANIFEST, TRANSPORT, samples

GOLDEN = json.loads((pathlib.Path(__file__).resolve().parents[1] / "golden" / "vectors.json").read_text())


def test_golden_covers_every_message_type():
    covered = {env.type for env in samples().values()}
    assert covered == set(m.MESSAGE_TYPES)
    assert set(GOLDEN["vectors"]) == set(samples())


def test_golden_vectors_were_made_for_this_protocol_version():
    assert tuple(GOLDEN["protocol_version"]) == wire.PROTOCOL_VERSION


@pytest.mark.parametrize("name", sorted(samples()))
def test_encode_gives_golden_bytes(name):
    assert [f.hex() for f in encode(samples()[name])] == GOLDEN["vectors"][name]


@pytest.mark.parametrize("name", sorted(samples()))
def test_golden_bytes_decode_to_sample(name):
    frames = [bytes.fromhex(h) for h in GOLDEN["vectors"][name]]
    assert decode(frames) == samples()[name]


@settings(max_examples=300, deadline=None)
@given(body=bodies)
def test_round_trip_every_message_type(body):
    env = Envelope(body, msg_id=7, sender="receiver/3", parent_id=6, version=2)
    frames = encode(env)
    assert decode(frames) == env
    assert encode(decode(frames)) == frames  # canonical: re-encoding gives the same bytes


def _hello_frames(**manifest_changes):
    tensors = list(MANIFEST.tensors)
    tensors[0] = dataclasses.replace(tensors[0], **manifest_changes)
    manifest = dataclasses.replace(MANIFEST, tensors=tuple(tensors))
    hello = m.Hello(m.Role.SENDER, 0, "h", "cpu", 1, 1, 0, (), manifest, TRANSPORT)
    header, body = encode(Envelope(hello, 1, "sender/0"))
    return header, msgpack.unpackb(body)


def _with(header, body):
    return [header, msgpack.packb(body)]


def test_missing_field_is_named():
    header, body = _hello_frames()
    del body["manifest"]["tensors"][0]["dtype"]
    with pytest.raises(errors.MissingField) as e:
        decode(_with(header, body))
    assert e.value.field == "hello.manifest.tensors[0].dtype"


def test_extra_field_is_named():
    header, body = _hello_frames()
    body["transport"]["secret"] = 1
    with pytest.raises(errors.ExtraField) as e:
        decode(_with(header, body))
    assert e.value.field == "hello.transport.secret"


def test_wrong_type_is_named():
    header, body = _hello_frames()
    body["rank"] = "zero"
    with pytest.raises(errors.WrongType) as e:
        decode(_with(header, body))
    assert e.value.field == "hello.rank"


def test_bool_is_not_an_int():
    header, body = _hello_frames()
    body["rank"] = True
    with pytest.raises(errors.WrongType, match="hello.rank"):
        decode(_with(header, body))


def test_negative_size_is_rejected():
    header, body = _hello_frames()
    body["manifest"]["tensors"][0]["nbytes"] = -4
    with pytest.raises(errors.InvalidValue) as e:
        decode(_with(header, body))
    assert e.value.field == "hello.manifest.tensors[0].nbytes"


def test_shape_that_does_not_match_byte_count():
    header, body = _hello_frames()
    body["manifest"]["tensors"][0]["shape"] = [16, 9]
    with pytest.raises(errors.InvalidValue, match=r"embed.weight.*do not match shape \[16, 9\]") as e:
        decode(_with(header, body))
    assert e.value.field == "hello.manifest.tensors[0].nbytes"


def test_unknown_dtype_and_enum_value():
    header, body = _hello_frames()
    body["manifest"]["tensors"][0]["dtype"] = "float7"
    with pytest.raises(errors.InvalidValue, match="float7"):
        decode(_with(header, body))
    header, body = _hello_frames()
    body["role"] = "observer"
    with pytest.raises(errors.InvalidValue, match="hello.role"):
        decode(_with(header, body))


def test_unknown_message_type():
    header = msgpack.unpackb(encode(samples()["commit"])[0])
    header["type"] = "teleport"
    with pytest.raises(errors.UnknownMessageType, match="teleport"):
        decode([msgpack.packb(header), msgpack.packb({})])


def test_frame_over_limit():
    frames = encode(samples()["hello"])
    limits = wire.Limits(max_frame_bytes=100, max_message_bytes=10_000)
    with pytest.raises(errors.MessageTooLarge, match=r"frames\[1\]"):
        decode(frames, limits)
    with pytest.raises(errors.InvalidMessage, match=r"frames\[1\]"):
        encode(samples()["hello"], limits)
    with pytest.raises(errors.MessageTooLarge, match="message limit"):
        decode(frames, wire.Limits(max_frame_bytes=10_000, max_message_bytes=200))


def test_major_mismatch_keeps_header_for_reject():
    env = dataclasses.replace(samples()["hello"], proto=(wire.PROTOCOL_VERSION[0] + 1, 0))
    with pytest.raises(errors.VersionMismatch) as e:
        decode(encode(env))
    assert e.value.theirs == (wire.PROTOCOL_VERSION[0] + 1, 0) and e.value.ours == wire.PROTOCOL_VERSION
    assert e.value.header.msg_id == env.msg_id


def test_minor_may_differ_and_reject_is_readable_from_any_major():
    newer = dataclasses.replace(samples()["hello"], proto=(wire.PROTOCOL_VERSION[0], 9))
    assert decode(encode(newer)).proto == (wire.PROTOCOL_VERSION[0], 9)
    reject = dataclasses.replace(samples()["reject"], proto=(7, 1))
    assert decode(encode(reject)).body.code == m.RejectCode.VERSION_MISMATCH


def test_encode_refuses_invalid_messages_locally():
    with pytest.raises(errors.InvalidMessage, match="heartbeat.seq"):
        encode(Envelope(m.Heartbeat(-1), 1, "x"))
    with pytest.raises(errors.InvalidMessage, match="header.msg_id"):
        encode(Envelope(m.Heartbeat(1), -1, "x"))
    with pytest.raises(errors.InvalidMessage, match="plan.sender"):
        encode(Envelope(m.Plan(1, None, None), 1, "x"))
    assert issubclass(errors.InvalidMessage, errors.LocalProtocolError)
    assert issubclass(errors.FieldError, errors.RemoteProtocolError)


@pytest.mark.parametrize("name", sorted(samples()))
def test_a_body_encoded_beforehand_gives_the_same_frames(name):
    env = samples()[name]
    assert encode(env, body_frame=encode_body(env.body)) == encode(env)


def test_encode_body_refuses_what_encode_refuses():
    with pytest.raises(errors.InvalidMessage, match="plan.sender"):
        encode_body(m.Plan(1, None, None))
    with pytest.raises(errors.InvalidMessage, match="frames.0.*frame limit"):
        encode_body(m.Heartbeat(1), wire.Limits(max_frame_bytes=2, max_message_bytes=100))
    with pytest.raises(errors.InvalidMessage, match="not a protocol message"):
        encode_body(MANIFEST)


def test_manifest_rules():
    t = MANIFEST.tensors[0]
    with pytest.raises(errors.InvalidMessage, match="duplicate parameter"):
        encode(Envelope(m.Hello(m.Role.SENDER, 0, "h", "cpu", 1, 1, 0, (),
                                dataclasses.replace(MANIFEST, tensors=(t, t)), TRANSPORT), 1, "s"))
    over = dataclasses.replace(t, offset=4000)
    with pytest.raises(errors.InvalidMessage, match="overrun region"):
        encode(Envelope(m.Hello(m.Role.SENDER, 0, "h", "cpu", 1, 1, 0, (),
                                dataclasses.replace(MANIFEST, tensors=(over,)), TRANSPORT), 1, "s"))
    with pytest.raises(errors.InvalidMessage, match="tied to itself"):
        encode(Envelope(m.Hello(m.Role.SENDER, 0, "h", "cpu", 1, 1, 0, (),
                                dataclasses.replace(MANIFEST, tensors=(dataclasses.replace(t, tied_to=t.name),)),
                                TRANSPORT), 1, "s"))


def test_shard_must_match_local_shape():
    header, body = _hello_frames()
    body["manifest"]["tensors"][2]["shard"]["stop"] = 3
    with pytest.raises(errors.InvalidValue, match="shard") as e:
        decode(_with(header, body))
    assert e.value.field == "hello.manifest.tensors[2].shard"


def test_tensorspec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MANIFEST.tensors[0].name = "x"  # type: ignore[misc]
    assert isinstance(MANIFEST.tensors[0], TensorSpec)


def _writes_done_frames(proof: bytes):
    env = Envelope(m.WritesDone(3, 9, (m.WriteSummary(0, 2, 64, (), proof),), 0.1, 0.2), 1, "sender/0", None, 3)
    header, body = encode(env)
    return env, header, msgpack.unpackb(body)


def test_optional_field_stays_off_the_wire_at_its_default_and_decodes_to_it():
    env, header, body = _writes_done_frames(b"")
    assert "proof" not in body["receivers"][0]  # bytes identical to a message from before the field existed
    assert decode(_with(header, body)) == env
    env, header, body = _writes_done_frames(b"\x01" * 72)
    assert body["receivers"][0]["proof"] == b"\x01" * 72 and decode(_with(header, body)) == env


def test_the_host_seconds_a_sender_spent_issuing_travel_only_when_it_has_some():
    """``writes_done.issue_s`` (what the controller learns the per-row cost from): off the wire at 0.0,
    so a sender that predates it and one that issued nothing send the bytes they always did."""
    env, header, body = _writes_done_frames(b"")
    assert "issue_s" not in body and decode(_with(header, body)).body.issue_s == 0.0
    env = Envelope(m.WritesDone(3, 9, (), 0.1, 0.2, 0.0, 0.0125), 1, "sender/0", None, 3)
    header, raw = encode(env)
    assert msgpack.unpackb(raw)["issue_s"] == 0.0125 and decode([header, raw]) == env


def test_a_round_in_which_a_sender_was_timing_its_ways_says_so_only_then():
    """``writes_done.trying`` (the controller learns no cost from such a round): off the wire when false."""
    env, header, body = _writes_done_frames(b"")
    assert "trying" not in body and decode(_with(header, body)).body.trying is False
    env = Envelope(m.WritesDone(3, 9, (), 0.1, 0.2, 0.0, 0.0, True), 1, "sender/0", None, 3)
    header, raw = encode(env)
    assert msgpack.unpackb(raw)["trying"] is True and decode([header, raw]) == env


def test_optional_field_is_still_validated():
    with pytest.raises(errors.InvalidMessage, match="proof"):
        encode(Envelope(m.WritesDone(3, 9, (m.WriteSummary(0, 2, 64, (), b"x" * 257),), 0.1, 0.2), 1, "sender/0"))
    _, header, body = _writes_done_frames(b"")
    body["receivers"][0]["proof"] = "text"
    with pytest.raises(errors.WrongType, match=r"writes_done.receivers\[0\].proof"):
        decode(_with(header, body))
    body["receivers"][0]["proof"] = b"x" * 257
    with pytest.raises(errors.InvalidValue, match=r"receivers\[0\].proof"):
        decode(_with(header, body))


def test_a_block_slice_carries_its_dim0_rows_and_a_plain_slice_keeps_its_bytes():
    from weightsync.wire import Slice
    from weightsync.wire.schema import Violation, from_wire, to_wire

    assert to_wire(Slice(0, 2, 4)) == {"dim": 0, "start": 2, "stop": 4}  # as before blocks existed
    block = Slice(1, 0, 128, 32, 64)
    assert to_wire(block) == {"dim": 1, "start": 0, "stop": 128, "dim0_start": 32, "dim0_stop": 64}
    assert from_wire(Slice, to_wire(block)) == block and block.block and not Slice(1, 0, 8).block
    for bad, field in (({"dim": 0, "start": 0, "stop": 4, "dim0_start": 0, "dim0_stop": 2}, "dim0_stop"),
                       ({"dim": 1, "start": 0, "stop": 4, "dim0_start": 3, "dim0_stop": 2}, "dim0_stop"),
                       ({"dim": 1, "start": 0, "stop": 4, "dim0_start": 3}, "dim0_start")):
        with pytest.raises(Violation) as caught:
            from_wire(Slice, bad)
        assert caught.value.path.endswith(field)
