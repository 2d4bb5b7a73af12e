"""A receiver's part in delta rounds: its delta region, the version its landing memory holds, and the
round's deltas from fence to commit.

How this works: ``DeltaLanding`` owns the delta region (``engine.datapath.deltas``: each row of the
weights maps to a window of it) and ``base``, the committed version every byte of the landing memory
holds (None: unknown). ``begin`` checks the version the round names as this receiver's base against
``base`` and forgets it (the landing memory is written from now on). At the fence ``land`` checks every
delta the senders report and only then applies them all to the landing memory (the checks of
``engine.datapath.deltas.landed``: a bad one is a ``DeltaError`` naming row and sender, and nothing is
applied). At commit ``committed`` records the new base; a two-slot receiver first brings its new
landing slot (the old live one, which holds the round's base) up to the version it just made live:
the round's deltas applied again, its whole rows copied (``catch_up``), so the next round's deltas
apply to it. An abort leaves ``base`` None: the next round sends this receiver whole rows.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import torch

from weightsync.engine.datapath import deltas as dp
from weightsync.engine.datapath.tensors import FlatBuffer
from weightsync.engine.errors import ConfigError
from weightsync.wire import ReceiverTable
from weightsync.wire import messages as m

DEFAULT_DELTA_FRACTION = 0.125  # the delta region's size, as a fraction of the weights' bytes


def check_fraction(fraction: float) -> None:
    if not 0 <= fraction <= 1:
        raise ConfigError("delta_fraction", f"must be within [0, 1], got {fraction}")


class DeltaLanding:
    def __init__(self, fraction: float, nbytes: int, device: torch.device, two_slots: bool) -> None:
        check_fraction(fraction)
        size = int(nbytes * fraction) // dp.ALIGN * dp.ALIGN
        self.region: Optional[FlatBuffer] = FlatBuffer(size, device) if size > 0 else None
        self.two_slots = two_slots
        self.base: Optional[int] = None
        self.round: list[dp.Landed] = []  # the deltas applied at the last fence, until commit or abort
        self.rows = 0  # rows that came as deltas, all rounds
        self.changed = 0  # values they changed
        self.apply_s = 0.0
        self.catch_up_s = 0.0

    def __repr__(self) -> str:
        size = self.region.nbytes if self.region is not None else 0
        return f"<DeltaLanding region={size} base=v{self.base} rows={self.rows} changed={self.changed}>"

    def begin(self, rank: int, bases: tuple[m.Base, ...]) -> Optional[str]:
        """A round begins: why the base it names for this receiver is wrong (None: it is right, or none)."""
        held, self.base, self.round = self.base, None, []
        named = next((b.version for b in bases if b.rank == rank), None)
        if named is not None and named != held:
            return f"the round's base for receiver/{rank} is v{named}, but its landing memory holds v{held}"
        return None

    def land(self, table: ReceiverTable, summaries: tuple[m.WriteSummary, ...], landing: torch.Tensor,
             dtypes: Mapping[str, torch.dtype]) -> list[dp.Landed]:
        """Check every delta of the round, then apply them all to ``landing`` (1-D uint8); the rows whose
        fingerprint did not move as their sender said (``engine.datapath.deltas.apply``)."""
        t0 = time.perf_counter()
        region = self.region.storage if self.region is not None else None
        checked = dp.landed(table, summaries, region, landing, dtypes)
        wrong = dp.apply(checked, landing, dtypes)
        self.changed += sum(d.delta.changes for d in checked)
        self.rows += len(checked)
        self.round = checked
        self.apply_s += time.perf_counter() - t0
        return wrong

    def committed(self, version: int, table: Optional[ReceiverTable], live: torch.Tensor, landing: torch.Tensor,
                  dtypes: Mapping[str, torch.dtype]) -> None:
        """``version`` is live; ``landing`` is where the next round lands (the old live memory for two slots)."""
        if self.region is None:
            return
        self.base = version
        if self.two_slots:
            t0 = time.perf_counter()
            catch_up(self.round, table, live, landing, dtypes)
            self.catch_up_s += time.perf_counter() - t0
        self.round = []


def catch_up(round_deltas: list[dp.Landed], table: Optional[ReceiverTable], live: torch.Tensor,
             landing: torch.Tensor, dtypes: Mapping[str, torch.dtype]) -> None:
    """Bring ``landing`` (the round's base) to ``live`` (the round's result): apply the round's deltas
    again, copy its whole rows (all of ``live`` when nothing came as a delta)."""
    if not round_deltas or table is None:
        landing.copy_(live)
        return
    dp.apply(round_deltas, landing, dtypes, fingerprint=False)  # (the next round's checks cover this slot)
    by_delta = {(d.src, d.entry.index) for d in round_deltas}
    spans = sorted((e.offset, e.offset + e.nbytes) for e in table.entries if (e.src_rank, e.index) not in by_delta)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in merged:
        landing[start:end].copy_(live[start:end])
