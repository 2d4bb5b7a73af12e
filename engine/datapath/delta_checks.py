"""Delta rounds on the receiver: the round's deltas checked, then applied, at the fence.

How this works: the rows that came as deltas (``WriteSummary.deltas``) are read from their windows of
the delta region (``engine.datapath.deltas.window``) and checked by ``landed`` — each names a row of the
sender that sent it, once, inside its window, and is a well-formed delta for that row (header, escape
counts, positions strictly increasing and inside the row) — all of them before any byte is applied; a
bad one is a ``DeltaError`` naming the row and the sender (each row's view and window are worked out once
and kept, ``Rows``: a receiver keeps them per plan and landing slot). ``apply`` then adds them to the landing
memory and returns those whose ``fp64`` fingerprint moved otherwise than their sender said. Rows the
batched kernels take (``delta_rows.batched``) are checked and applied together: on GPUs one read of
their headers, one launch pair and one read for the verdicts, one launch and one read for the
fingerprint changes (``engine.cuda.delta_apply.Applier``); on CPUs one compiled walk of every delta,
then one compiled apply per thread, on up to ``APPLY_THREADS`` threads (``delta_cpu.Applier``); others
one by one (the compiled kernels where numba is, else the torch codec).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Callable, Mapping, Optional

import torch

from weightsync.wire import ExpectedEntry, ReceiverTable
from weightsync.wire.messages import DeltaRow, WriteSummary

from ..transforms import delta as codec
from ..transforms import delta_cpu
from . import delta_rows
from .delta_rows import apply_row, batched, check_row
from .deltas import window

APPLY_THREADS = 4  # threads a receiver applies a round's CPU deltas with (rows in parallel), at most


@dataclasses.dataclass(frozen=True)
class Landed:
    """A checked delta: entry ``entry`` of sender ``src``, ready to apply."""

    src: int
    entry: ExpectedEntry
    delta: Optional[codec.Delta]  # None: in a batch of the batched kernels (``checked``: its Applier and place)
    checked: Optional[tuple]  # the torch check's (positions, steps); None: the compiled kernels'
    change: int  # the fingerprint change its sender reported
    changes: int  # the values it changes


def expected(per_sender: Mapping[int, tuple[int, int]], table: ReceiverTable,
             summaries: tuple[WriteSummary, ...]) -> dict[int, tuple[int, int]]:
    """Sender rank -> (writes, bytes) to expect from it this round: ``per_sender`` (the table's), less
    what its deltas saved (it counts a delta's payload, not its row)."""
    if not any(s.deltas for s in summaries):
        return per_sender  # (a dense round: no walk over the table's rows at the fence)
    size = {(e.src_rank, e.index): e.nbytes for e in table.entries}
    saved = {s.peer_rank: sum(size.get((s.peer_rank, d.index), 0) - d.nbytes for d in s.deltas) for s in summaries}
    return {src: (count, nbytes - saved.get(src, 0)) for src, (count, nbytes) in per_sender.items()}


def _row(landing: torch.Tensor, entry: ExpectedEntry, dtypes: Mapping[str, torch.dtype]) -> torch.Tensor:
    """``entry``'s row of ``landing`` (1-D uint8), as its values."""
    return landing[entry.offset:entry.offset + entry.nbytes].view(dtypes[entry.name])


class Rows:
    """A table's rows in one landing memory, as the checks of ``landed`` need them, worked out once per
    row and kept (a receiver keeps one per plan and landing slot): (sender, transfer index) -> (its
    entry, its values in the landing memory, where its window of the delta region starts, the window's
    bytes, whether the batched kernels take it)."""

    def __init__(self, table: ReceiverTable, landing: torch.Tensor, delta_region: Optional[torch.Tensor],
                 dtypes: Mapping[str, torch.dtype]) -> None:
        self.table, self.landing, self.region, self.dtypes = table, landing, delta_region, dtypes
        self.entries = {(e.src_rank, e.index): e for e in table.entries}
        self.known: dict[tuple[int, int], tuple[ExpectedEntry, torch.Tensor, int, int, bool]] = {}

    def __repr__(self) -> str:
        return f"<Rows {len(self.known)} of {len(self.entries)} worked out>"

    def fits(self, table: ReceiverTable, landing: torch.Tensor, delta_region: Optional[torch.Tensor]) -> bool:
        """Whether these are ``table``'s rows in that memory (else make new ones)."""
        same = lambda a, b: a is b or (a is not None and b is not None and a.data_ptr() == b.data_ptr()  # noqa: E731
                                       and a.numel() == b.numel())
        return table is self.table and same(landing, self.landing) and same(delta_region, self.region)

    def get(self, src: int, d: DeltaRow) -> tuple[ExpectedEntry, torch.Tensor, int, int, bool]:
        """Row ``d.index`` of sender ``src``; ``DeltaError`` where the table has none such."""
        key = (src, d.index)
        got = self.known.get(key)
        if got is None:
            entry = self.entries.get(key)
            if entry is None:
                raise codec.DeltaError(f"transfer {d.index}", "names a row this receiver does not expect from "
                                       "that sender", f"sender/{src}")
            row = _row(self.landing, entry, self.dtypes)
            start, capacity = (window(entry.offset, entry.nbytes, self.landing.numel(), self.region.numel())
                               if self.region is not None else (0, 0))
            got = self.known[key] = (entry, row, start, capacity, batched(row))
        return got


def landed(table: ReceiverTable, summaries: tuple[WriteSummary, ...], delta_region: Optional[torch.Tensor],
           landing: torch.Tensor, dtypes: Mapping[str, torch.dtype], rows: Optional[Rows] = None) -> list[Landed]:
    """Every delta of the round, checked against its row in ``landing`` (1-D uint8), in the senders'
    order; ``DeltaError`` naming the row and the sender for the first that is not right. Nothing is
    written. Rows the batched kernels take (``batched``) are checked together: one read of their
    headers, one of the verdicts. ``rows``: the table's ``Rows`` in that memory, kept between rounds
    (made here when not given, or not theirs)."""
    if rows is None or not rows.fits(table, landing, delta_region):
        rows = Rows(table, landing, delta_region, dtypes)
    out: list[Optional[Landed]] = []
    batch: list[tuple[int, int, DeltaRow, ExpectedEntry, int, torch.Tensor]] = []  # (place in out, sender,
    #                                                                     its report, entry, start, row's values)
    for s in summaries:
        seen: set[int] = set()
        for d in s.deltas:
            entry, row, start, capacity, fast = rows.get(s.peer_rank, d)
            _placed(s.peer_rank, d, entry, seen, delta_region, capacity)
            if fast and not delta_rows.KERNEL_FAILED:  # (the kernels may have failed since it was worked out)
                batch.append((len(out), s.peer_rank, d, entry, start, row))
                out.append(None)
            else:
                out.append(_blamed(s.peer_rank, d, entry, lambda: _one(s.peer_rank, d, entry, start, delta_region, row)))
    if batch:
        _check_batch(batch, out, delta_region)
    return out  # type: ignore[return-value]


def _blamed(src: int, d: DeltaRow, entry: ExpectedEntry, check: Callable):
    """``check()``, its ``DeltaError`` naming the row, the transfer and the sender."""
    try:
        return check()
    except codec.DeltaError as exc:
        raise codec.DeltaError(entry.name, f"transfer {d.index}: {exc.text}", f"sender/{src}") from None


def _placed(src: int, d: DeltaRow, entry: ExpectedEntry, seen: set, delta_region: Optional[torch.Tensor],
            capacity: int) -> None:
    """The checks of a delta that need no byte of it (``capacity``: its row's window's bytes)."""
    why = ""
    if d.index in seen:
        why = "sent twice in one round"
    elif delta_region is None:
        why = "a delta for a receiver without a delta region"
    elif d.nbytes > capacity:
        why = f"{d.nbytes} bytes overflow its window of {capacity}"
    elif d.nbytes < codec.HEADER_BYTES:
        why = f"{d.nbytes} bytes is shorter than a delta's header"
    if why:
        raise codec.DeltaError(entry.name, f"transfer {d.index}: {why}", f"sender/{src}")
    seen.add(d.index)


def _one(src: int, d: DeltaRow, entry: ExpectedEntry, start: int, delta_region: torch.Tensor,
         row: torch.Tensor) -> Landed:
    delta = codec.unpack_tensor(delta_region[start:start + d.nbytes], entry.name)
    _reported(delta.changes, d, entry.name)
    return Landed(src, entry, delta, check_row(delta, row, entry.name), d.change, delta.changes)


def _check_batch(batch: list, out: list, delta_region: torch.Tensor) -> None:
    """The batched rows' checks (``landed``): headers read at once, then the kernels' verdicts."""
    rows = batch[0][5]
    if delta_rows.batch_kernels(rows) is delta_cpu:  # (CPU rows: numba, applied on APPLY_THREADS threads)
        kernel, more = delta_cpu, (_apply_pool(), APPLY_THREADS)
    else:
        from ..cuda import delta_apply as kernel  # (GPU rows: Triton imports here)
        more = ()
    heads = kernel.headers(delta_region, [start for *_, start, _ in batch])
    items = []
    for (_, src, d, entry, start, row), head in zip(batch, heads):
        _blamed(src, d, entry, lambda: _header_fits(head, d, row, entry.name))
        items.append((delta_region[start:start + d.nbytes], row, head))
    applier = kernel.Applier(items, *more)
    try:
        verdicts = applier.check()
    except Exception as exc:  # (a kernel that cannot run here, nothing written yet: these one by one)
        delta_rows.kernel_failed(exc)
        for place, src, d, entry, start, row in batch:
            out[place] = _blamed(src, d, entry, lambda: _one(src, d, entry, start, delta_region, row))
        return
    for k, ((place, src, d, entry, _, _), why) in enumerate(zip(batch, verdicts)):
        if why is not None:
            raise codec.DeltaError(entry.name, f"transfer {d.index}: {why}", f"sender/{src}")
        out[place] = Landed(src, entry, None, (applier, k), d.change, d.changes)


def _header_fits(head: tuple[int, ...], d: DeltaRow, row: torch.Tensor, name: str) -> None:
    """``DeltaError`` unless a delta's header (``delta_apply.headers``) fits its report and its row."""
    codec.check_header(head, d.nbytes, name)
    _reported(head[2], d, name)
    codec.check_fits(head[1], head[5], row, name)


def _reported(changes: int, d: DeltaRow, name: str) -> None:
    if changes != d.changes:
        raise codec.DeltaError(name, f"changes {changes} values, its sender reported {d.changes}")


def apply(deltas: list[Landed], landing: torch.Tensor, dtypes: Mapping[str, torch.dtype],
          fingerprint: bool = True) -> list[Landed]:
    """Add checked deltas to ``landing`` (1-D uint8); with ``fingerprint``, those whose row's ``fp64``
    did not move as their sender's did (worked out from the changed values alone: O(changes)): the
    receiver's base differs from the sender's where the delta touched it, or the delta changed on the way.
    Deltas of a batch are applied together (one launch per value width)."""
    batches: dict[int, list[int]] = {}
    for d in deltas:
        if d.delta is None and id(d.checked[0]) not in batches:  # type: ignore[index]
            batches[id(d.checked[0])] = d.checked[0].apply()  # type: ignore[index]

    def one(d: Landed) -> int:
        if d.delta is None:
            applier, k = d.checked  # type: ignore[misc]
            return batches[id(applier)][k]
        return apply_row(d.delta, _row(landing, d.entry, dtypes), d.entry.name, d.checked)

    parallel = len(deltas) > 1 and delta_cpu.usable(landing) and not batches  # (rows are disjoint: in
    changes = list(_apply_pool().map(one, deltas) if parallel else map(one, deltas))  # parallel, GIL let go)
    return [d for d, change in zip(deltas, changes) if fingerprint and change != d.change]


@functools.cache
def _apply_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(APPLY_THREADS, thread_name_prefix="weightsync-delta")


def named(deltas: list[Landed]) -> list[str]:
    """Each as "parameter (sender/S transfer I)"."""
    return [f"{d.entry.name} (sender/{d.src} transfer {d.entry.index})" for d in deltas]
