"""``Columns[X]`` (``wire.columns``): a table as one array per field. Round trips, the per-element
walk naming a bad value at encode, and every malformed column refused at decode with its field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strategies import from_type
from weightsync.wire import ExpectedEntry, Envelope, Slice, Transfer, decode, encode, encode_body, errors
from weightsync.wire import messages as m
from weightsync.wire.columns import Rows, converters
from weightsync.wire.schema import Violation, to_wire
from wire_samples import samples

TO, FROM = converters(Transfer)


@given(st.lists(from_type(Transfer), max_size=20), st.lists(from_type(ExpectedEntry), max_size=20))
def test_tables_round_trip_through_columns(transfers, entries):
    assert FROM(msgpack.unpackb(msgpack.packb(TO(tuple(transfers), "t")), raw=False), "t") == tuple(transfers)
    to, frm = converters(ExpectedEntry)
    assert frm(to(tuple(entries), "e"), "e") == tuple(entries)


def test_columns_hold_one_array_per_field_and_each_string_once():
    names = ["a.weight", "b.weight", "a.weight", "a.weight"]
    table = tuple(Transfer(i, n, Slice(0, i, i + 1) if i % 2 else None, 1, n, 0, 64 * i, 64, "")
                  for i, n in enumerate(names))
    cols = TO(table, "transfers")
    assert cols["n"] == 4 and set(cols) == {"n", *(f.name for f in dataclasses.fields(Transfer))}
    assert cols["name"]["strings"] == ["a.weight", "b.weight"]
    assert cols["name"]["index"] == bytes([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])  # (u32, little-endian)
    assert cols["nbytes"] == (64).to_bytes(8, "little") * 4
    assert cols["slice"]["present"] == b"\x00\x01\x00\x01" and cols["slice"]["values"]["n"] == 2
    big = tuple(Transfer(i, f"layers.{i // 4}.mlp.w{i % 4}", None, i % 8, f"layers.{i // 4}.mlp.w{i % 4}", 0,
                         4096 * i, 4096, "") for i in range(256))
    assert len(msgpack.packb(TO(big, ""))) < 0.7 * len(msgpack.packb([to_wire(t) for t in big]))


@pytest.mark.parametrize("bad, field", [
    (lambda t: dataclasses.replace(t, nbytes=-1), r"transfers\[1\].nbytes"),
    (lambda t: dataclasses.replace(t, dst_rank=True), r"transfers\[1\].dst_rank"),
    (lambda t: dataclasses.replace(t, name=b"x"), r"transfers\[1\].name"),
    (lambda t: dataclasses.replace(t, slice=Slice(0, 5, 2)), r"transfers\[1\].slice.stop"),
    (lambda t: m.DataKey(1, bytes(32)), r"transfers\[1\]"),
])
def test_encode_names_the_bad_element_and_field(bad, field):
    good = samples()["plan"].body.sender.transfers
    with pytest.raises(Violation, match=field):
        TO((good[0], bad(good[1])), "transfers")


def _plan_frames(mutate):
    env = samples()["plan"]
    header, body = encode(env)
    data = msgpack.unpackb(body, raw=False)
    mutate(data["sender"]["transfers"])
    return [header, msgpack.packb(data, use_bin_type=True)]


@pytest.mark.parametrize("mutate, error, field", [
    (lambda c: c.update(n=3), errors.InvalidValue, "plan.sender.transfers.index"),
    (lambda c: c.update(n=-1), errors.InvalidValue, "plan.sender.transfers.n"),
    (lambda c: c.update(n=True), errors.InvalidValue, "plan.sender.transfers.n"),
    (lambda c: c.pop("nbytes"), errors.MissingField, "plan.sender.transfers"),
    (lambda c: c.update(extra=b""), errors.ExtraField, "plan.sender.transfers"),
    (lambda c: c.update(nbytes=c["nbytes"][:-1]), errors.InvalidValue, "plan.sender.transfers.nbytes"),
    (lambda c: c.update(nbytes=[1, 2]), errors.WrongType, "plan.sender.transfers.nbytes"),
    (lambda c: c["name"].update(index=(7).to_bytes(4, "little") * 2), errors.InvalidValue,
     "plan.sender.transfers.name.index"),
    (lambda c: c["name"].update(strings=[1, 2]), errors.WrongType, "plan.sender.transfers.name.strings"),
    (lambda c: c["slice"].update(present=b"\x00\x02"), errors.InvalidValue, "plan.sender.transfers.slice.present"),
    (lambda c: c["slice"].update(present=b"\x01\x01"), errors.InvalidValue, "plan.sender.transfers.slice.values"),
    (lambda c: c["slice"]["values"].update(stop=(1).to_bytes(8, "little")), errors.InvalidValue,
     r"plan.sender.transfers.slice.values\[0\].stop"),
    (lambda c: c.update(index=(5).to_bytes(4, "little") + (1).to_bytes(4, "little")), errors.InvalidValue,
     r"plan.sender.transfers\[0\].index"),
])
def test_decode_names_the_malformed_column(mutate, error, field):
    with pytest.raises(error, match=field):
        decode(_plan_frames(mutate))


def test_keys_travel_as_columns_of_bytes_and_a_short_key_is_named():
    env = samples()["plan_keys"]
    assert decode(encode(env)).body == env.body
    header, body = encode(env)
    data = msgpack.unpackb(body, raw=False)
    assert data["keys"]["key"]["data"] == bytes(range(32)) and data["keys"]["key"]["lengths"] == b"\x20\0\0\0"
    data["keys"]["key"] = {"lengths": b"\x05\0\0\0", "data": bytes(5)}
    with pytest.raises(errors.InvalidValue, match=r"plan.keys\[0\].key"):
        decode([header, msgpack.packb(data, use_bin_type=True)])
    data["keys"]["key"] = {"lengths": b"\x20\0\0\0", "data": bytes(31)}
    with pytest.raises(errors.InvalidValue, match="plan.keys.key.data"):
        decode([header, msgpack.packb(data, use_bin_type=True)])
    with pytest.raises(errors.InvalidMessage, match=r"plan.keys\[0\].key"):
        encode(Envelope(dataclasses.replace(env.body, keys=(m.DataKey(1, b"short"),)), 1, "c"))


def _rows(elements, cls=Transfer):
    return Rows(cls, {f.name: [getattr(x, f.name) for x in elements] for f in dataclasses.fields(cls)})


@given(st.lists(from_type(Transfer), max_size=20))
def test_rows_read_as_the_tuple_of_their_elements_and_encode_to_its_bytes(transfers):
    rows = _rows(transfers)
    assert len(rows) == len(transfers) and tuple(rows) == tuple(transfers) and list(rows[:3]) == transfers[:3]
    assert rows == tuple(transfers) and tuple(transfers) == rows and rows == _rows(transfers)
    assert all(rows[i] == t for i, t in enumerate(transfers)) and hash(rows) == hash(tuple(transfers))
    assert msgpack.packb(TO(rows, "t")) == msgpack.packb(TO(tuple(transfers), "t"))


def test_a_table_of_rows_is_checked_and_encoded_as_its_tuple():
    plan = samples()["plan"].body
    table = plan.sender
    as_rows = dataclasses.replace(plan, sender=dataclasses.replace(table, transfers=_rows(table.transfers)))
    assert encode_body(as_rows) == encode_body(plan) and "Rows[Transfer](2 rows)" in repr(as_rows)
    swapped = _rows(table.transfers[::-1])
    with pytest.raises(errors.InvalidMessage, match=r"transfers\[0\].index"):
        encode_body(dataclasses.replace(plan, sender=dataclasses.replace(table, transfers=swapped)))
    elsewhere = _rows([dataclasses.replace(t, dst_rank=4) for t in table.transfers])
    with pytest.raises(errors.InvalidMessage, match=r"transfers\[0\].dst_rank.*receiver 4"):
        encode_body(dataclasses.replace(plan, sender=dataclasses.replace(table, transfers=elsewhere)))
    bad = _rows([table.transfers[0], dataclasses.replace(table.transfers[1], nbytes=-1)])
    with pytest.raises(errors.InvalidMessage, match=r"transfers\[1\].nbytes"):
        encode_body(dataclasses.replace(plan, sender=dataclasses.replace(table, transfers=bad)))


def test_rows_need_every_column_at_one_length():
    with pytest.raises(TypeError, match="needs the columns"):
        Rows(Transfer, {"index": (0,)})
    cols = {f.name: (0,) for f in dataclasses.fields(Transfer)}
    with pytest.raises(ValueError, match="different lengths"):
        Rows(Transfer, {**cols, "nbytes": (1, 2)})


def test_checksums_decode_as_columns_checked_and_equal_to_their_elements():
    """``columns[Checksum]`` decodes to ``Rows`` (``Checksum.KEPT_AS_COLUMNS``: a checked round carries
    one per row; the controller passes them on, the receiver reads two columns), equal to the tuple of
    Checksums it was made from and re-encoded to the same bytes; the columns are still checked first."""
    from weightsync.wire.columns import column

    summary = m.WriteSummary(1, 2, 8, (m.Checksum(0, 2**64 - 1), m.Checksum(3, 0)))
    frames = encode(Envelope(m.Fence(4, (summary,)), 1, "controller"))
    got = decode(frames).body.checksums[0].checksums
    assert type(got) is Rows and got == summary.checksums and column(got, "value") == (2**64 - 1, 0)
    assert encode(Envelope(m.Fence(4, (dataclasses.replace(summary, checksums=got),)), 1, "controller")) == frames
    body = msgpack.unpackb(frames[1])
    body["checksums"][0]["checksums"]["n"] = 3  # (two values in each column)
    with pytest.raises(errors.ProtocolError) as e:
        decode([frames[0], msgpack.packb(body)])
    assert "checksums" in str(e.value)


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c.update(index=b"\x00\x00\x00\x00"), "checksums.index"),  # (n=0 but a value in a column)
    (lambda c: c.update(extra=b""), "checksums"),
    (lambda c: c.pop("value"), "checksums"),
    (lambda c: c.update(value=""), "checksums.value"),  # (a string where the column's bytes go)
])
def test_no_rows_decode_as_the_empty_columns_and_nothing_else_passes_for_them(mutate, field):
    """A summary with no checksums (most of them) encodes and decodes its empty columns as one map made
    once: the same bytes as the walk per column gives, decoded to no rows (``Rows`` where
    the struct is kept as columns); a map of no rows that differs from it in any way still goes through
    the checks and is refused naming its field."""
    from weightsync.wire.columns import _structs

    summary = m.WriteSummary(1, 2, 8, ())
    frames = encode(Envelope(m.Fence(4, (summary,)), 1, "controller"))
    body = msgpack.unpackb(frames[1])
    assert body["checksums"][0]["checksums"] == _structs(m.Checksum)[0]([])
    assert "deltas" not in body["checksums"][0]  # (an optional field at its default stays off the wire)
    got = decode(frames).body.checksums[0]
    assert type(got.checksums) is Rows and len(got.checksums) == 0 and got.deltas == ()
    assert got == summary and encode(Envelope(m.Fence(4, (got,)), 1, "controller")) == frames
    mutate(body["checksums"][0]["checksums"])
    with pytest.raises(errors.ProtocolError, match=field):
        decode([frames[0], msgpack.packb(body, use_bin_type=True)])
