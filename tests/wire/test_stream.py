"""A session stream's bytes (wire.stream): golden handshake bytes, records both ways, and every way a
record or a handshake can be wrong."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, strategies as st

from weightsync.wire import stream as ws

KEY = b"k" * 32
NC, NS = bytes(range(16)), bytes(range(16, 32))


def test_the_handshake_bytes_are_these():
    """Golden: the derived key, the three messages and the direction keys, for fixed nonces."""
    key = ws.stream_key(KEY)
    assert key.hex() == "4eff05c9edd9c297189c0369add8ffc6bb4bca01c9efb32c3604b4af971aba7e"
    opening = ws.opening(NC)
    assert opening == b"WSSTRM01" + NC
    answer, client_nonce, server_nonce = ws.server_answer(key, opening, NS)
    assert (client_nonce, server_nonce) == (NC, NS)
    assert answer[:24] == b"WSSTRM01" + NS
    assert answer[24:].hex() == "f01c0a289b44ff3592ff394e62e4c74e8de80b31c5b33caaabbc2aadbcd08790"
    proof, nonce = ws.client_proof(key, NC, answer)
    assert nonce == NS and proof == hmac.digest(key, b"client" + NC + NS, hashlib.sha256)
    ws.check_client_proof(key, NC, NS, proof)
    c2s, s2c = ws.direction_keys(key, NC, NS)
    assert c2s != s2c and len(c2s) == len(s2c) == 32


def test_a_party_without_the_key_completes_neither_side():
    ours, theirs = ws.stream_key(KEY), ws.stream_key(b"x" * 32)
    answer, _, _ = ws.server_answer(theirs, ws.opening(NC), NS)
    with pytest.raises(ws.StreamRefused, match="server's proof"):
        ws.client_proof(ours, NC, answer)
    proof, _ = ws.client_proof(theirs, NC, answer)
    with pytest.raises(ws.StreamRefused, match="client's proof"):
        ws.check_client_proof(ours, NC, NS, proof)
    with pytest.raises(ws.StreamRefused, match="did not open"):  # (not a weightsync stream at all)
        ws.server_answer(ours, b"GET / HTTP/1.1\r\n\r\n12345")


def test_a_replayed_client_proof_fails_against_a_fresh_server_nonce():
    key = ws.stream_key(KEY)
    answer, _, _ = ws.server_answer(key, ws.opening(NC), NS)
    captured, _ = ws.client_proof(key, NC, answer)
    with pytest.raises(ws.StreamRefused):
        ws.check_client_proof(key, NC, bytes(16), captured)


@given(st.lists(st.binary(max_size=300), max_size=5))
def test_records_round_trip_through_sealing_and_framing(frames):
    c2s, _ = ws.direction_keys(ws.stream_key(KEY), NC, NS)
    sealer, opener, framer = ws.Sealer(c2s), ws.Sealer(c2s), ws.Framer(10_000)
    data = b"".join(ws.record(sealer.seal(ws.pack(frames))) for _ in range(3))
    got = []
    for i in range(0, len(data), 7):  # (bytes arrive in any pieces)
        got += [ws.unpack(opener.open(r)) for r in framer.feed(data[i:i + 7])]
    assert got == [frames] * 3


def test_a_record_altered_repeated_or_reordered_does_not_open():
    c2s, s2c = ws.direction_keys(ws.stream_key(KEY), NC, NS)
    sealer = ws.Sealer(c2s)
    one, two = sealer.seal(b"first"), sealer.seal(b"second")
    with pytest.raises(ws.Unsealed):
        ws.Sealer(c2s).open(bytes([one[0] ^ 1]) + one[1:])
    with pytest.raises(ws.Unsealed):  # (second before first)
        ws.Sealer(c2s).open(two)
    opener = ws.Sealer(c2s)
    assert opener.open(one) == b"first"
    with pytest.raises(ws.Unsealed):  # (first again)
        opener.open(one)
    with pytest.raises(ws.Unsealed):  # (the other direction's key)
        ws.Sealer(s2c).open(one)


def test_without_a_key_records_pass_through():
    assert ws.Sealer(None).seal(b"abc") == b"abc" and ws.Sealer(None).open(b"abc") == b"abc"


@pytest.mark.parametrize("data,match", [
    (b"\x01\x00", "shorter"),
    ((9).to_bytes(4, "little"), "9 frames"),
    ((1).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"abc", "past the record"),
    ((1).to_bytes(4, "little") + (1).to_bytes(4, "little") + b"ab", "after a record"),
    ((1).to_bytes(4, "little") + b"\x01", "cut inside"),
])
def test_a_record_whose_frames_do_not_add_up_is_malformed(data, match):
    with pytest.raises(ws.Malformed, match=match):
        ws.unpack(data)


def test_a_record_over_the_limit_is_refused_before_it_is_read():
    with pytest.raises(ws.Malformed, match="over the stream's limit"):
        list(ws.Framer(100).feed((101).to_bytes(4, "little")))
