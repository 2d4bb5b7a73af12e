"""Fuzz ``decode``: 100,000 random and mutated frame lists raise nothing but ProtocolError."""

from __future__ import annotations

import random
import time

import msgpack

from weightsync.wire import decode, encode, errors
from wire_samples import samples

N_CASES = 100_000


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:  # flip a byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)):]
        elif op == 2:  # insert junk
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and len(b) > 2:  # duplicate a slice
            i = rng.randrange(len(b) - 1)
            b[i:i] = b[i:i + rng.randint(1, 16)]
        else:  # set a byte to a MessagePack marker that changes the structure
            if b:
                b[rng.randrange(len(b))] = rng.choice([0xC0, 0xC1, 0xC4, 0xC7, 0xD4, 0xDC, 0xDE, 0x90, 0x80, 0xFF])
    return bytes(b)


def _random_object(rng: random.Random, depth: int = 0):
    choice = rng.randrange(8 if depth < 3 else 5)
    if choice == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if choice == 1:
        return rng.random()
    if choice == 2:
        return rng.choice(["", "hello", "x" * rng.randint(0, 9), "plan"])
    if choice == 3:
        return rng.randbytes(rng.randint(0, 6))
    if choice == 4:
        return rng.choice([None, True, False])
    if choice == 5:
        return [_random_object(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["type", "major", "rank", "version", "x"]): _random_object(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def _case(rng: random.Random, valid: list[list[bytes]]) -> object:
    kind = rng.randrange(6)
    base = rng.choice(valid)
    if kind == 0:
        return [_mutate(rng, base[0]), base[1]]
    if kind == 1:
        return [base[0], _mutate(rng, base[1])]
    if kind == 2:  # a header from one message, a body from another
        return [base[0], rng.choice(valid)[1]]
    if kind == 3:  # valid MessagePack, arbitrary structure
        return [msgpack.packb(_random_object(rng)), msgpack.packb(_random_object(rng))]
    if kind == 4:  # random bytes and frame counts
        return [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 3))]
    # header kept, body with one field replaced by a random object
    body = msgpack.unpackb(base[1])
    if isinstance(body, dict) and body:
        body[rng.choice(sorted(body))] = _random_object(rng)
    return [base[0], msgpack.packb(body)]


def test_decode_raises_only_protocol_errors():
    rng = random.Random(20261122)
    valid = [encode(env) for env in samples().values()]
    outcomes = {"ok": 0, "error": 0}
    start = time.perf_counter()
    for _ in range(N_CASES):
        frames = _case(rng, valid)
        try:
            decode(frames)
            outcomes["ok"] += 1
        except errors.ProtocolError:
            outcomes["error"] += 1
    elapsed = time.perf_counter() - start
    assert outcomes["error"] > N_CASES // 2, outcomes  # the cases are mostly invalid, as intended
    print(f"fuzz: {N_CASES} cases in {elapsed:.2f}s {outcomes}")


def test_non_bytes_frames():
    for frames in (None, "ab", [b"a", 3], [object(), b""], (b"",), [b"", b"", b""]):
        try:
            decode(frames)  # type: ignore[arg-type]
        except errors.MalformedFrames:
            continue
        raise AssertionError(f"{frames!r} decoded")
