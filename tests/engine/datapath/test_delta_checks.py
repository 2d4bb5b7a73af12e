"""The receiver's checks of a round's deltas before any is applied (engine.datapath.delta_checks): a delta
that names no row of its sender, comes twice, overflows its window, is shorter than a header or comes to
a receiver without a delta region is refused naming the row and the sender, and nothing is written; a
receiver's ``Rows`` are worked out once and kept while table and memory stay."""

from __future__ import annotations

import pytest
import torch

from weightsync.engine.datapath import delta_checks as checks
from weightsync.engine.datapath.delta_rows import advance
from weightsync.engine.datapath.deltas import window
from weightsync.engine.transforms import delta as codec
from weightsync.wire import ExpectedEntry, ReceiverTable
from weightsync.wire.messages import DeltaRow, WriteSummary

SIZES = {"a": 4096, "b": 2048}  # bf16 values
DTYPES = {name: torch.bfloat16 for name in SIZES}


def _table() -> ReceiverTable:
    entries, offset = [], 0
    for index, (name, numel) in enumerate(SIZES.items()):
        entries.append(ExpectedEntry(name, 0, index, None, 0, offset, numel * 2, ""))
        offset += numel * 2
    return ReceiverTable(0, tuple(entries))


def _setup():
    """(table, landing with the base in it, delta region, {name: (new values, its DeltaRow, packed)})."""
    gen = torch.Generator().manual_seed(0)
    table = _table()
    landing = torch.zeros(sum(SIZES.values()) * 2, dtype=torch.uint8)
    region = torch.zeros(landing.numel() // 8, dtype=torch.uint8)
    made = {}
    for e in table.entries:
        base = torch.randn(SIZES[e.name], generator=gen).to(torch.bfloat16)
        landing[e.offset:e.offset + e.nbytes].view(torch.bfloat16).copy_(base)
        new = base.clone()
        codec.bits(new)[torch.randperm(new.numel(), generator=gen)[:20]] += 1
        delta, change, _ = advance(base.clone(), new)
        packed = codec.pack_tensor(delta)
        start, capacity = window(e.offset, e.nbytes, landing.numel(), region.numel())
        assert packed.numel() <= capacity
        region[start:start + packed.numel()] = packed
        made[e.name] = (new, DeltaRow(e.index, packed.numel(), change, delta.changes), packed)
    return table, landing, region, made


def _summary(*rows: DeltaRow) -> tuple[WriteSummary, ...]:
    return (WriteSummary(0, len(rows), sum(r.nbytes for r in rows), (), b"", rows),)


def test_checked_deltas_apply_bit_exact_with_their_fingerprint_change_and_rows_are_kept():
    table, landing, region, made = _setup()
    rows = checks.Rows(table, landing, region, DTYPES)
    got = checks.landed(table, _summary(made["a"][1], made["b"][1]), region, landing, DTYPES, rows)
    assert [d.entry.name for d in got] == ["a", "b"] and len(rows.known) == 2
    assert checks.apply(got, landing, DTYPES) == []  # every fingerprint moved as its sender said
    for e in table.entries:
        assert torch.equal(landing[e.offset:e.offset + e.nbytes].view(torch.bfloat16), made[e.name][0])
    kept = dict(rows.known)
    checks.landed(table, _summary(made["a"][1]), region, landing, DTYPES, rows)
    assert all(rows.known[k] is v for k, v in kept.items())  # (worked out once: the same views next round)
    assert rows.fits(table, landing, region)
    assert not rows.fits(_table(), landing, region)  # (another plan's table: its own rows)
    assert not rows.fits(table, landing.clone(), region)  # (other memory: the other landing slot)


@pytest.mark.parametrize("case, says", [
    ("unknown", "names a row this receiver does not expect"),
    ("twice", "sent twice in one round"),
    ("overflow", "overflow its window"),
    ("short", "shorter than a delta's header"),
    ("no region", "without a delta region"),
])
def test_a_delta_that_does_not_fit_the_plan_is_refused_naming_row_and_sender_and_nothing_is_written(case, says):
    table, landing, region, made = _setup()
    good = made["a"][1]
    e = table.entries[0]
    rows = {
        "unknown": (good, DeltaRow(7, good.nbytes, good.change, good.changes)),
        "twice": (good, good),
        "overflow": (DeltaRow(0, window(e.offset, e.nbytes, landing.numel(), region.numel())[1] + 1, 0, 0),),
        "short": (DeltaRow(0, codec.HEADER_BYTES - 1, 0, 0),),
        "no region": (good,),
    }[case]
    before = landing.clone()
    with pytest.raises(codec.DeltaError) as err:
        checks.landed(table, _summary(*rows), None if case == "no region" else region, landing, DTYPES,
                      checks.Rows(table, landing, region, DTYPES))
    assert says in err.value.text and err.value.peer == "sender/0"
    assert err.value.row == ("transfer 7" if case == "unknown" else "a")
    assert torch.equal(landing, before)
