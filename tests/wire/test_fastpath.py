"""The generated fast path (``schema.fast_path``) against the checked walk: the same maps and structs for
valid input, and for broken input the fast path declines and the checked walk names the culprit."""

from __future__ import annotations

import copy
import dataclasses
import random

import msgpack
import pytest
from hypothesis import given, settings

from strategies import bodies
from weightsync.wire import encode, schema
from weightsync.wire.schema import Violation, from_wire, to_wire
from wire_samples import samples

BAD_VALUES = [-1, 2**64, 2**32, True, 1.5, "", "x", b"", None, [], [1], {}, {"x": 1}, (1 << 63) - 1]


def _outcome(fn):
    try:
        return "ok", fn()
    except Violation as v:
        return "violation", (v.kind, v.path, v.detail)


def _fast_outcome(fn):
    """The fast path only accepts or declines (its converters' violations carry no path: declining too)."""
    try:
        return "ok", fn()
    except Exception:  # noqa: BLE001 - what the public functions catch
        return "declined", None


def _leaves(data, at=()):
    """Paths (keys and indices) to every value in a decoded map, containers included."""
    out = [at] if at else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _leaves(v, (*at, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _leaves(v, (*at, i))
    return out


def _set(data, path, value):
    data = copy.deepcopy(data)
    node = data
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize("name", sorted(samples()))
def test_the_fast_path_takes_every_sample_both_ways(name):
    body = samples()[name].body
    fast = schema.fast_path(type(body))
    wire_map = fast.encode(body)  # (raises if it declined: every valid message must take it)
    assert wire_map == schema._checked_to_wire(body, "")
    data = msgpack.unpackb(encode(samples()[name])[1], raw=False)
    assert fast.decode(data) == schema._checked_from_wire(type(body), data, "") == body


@settings(max_examples=300, deadline=None)
@given(body=bodies)
def test_random_messages_take_the_fast_path_to_the_checked_answer(body):
    fast = schema.fast_path(type(body))
    assert _fast_outcome(lambda: fast.encode(body)) == _outcome(lambda: schema._checked_to_wire(body, ""))
    data = msgpack.unpackb(msgpack.packb(schema._checked_to_wire(body, ""), use_bin_type=True), raw=False)
    assert fast.decode(data) == body


@pytest.mark.parametrize("name", sorted(samples()))
def test_broken_maps_are_declined_and_named_by_the_checked_walk(name):
    """Every value of the decoded sample replaced by each bad value, and every key removed, and an extra
    key added: the fast path accepts exactly what the checked walk accepts, with the same struct, and
    the public ``from_wire`` raises the checked walk's violation."""
    rng = random.Random(name)
    cls = type(samples()[name].body)
    data = msgpack.unpackb(encode(samples()[name])[1], raw=False)
    cases = [_set(data, path, value) for path in _leaves(data) for value in [*BAD_VALUES, _DELETE]]
    cases += [_set(data, path + ("extra",), 1) for path in _leaves(data) if isinstance(_get(data, path), dict)]
    cases += [{**data, "extra": 1}]
    checked = 0
    for broken in rng.sample(cases, min(len(cases), 400)):
        slow = _outcome(lambda: schema._checked_from_wire(cls, broken, ""))
        fast = _fast_outcome(lambda: schema.fast_path(cls).decode(broken))
        if slow[0] == "ok":
            assert fast == slow
        else:
            assert fast[0] == "declined"
            assert _outcome(lambda: from_wire(cls, broken)) == slow
            checked += 1
    assert checked > 0


def _get(data, path):
    for k in path:
        data = data[k]
    return data


def _struct_fields(obj, at=()):
    """Paths to every field of a struct tree, as (field name | tuple index) steps."""
    out = []
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            out.append((*at, f.name))
            out += _struct_fields(getattr(obj, f.name), (*at, f.name))
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            out += _struct_fields(v, (*at, i))
    return out


def _replace(obj, path, value):
    if not path:
        return value
    if isinstance(obj, tuple):
        i = path[0]
        return (*obj[:i], _replace(obj[i], path[1:], value), *obj[i + 1:])
    return dataclasses.replace(obj, **{path[0]: _replace(getattr(obj, path[0]), path[1:], value)})


@pytest.mark.parametrize("name", sorted(samples()))
def test_broken_structs_are_declined_and_named_by_the_checked_walk(name):
    rng = random.Random(name)
    body = samples()[name].body
    cases = [(path, value) for path in _struct_fields(body) for value in BAD_VALUES]
    refused = 0
    for path, value in rng.sample(cases, min(len(cases), 300)):
        try:
            broken = _replace(body, path, value)
        except (TypeError, ValueError, Violation):
            continue  # (a struct whose own constructor refuses the value)
        slow = _outcome(lambda: schema._checked_to_wire(broken, ""))
        fast = _fast_outcome(lambda: schema.fast_path(type(broken)).encode(broken))
        if slow[0] == "ok":
            assert fast == slow
        else:
            assert fast[0] == "declined"
            assert _outcome(lambda: to_wire(broken)) == slow
            refused += 1
    assert refused > 0
