"""A receiver's verdict at a fence: were round v's writes delivered, complete, and what was sent?

How this works: three checks, in the order the receiver runs them before it acknowledges a fence.
``await_proofs``: senders that announced their writes before they completed sent a delivery proof;
the transport confirms each one. ``arrivals``: every sender of the table reported what the table says,
and where the transport observes incoming writes (TCP) what landed matches too, and nothing landed
under another open round (a write under a future round would otherwise be committed as this one);
one-sided transports rely on the report and the senders' fences. ``deltas``: the rows that came as
deltas, each checked against its row and sender before any is applied, then applied to the landing
buffer (``roles.delta_landing``). ``checksums``: each entry's bytes in the landing buffer against the
sender's checksum (when the round asked for them). Each names the parameters affected; ``arrivals`` and
``deltas`` also name the one sender to blame, when there is one.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Mapping, Optional

import torch

from weightsync.engine.datapath.checksums import ManyPrints, checksum
from weightsync.engine.datapath.delta_checks import named
from weightsync.engine.datapath.staging import THREAD_THRESHOLD
from weightsync.engine.transforms.delta import DeltaError
from weightsync.engine.transport import Transport
from weightsync.wire import ReceiverTable
from weightsync.wire.columns import column
from weightsync.wire import messages as m

if TYPE_CHECKING:
    from .delta_landing import DeltaLanding


async def await_proofs(transport: Transport, summaries: tuple[m.WriteSummary, ...], timeout_s: float) -> dict[int, str]:
    """Sender rank -> why its delivery proof was not confirmed (none: every proof was, or none was sent)."""
    proofs = {s.peer_rank: s.proof for s in summaries if s.proof}
    if not proofs:
        return {}
    check = getattr(transport, "await_proofs", None)
    if check is None:
        return {src: f"sent a delivery proof that transport {transport.kind!r} cannot check" for src in proofs}
    return await check(proofs, timeout_s)


def arrivals(transport: Transport, table: ReceiverTable, expected: Mapping[int, tuple[int, int]], epoch: int,
             summaries: tuple[m.WriteSummary, ...]) -> tuple[list[str], list[str], str]:
    """The problems, the parameters affected, and the sender to blame ("" if none or several)."""
    reported = {s.peer_rank: (s.count, s.nbytes) for s in summaries}
    observed = transport.counters(epoch)
    problems: list[str] = []
    bad_src: set[int] = set()
    for src, epochs in sorted(transport.strays(epoch).items()):
        problems.append(f"sender/{src} wrote under round(s) {epochs[:3]} during round {epoch}")
        bad_src.add(src)
    if bad_src:  # (reported once: the round fails on them, the next one starts clean)
        transport.forget_strays(epoch)
    for src, (count, nbytes) in sorted(expected.items()):
        if reported.get(src, (0, 0)) != (count, nbytes):
            problems.append(f"sender/{src} reported {reported.get(src, (0, 0))}, expected {(count, nbytes)}")
            bad_src.add(src)
        c = observed.get(src)
        if c is not None and ((c.count, c.nbytes) != (count, nbytes) or c.errors):
            problems.append(f"from sender/{src} landed {c.count} writes/{c.nbytes} bytes, expected "
                            f"{count}/{nbytes} {'; '.join(c.errors[:3])}")
            bad_src.add(src)
    names = sorted({e.name for e in table.entries if e.src_rank in bad_src}) if bad_src else []
    blame = f"sender/{min(bad_src)}" if len(bad_src) == 1 else ""
    return problems, names, blame


async def deltas(landing: "DeltaLanding", table: ReceiverTable, memory: torch.Tensor,
                 dtypes: Mapping[str, torch.dtype], summaries: tuple[m.WriteSummary, ...],
                 live: torch.Tensor) -> tuple[list[str], list[str], str]:
    """Check and apply the round's deltas to ``memory`` (each row taken from ``live`` first, where that is
    other memory): (problems, the parameter affected, the sender to blame)."""
    if not any(s.deltas for s in summaries):
        return [], [], ""
    try:
        if memory.is_cuda:  # (the batched kernels: a few launches and short waits, on the loop's thread)
            wrong = landing.land(table, summaries, memory, dtypes, live)
        else:  # (the compiled CPU kernels let go of the GIL)
            wrong = await asyncio.to_thread(landing.land, table, summaries, memory, dtypes, live)
    except DeltaError as exc:
        return [f"delta refused: {exc}"], [exc.row], exc.peer
    if wrong:
        rows = ", ".join(named(wrong[:5]))
        return ([f"fp64 fingerprint of {len(wrong)} row(s) moved otherwise than their sender's: {rows}"],
                sorted({d.entry.name for d in wrong}), "")
    return [], [], ""


def table_keys(table: ReceiverTable) -> list[tuple[int, int]]:
    """Each entry's (sender, transfer index), in table order: what a checksum is looked up by."""
    return list(zip(column(table.entries, "src_rank"), column(table.entries, "index")))


async def checksums(table: ReceiverTable, landing: torch.Tensor, algo: str,
                    summaries: tuple[m.WriteSummary, ...], kept: Optional[dict] = None,
                    keys: Optional[list[tuple[int, int]]] = None) -> list[str]:
    """The parameters whose landed bytes do not match their sender's checksum (``landing``: 1-D uint8),
    and those a sender gave no checksum for (a round that verifies verifies every row: a row left out
    would pass unchecked): ``fp64`` fingerprints of every entry in one launch on a GPU, which the loop
    polls for; other checksums on a worker thread (on the loop for rows of up to ``THREAD_THRESHOLD``
    bytes in all, as the sender's staging does). ``kept``: where the ``fp64`` launch over a table's
    landing pieces is kept between rounds (per landing memory, a two-slot receiver's two; the owner
    empties it when its table changes, so it never holds memory a plan let go of); ``keys``: the table's
    ``table_keys``, which its owner works out once per plan."""
    expected: dict[tuple[int, int], int] = {}  # (sender, transfer index) -> its checksum (columns: no object per row)
    for s in summaries:
        expected.update(zip(zip(itertools.repeat(s.peer_rank), column(s.checksums, "index")), column(s.checksums, "value")))
    entries = table.entries
    keys = keys if keys is not None else table_keys(table)
    whole = len(expected) == len(keys) and all(k in expected for k in keys)  # (the common case: every row)
    missing: set[str] = set()
    if not whole:
        missing = {e.name for e, k in zip(entries, keys) if k not in expected}
        entries = tuple(e for e, k in zip(entries, keys) if k in expected)
        keys = [k for k in keys if k in expected]
    if algo == "fp64":
        table_of, many = kept.get(landing.data_ptr(), (None, None)) if kept is not None and whole else (None, None)
        if table_of is not table:
            many = ManyPrints([landing[e.offset:e.offset + e.nbytes] for e in entries])
            if kept is not None and whole:  # (a subset, some rows unchecksummed, is a failed round: not kept)
                if any(t is not table for t, _ in kept.values()):
                    kept.clear()  # (another table's: its landing memory is not held past it)
                kept[landing.data_ptr()] = (table, many)
        values = await many.values_async()
    else:
        pieces = [landing[e.offset:e.offset + e.nbytes] for e in entries]
        if sum(piece.numel() for piece in pieces) > THREAD_THRESHOLD:  # (``landing`` is bytes)
            values = await asyncio.to_thread(lambda: [checksum(piece, algo) for piece in pieces])
        else:  # (as the sender's staging does: a thread's hand-over costs more than a few small rows)
            values = [checksum(piece, algo) for piece in pieces]
    wrong = [i for i, (k, value) in enumerate(zip(keys, values)) if value != expected[k]]
    return sorted(missing | {entries[i].name for i in wrong})
