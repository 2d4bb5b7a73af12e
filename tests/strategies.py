"""Hypothesis strategies for every wire struct, derived from the schema annotations.

Structs with cross-field rules (byte counts, shard geometry, routing indexes) get hand-written
strategies that only produce valid instances; everything else is derived mechanically, so a new
message type is covered by the property tests without touching this file.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from math import prod
from typing import Annotated, Union

from hypothesis import strategies as st

from weightsync.wire import DTYPE_SIZES, ExpectedEntry, PeerInfo, Manifest, RegionInfo, ShardSpec, SenderTable, Slice, TensorSpec, Transfer
from weightsync.wire import messages as m
from weightsync.wire.routing import ReceiverTable
from weightsync.wire.schema import Range, _JsonMarker

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)


@st.composite
def tensor_specs(draw, name=None):
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    shard = None
    if shape and draw(st.booleans()):
        dim = draw(st.integers(0, len(shape) - 1))
        start = draw(st.integers(0, 4))
        full = list(shape)
        full[dim] = start + shape[dim] + draw(st.integers(0, 4))
        shard = ShardSpec(tuple(full), dim, start, start + shape[dim])
    strides = tuple(draw(st.lists(st.integers(-5, 50), min_size=len(shape), max_size=len(shape))))
    return TensorSpec(
        name=name if name is not None else draw(names),
        dtype=dtype,
        shape=shape,
        nbytes=prod(shape) * DTYPE_SIZES[dtype],
        strides=strides,
        contiguous=draw(st.booleans()),
        device=draw(st.sampled_from(["cpu", "cuda:0", "cuda:7"])),
        region=None,
        offset=draw(st.integers(0, 2**40)),
        shard=shard,
        tied_to=None,
        gatherable=draw(st.booleans()),
    )


@st.composite
def manifests(draw):
    tensor_names = draw(st.lists(names, unique=True, max_size=5))
    tensors = [draw(tensor_specs(name=n)) for n in tensor_names]
    regions = (RegionInfo(0, 2**50, "cpu", draw(st.binary(max_size=8))),)
    out = []
    for i, t in enumerate(tensors):
        tied = tensor_names[0] if i > 0 and draw(st.booleans()) else None
        region = 0 if draw(st.booleans()) else None
        out.append(dataclasses.replace(t, tied_to=tied, region=region, offset=t.offset if region is not None else 0))
    return Manifest(tuple(out), regions)


@st.composite
def sender_tables(draw):
    peers = tuple(draw(st.lists(from_type(PeerInfo), min_size=1, max_size=3, unique_by=lambda p: p.rank)))
    ranks = [p.rank for p in peers]
    n = draw(st.integers(0, 4))
    transfers = tuple(
        dataclasses.replace(draw(from_type(Transfer)), index=i, dst_rank=draw(st.sampled_from(ranks)))
        for i in range(n)
    )
    return SenderTable(draw(st.integers(0, 2**32 - 1)), transfers, peers)


@st.composite
def receiver_tables(draw):
    entries = draw(st.lists(from_type(ExpectedEntry), max_size=4))
    uniq = {(e.src_rank, e.index): e for e in entries}
    return ReceiverTable(draw(st.integers(0, 2**32 - 1)), tuple(uniq.values()))


@st.composite
def plans(draw):
    if draw(st.booleans()):
        return m.Plan(draw(st.integers(0, 2**64 - 1)), draw(sender_tables()), None)
    return m.Plan(draw(st.integers(0, 2**64 - 1)), None, draw(receiver_tables()))


def _slices():
    return st.builds(
        lambda dim, a, b: Slice(dim, min(a, b), max(a, b)),
        st.integers(0, 4), st.integers(0, 2**40), st.integers(0, 2**40),
    )


def _shards():
    return st.integers(1, 3).flatmap(
        lambda nd: st.tuples(st.lists(st.integers(1, 100), min_size=nd, max_size=nd), st.integers(0, nd - 1))
    ).flatmap(
        lambda fd: st.integers(0, fd[0][fd[1]]).flatmap(
            lambda a: st.integers(a, fd[0][fd[1]]).map(lambda b: ShardSpec(tuple(fd[0]), fd[1], a, b))
        )
    )


OVERRIDES = {
    TensorSpec: tensor_specs(),
    Manifest: manifests(),
    SenderTable: sender_tables(),
    m.Plan: plans(),
    Slice: _slices(),
    ShardSpec: _shards(),
}


def from_annotation(tp):
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        for x in meta:
            if isinstance(x, Range):
                return st.integers(x.lo, x.hi)
            if isinstance(x, _JsonMarker):
                return json_values
        return from_annotation(base)
    if origin is Union:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | from_annotation(inner)
    if origin is tuple:
        return st.lists(from_annotation(typing.get_args(tp)[0]), max_size=3).map(tuple)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if dataclasses.is_dataclass(tp):
        return from_type(tp)
    return {bool: st.booleans(), str: st.text(max_size=10), bytes: st.binary(max_size=10),
            float: st.floats(allow_nan=False), int: st.integers(-(2**63), 2**63 - 1)}[tp]


def from_type(cls):
    if cls in OVERRIDES:
        return OVERRIDES[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f.name: from_annotation(hints[f.name]) for f in dataclasses.fields(cls)})


OVERRIDES[ReceiverTable] = receiver_tables()


def _with_field(cls, **fields):
    """``cls`` built from its annotations, with strategies of its own for ``fields`` (values ``_check`` allows)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f.name: fields[f.name] if f.name in fields else from_annotation(hints[f.name]) for f in dataclasses.fields(cls)})


OVERRIDES[m.UpdateBegin] = _with_field(m.UpdateBegin, delta=st.sampled_from(m.DELTA_MODES))
OVERRIDES[m.Arm] = _with_field(m.Arm, delta=st.sampled_from(m.DELTA_MODES))
OVERRIDES[m.Welcome] = st.one_of(
    _with_field(m.Welcome, stream_port=st.none()),
    _with_field(m.Welcome, stream_port=st.integers(1, 65535), stream_token=st.binary(min_size=16, max_size=16)))

bodies = st.sampled_from(sorted(m.MESSAGE_TYPES)).flatmap(lambda t: from_type(m.MESSAGE_TYPES[t]))
