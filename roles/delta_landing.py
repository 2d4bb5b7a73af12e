"""A receiver's part in delta rounds: its delta region, the version its deltas apply to, and a round's
deltas checked and applied at the fence.

How this works: ``DeltaLanding`` owns the delta region (``engine.datapath.deltas``: each row of the
weights maps to a window of it) and ``base``, the committed version deltas apply to
(None: unknown). ``begin`` checks the version the round names as this receiver's base against
``base`` and forgets it (the landing memory is written from now on). At the fence ``land`` checks every
delta the senders report and only then applies them all to the landing memory (the checks of
``engine.datapath.delta_checks.landed``: a bad one is a ``DeltaError`` naming row and sender, and nothing is
applied; each row's view and window, ``delta_checks.Rows``, are worked out once per plan and landing memory). A two-slot receiver's landing slot holds an older version, so there each delta row is first
copied from the live slot (which holds the base: the committed version) and the delta applied to that
copy; rows that come whole overwrite the landing slot anyway. Every write the receiver makes to its
landing memory thus happens at the fence, after every sender's writes are delivered: none can race the
next round's writes (a copy at commit, on a GPU queued behind the commit, could). At commit
``committed`` records the new base. An abort leaves ``base`` None: the next round sends this receiver
whole rows.
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import torch

from weightsync.engine.datapath import delta_checks as checks
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
    def __init__(self, fraction: float, nbytes: int, device: torch.device) -> None:
        check_fraction(fraction)
        size = int(nbytes * fraction) // dp.ALIGN * dp.ALIGN
        self.region: Optional[FlatBuffer] = FlatBuffer(size, device) if size > 0 else None
        self.base: Optional[int] = None
        self.rows = 0  # rows that came as deltas, all rounds
        self.changed = 0  # values they changed
        self.apply_s = 0.0
        self._rows: dict[int, checks.Rows] = {}  # per landing memory (a two-slot receiver's two): its table's rows

    def __repr__(self) -> str:
        size = self.region.nbytes if self.region is not None else 0
        return f"<DeltaLanding region={size} base=v{self.base} rows={self.rows} changed={self.changed}>"

    def begin(self, rank: int, bases: tuple[m.Base, ...]) -> Optional[str]:
        """A round begins: why the base it names for this receiver is wrong (None: it is right, or none)."""
        held, self.base = self.base, None
        named = next((b.version for b in bases if b.rank == rank), None)
        if named is not None and named != held:
            return f"the round's base for receiver/{rank} is v{named}, but the base it holds is v{held}"
        return None

    def land(self, table: ReceiverTable, summaries: tuple[m.WriteSummary, ...], landing: torch.Tensor,
             dtypes: Mapping[str, torch.dtype], live: Optional[torch.Tensor] = None) -> list[checks.Landed]:
        """Check every delta of the round, then apply them all to ``landing`` (1-D uint8), each row first
        copied from ``live`` where that is other memory (a two-slot receiver); the rows whose fingerprint
        did not move as their sender said (``engine.datapath.delta_checks.apply``)."""
        t0 = time.perf_counter()
        region = self.region.storage if self.region is not None else None
        checked = checks.landed(table, summaries, region, landing, dtypes, self._rows_of(table, landing, region, dtypes))
        if live is not None and live.data_ptr() != landing.data_ptr():
            for start, end in _spans((d.entry.offset, d.entry.offset + d.entry.nbytes) for d in checked):
                landing[start:end].copy_(live[start:end])
        wrong = checks.apply(checked, landing, dtypes)
        self.changed += sum(d.changes for d in checked)
        self.rows += len(checked)
        self.apply_s += time.perf_counter() - t0
        return wrong

    def _rows_of(self, table: ReceiverTable, landing: torch.Tensor, region: Optional[torch.Tensor],
                 dtypes: Mapping[str, torch.dtype]) -> checks.Rows:
        """``table``'s rows in ``landing``, as the checks need them: worked out as rows first come as deltas,
        then kept for the plan (another table's are dropped, with the memory their views hold)."""
        rows = self._rows.get(landing.data_ptr())
        if rows is None or not rows.fits(table, landing, region):
            if any(r.table is not table for r in self._rows.values()):
                self._rows.clear()
            rows = self._rows[landing.data_ptr()] = checks.Rows(table, landing, region, dtypes)
        return rows

    def committed(self, version: int) -> None:
        """``version`` is live: the next round's deltas apply to it."""
        if self.region is not None:
            self.base = version


def _spans(spans) -> list[tuple[int, int]]:
    """Byte ranges, sorted and merged where they touch or overlap (one copy per run of adjacent rows)."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]
