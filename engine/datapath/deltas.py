"""Delta rounds on the data path: the sender's bases and where a delta lands.

How this works. A receiver that takes deltas registers a *delta region* beside its weights (a budget,
``ReceiverOptions.delta_fraction`` of them). Each row of the receiver's weights maps to a *window* of
that region, in proportion to where it lies (``window``): windows of different rows never overlap,
and both ends work them out from the plan alone, so a delta needs no allocation and no offset on the
wire. A row whose delta does not fit its window goes whole.

Sender (``Bases``): the bytes it last sent of each row (by source, slice and transform: receivers of
the same bytes share one), within ``base_budget_bytes`` (rows past it go whole, logged once), and the
version they hold. ``Bases.round`` names, per round, the receivers in delta mode (``DeltaRound.lanes``:
every row of theirs is staged, never replayed) and stages each of their rows: the delta of the new
bytes against the base, if the receiver holds that base (the round's ``begin`` says which version it
holds) and the delta is smaller than the row and fits its window; otherwise the row goes whole. Either
way the base becomes the new bytes at once (a delta is applied to it; whole bytes are copied). A commit
makes them the base's version; an abort undoes the deltas (``settle``, before the next round) and
forgets bases that took whole bytes: a base never holds bytes of a round that did not commit.

The receiver's side (checks, then applies, at the fence) is ``engine.datapath.delta_checks``.

Which code encodes a row is ``engine.datapath.delta_rows``'s choice: compiled kernels on CPUs; on GPUs
the batched Triton kernels, a lane's rows gathered into batches (``stage_many``, ``advance_many``: a few
launches and one wait per batch); the torch codec elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

import torch

from weightsync.wire import PeerInfo, Transfer

from ..errors import ConfigError
from ..transforms import delta as codec
from . import delta_rows
from ..transport import Connection

log = logging.getLogger("weightsync")

DELTA_REGION = 8  # the region id of a receiver's delta region (its weights are regions 0 and 1)
ALIGN = 16  # windows start on multiples of this
DELTA_MODES = ("off", "auto", "always")
BASE_ON = ("device", "host")
DEFAULT_BASE_BUDGET = 8 << 30  # bytes of bases a sender keeps, at most
AUTO_MARGIN = 2.0  # "auto": deltas where rows encode this many times faster than the link writes them
MEASURED = 1 << 20  # bytes a rate is measured over, at least
REPROBE = 16  # "auto": a lane dense this many rounds in a row tries deltas again (the encoder is measured anew)
REPROBE_MAX = 1024  # each try that does not pay doubles that wait, up to this many rounds
OFF_LOOP_BYTES = 1 << 20  # CPU rows this large are encoded on worker threads (the event loop keeps writing)
ENCODERS = 2  # such rows (or batches) of a lane encoded at once (the compiled encoder lets go of the GIL)


def window(offset: int, nbytes: int, region_nbytes: int, delta_nbytes: int) -> tuple[int, int]:
    """(offset, capacity) in the delta region of the row at ``offset`` .. ``offset + nbytes`` of a
    ``region_nbytes`` region: the rows' windows are disjoint wherever the rows are."""
    if region_nbytes <= 0 or delta_nbytes <= 0:
        return 0, 0
    start = -(-(offset * delta_nbytes) // region_nbytes)  # ceil: at or past where the row maps to
    start = -(-start // ALIGN) * ALIGN
    end = (offset + nbytes) * delta_nbytes // region_nbytes  # floor: the next row's window starts past it
    return (start, end - start) if end > start else (0, 0)


def _busy(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds inside any of ``spans`` (encodes on two threads at once count once: the rate is the
    encoder's as a round sees it)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def check_bases(budget_bytes: int, on: str) -> None:
    """``SenderOptions.base_budget_bytes`` and ``base_on``, or a ``ConfigError`` naming the bad one."""
    if budget_bytes < 0:
        raise ConfigError("base_budget_bytes", f"must be >= 0, got {budget_bytes}")
    if on not in BASE_ON:
        raise ConfigError("base_on", f"must be one of {BASE_ON}, got {on!r}")


def windows(mode: str, peers: Sequence[PeerInfo], conns: Mapping[int, Connection],
            pays: Callable[[int], bool] = lambda rank: True) -> dict[int, tuple[int, int]]:
    """Receiver rank -> (weights region, delta region) sizes, for the receivers a round in delta ``mode``
    sends deltas to: those with a delta region, on connections ``mode`` picks ("always": every one;
    "auto": those whose abilities say a delta may pay there and where ``pays``, ``Bases.pays``)."""
    out = {}
    for peer in peers if mode else ():
        sizes = {r.region_id: r.nbytes for r in peer.regions}
        conn = conns.get(peer.rank)
        if sizes.get(DELTA_REGION) and conn is not None and (
                mode == "always" or (conn.abilities.delta_auto and pays(peer.rank))):
            out[peer.rank] = (sizes.get(0, 0), sizes[DELTA_REGION])
    return out


@dataclasses.dataclass
class _Base:
    tensor: torch.Tensor  # the bytes last sent, in the staged dtype
    version: Optional[int]  # the committed version they are; None: unknown (in a round, or forgotten)


@dataclasses.dataclass
class _Pending:
    """What one round did to a base: the version it held before, and the delta applied (None: whole)."""

    before: Optional[int]
    delta: Optional[codec.Delta]
    change: int = 0  # what the delta did to the base's fp64 fingerprint
    packed: Optional[torch.Tensor] = None  # the delta's bytes, where the batched kernels made them (no ``delta``)
    changes: int = 0  # the values it changes

    @property
    def sends(self) -> bool:
        """Whether the row may go as a delta (else whole)."""
        return self.delta is not None or self.packed is not None

    def undo(self) -> Optional[codec.Delta]:
        """The delta to take back on an abort (None: the round went whole)."""
        return self.delta if self.delta is not None or self.packed is None else codec.unpack_tensor(self.packed)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() if self.packed is not None else self.delta.nbytes  # type: ignore[union-attr]


def _key(t: Transfer) -> tuple:
    return (t.name, t.slice, t.transform)


class Bases:
    """A sender's bases (see the module's header)."""

    def __init__(self, budget_bytes: int = DEFAULT_BASE_BUDGET, on: str = "device") -> None:
        check_bases(budget_bytes, on)
        self.budget_bytes, self.on = budget_bytes, on
        self.entries: dict[tuple, _Base] = {}
        self.used = 0
        self.version: Optional[int] = None  # the round whose changes the bases hold, until settled
        self.pending: dict[tuple, _Pending] = {}
        self.committed = False
        self._over_budget_logged = False
        self.link_rates: dict[int, float] = {}  # receiver -> bytes/s its lane wrote whole rows at (measured)
        self.encode_rate: Optional[float] = None  # bytes/s of rows encoded against their base (measured)
        self._spans: list[tuple[float, float]] = []  # this round: when rows were being encoded (threads overlap)
        self._encoded_bytes = 0  # ... and their bytes
        self.dense_rounds: dict[int, int] = {}  # receiver -> rounds since its lane was last in delta mode
        self.reprobe: dict[int, int] = {}  # receiver -> dense rounds before its lane tries deltas again
        self._probing: set[int] = set()  # receivers whose lane tries deltas again, until the encoder is measured
        self._warmed: set[int] = set()  # receivers whose lane has written a measured dense round (the next measures)
        self.lock = threading.Lock()  # (rows are encoded on worker threads: guards the dicts and counters)
        self._idle = threading.Condition(self.lock)  # notified as each encode ends
        self._busy = 0  # rows being encoded now
        self._row_locks: dict[tuple, threading.Lock] = {}

    def __repr__(self) -> str:
        return (f"<Bases {len(self.entries)} rows {self.used}/{self.budget_bytes} bytes "
                f"pending={'v%s' % self.version if self.pending else None}>")

    def commit(self, version: int) -> None:
        """Round ``version`` committed: its bytes are the bases' from now on."""
        if version == self.version:
            self.committed = True
            self.settle()

    def settle(self) -> None:
        """Close the last round: committed, its bytes take its version; otherwise its deltas are undone
        and bases that took whole bytes are forgotten. Call with no round of this sender running."""
        with self.lock:  # (rows a cancelled round is still encoding finish first)
            while self._busy:
                self._idle.wait()
            self._settle()

    def _settle(self) -> None:
        for key, p in self.pending.items():
            base = self.entries[key]
            if self.committed:
                base.version = self.version
            elif (delta := p.undo()) is not None and p.before is not None:
                delta_rows.apply_row(delta, base.tensor, str(key[0]), None, undo=True)
                base.version = p.before
            else:
                base.version = None
        self.pending, self.version, self.committed = {}, None, False

    def round(self, version: int, mode: str, bases: Mapping[int, int],
              sizes: Mapping[int, tuple[int, int]]) -> Optional["DeltaRound"]:
        """Round ``version`` in delta ``mode`` ("": none): ``sizes`` the receivers in delta mode with
        their (weights region, delta region) sizes (``windows``), ``bases`` the version each holds."""
        self.settle()
        if not mode:
            return None
        self.version = version
        return DeltaRound(self, frozenset(sizes), dict(bases), dict(sizes))

    def advance(self, t: Transfer, new: torch.Tensor) -> _Pending:
        """Bring row ``t``'s base to ``new`` (once a round per base); what that did. Thread-safe: rows
        are encoded in parallel, one thread per row (a second asking for the same row waits for it)."""
        return self.advance_many([(t, new)])[0]

    def _base(self, key: tuple, t: Transfer, new: torch.Tensor) -> Optional[_Base]:
        """Row ``key``'s base (made if the budget allows; None past it). Under ``lock``."""
        base = self.entries.get(key)
        nbytes = new.numel() * new.element_size()
        if base is not None and (base.tensor.numel() != new.numel() or base.tensor.dtype != new.dtype):  # (flat)
            self.used -= base.tensor.numel() * base.tensor.element_size()
            del self.entries[key]
            base = None
        if base is None:
            if self.used + nbytes > self.budget_bytes:
                self._over_budget(t, nbytes)
                return None
            device = "cpu" if self.on == "host" else new.device
            base = self.entries[key] = _Base(torch.empty(new.numel(), dtype=new.dtype, device=device,
                                                         pin_memory=self.on == "host" and torch.cuda.is_available()), None)
            self.used += nbytes
        return base

    def _encode(self, base: _Base, flat: torch.Tensor) -> _Pending:
        """Bring ``base`` to ``flat``: as a delta where it holds a version, else by copying."""
        delta, change, copied, before = None, 0, False, base.version
        if before is not None:
            t0 = time.perf_counter()
            delta, change, copied = delta_rows.advance(base.tensor, flat)
            with self.lock:
                self._took(t0, flat.numel() * flat.element_size())
        if not copied:
            base.tensor.copy_(flat, non_blocking=True)
        base.version = None
        return _Pending(before, delta, change, changes=delta.changes if delta is not None else 0)

    def advance_many(self, rows: Sequence[tuple[Transfer, torch.Tensor]], wait: bool = True) -> list[_Pending]:
        """``advance`` for many rows at once: those the batched GPU kernels take (``batched``) in a few
        launches and one wait (``wait``: and one at the end; else their work is queued on the device's
        current stream), the rest one by one. The rows are locked in one order (lanes to receivers
        of the same bytes may batch them at the same time)."""
        keys = sorted({_key(t) for t, _ in rows}, key=repr)
        with self.lock:
            locks = [self._row_locks.setdefault(key, threading.Lock()) for key in keys]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            done: dict[tuple, _Pending] = {}
            todo: dict[tuple, tuple[_Base, torch.Tensor]] = {}
            with self.lock:
                for t, new in rows:
                    key = _key(t)
                    if key in done or key in todo:
                        continue
                    if key in self.pending:
                        done[key] = self.pending[key]
                    elif (base := self._base(key, t, new)) is None:
                        done[key] = _Pending(None, None)
                    else:
                        todo[key] = (base, new.reshape(-1))
                self._busy += 1
            try:
                fresh = self._advance_all(todo, wait)
            finally:
                with self.lock:
                    self._busy -= 1
                    self._idle.notify_all()
            with self.lock:
                self.pending.update(fresh)
            done.update(fresh)
            return [done[_key(t)] for t, _ in rows]

    def _advance_all(self, todo: Mapping[tuple, tuple[_Base, torch.Tensor]], wait: bool) -> dict[tuple, _Pending]:
        """Bring each base to its new bytes: those that hold a version, on the new bytes' device, where
        the batched kernels serve, in one batch per kind of device; ``_encode`` the rest."""
        groups: dict[str, dict[tuple, tuple[_Base, torch.Tensor]]] = {}
        for key, (base, new) in todo.items():
            if base.version is not None and base.tensor.device == new.device and delta_rows.batched(new):
                groups.setdefault(new.device.type, {})[key] = (base, new)
        batched = {key for fast in groups.values() for key in fast}
        out = {key: self._encode(base, new) for key, (base, new) in todo.items() if key not in batched}
        for fast in groups.values():
            out.update(self._encode_batch(fast, wait))
        return out

    def _encode_batch(self, fast: Mapping[tuple, tuple[_Base, torch.Tensor]], wait: bool) -> dict[tuple, _Pending]:
        """``_advance_all``'s batch of rows on one kind of device (``delta_rows.batch_kernels``)."""
        t0 = time.perf_counter()
        try:
            kernels = delta_rows.batch_kernels(next(iter(fast.values()))[1])
            encoded = kernels.encode_many([(base.tensor, new) for base, new in fast.values()], wait)
        except Exception as exc:  # (a kernel that cannot run here: these rows whole, later ones one by one)
            delta_rows.kernel_failed(exc)
            out = {}
            for key, (base, new) in fast.items():
                base.version = None  # (what the launches did to it is unknown: copied whole)
                out[key] = self._encode(base, new)
            return out
        with self.lock:
            self._took(t0, sum(new.numel() * new.element_size() for _, new in fast.values()))
        out = {}
        for (key, (base, _)), e in zip(fast.items(), encoded):
            out[key] = _Pending(base.version, None, e.change if e.packed is not None else 0, e.packed, e.changes)
            base.version = None
        return out

    def observe(self, lanes: Mapping[int, object], seconds: float, delta_lanes: frozenset = frozenset()) -> None:
        """After a round of ``seconds`` (the pipeline's, wall clock): the rate each dense lane (not in
        ``delta_lanes``) wrote at, over at least ``MEASURED`` bytes, and the rate rows were encoded at,
        for ``pays``. (A lane's rate is its bytes over the round's time: lanes to other receivers ran
        meanwhile, so it is never above the link's.)"""
        for rank, lane in lanes.items():
            if rank not in delta_lanes and lane.nbytes >= MEASURED and seconds > 0:
                if rank in self._warmed:  # (a lane's first round, cold connections and all, is not its link)
                    self.link_rates[rank] = lane.nbytes / seconds
                self._warmed.add(rank)
            self.dense_rounds[rank] = 0 if rank in delta_lanes else self.dense_rounds.get(rank, 0) + 1
        seconds, nbytes = _busy(self._spans), self._encoded_bytes
        if nbytes >= MEASURED and seconds > 0:
            self.encode_rate = nbytes / seconds
        self._spans, self._encoded_bytes = [], 0

    def _took(self, t0: float, nbytes: int, t1: Optional[float] = None) -> None:
        """Rows of ``nbytes`` were encoded from ``t0`` to ``t1`` (now). Under ``lock``."""
        self._spans.append((t0, time.perf_counter() if t1 is None else t1))
        self._encoded_bytes += nbytes

    def pays(self, rank: int) -> bool:
        """Whether a delta round may beat a dense one toward ``rank`` ("auto"): encoding (and, as costly
        again, applying at the receiver) must outrun the link. The link is measured first, by a dense
        round (not the lane's first: its connections are cold); then deltas are tried until the encode
        rate is measured too (it falls as more values change); a lane dense for ``REPROBE`` rounds tries
        again, and each try that does not pay doubles that wait (up to ``REPROBE_MAX``): on a link where
        deltas never pay, the tries cost ever less."""
        rate = self.link_rates.get(rank)
        if rate is None:
            return False
        wait = self.reprobe.get(rank, REPROBE)
        if self.dense_rounds.get(rank, 0) >= wait:  # steps change: measure the encoder again now and then
            self.encode_rate = None
            self._probing.add(rank)
        pays = self.encode_rate is None or self.encode_rate > AUTO_MARGIN * rate
        if rank in self._probing and self.encode_rate is not None:  # the try measured it: the next wait
            self._probing.discard(rank)
            self.reprobe[rank] = REPROBE if pays else min(2 * wait, REPROBE_MAX)
        return pays

    def _over_budget(self, t: Transfer, nbytes: int) -> None:
        if not self._over_budget_logged:
            self._over_budget_logged = True
            log.info("weightsync: bases hold %d of %d bytes; %s (%d bytes) and rows past it go whole",
                     self.used, self.budget_bytes, t.name, nbytes)


class DeltaRound:
    """One round's delta mode on the sender: which lanes, and what each of their rows becomes."""

    def __init__(self, bases: Bases, lanes: frozenset, held: dict[int, int], windows: dict[int, tuple[int, int]]) -> None:
        self.bases, self.lanes, self.held, self.windows = bases, lanes, held, windows
        self.rows = 0  # of the lanes' rows, those that went as deltas
        self.whole_bytes = 0  # what those rows would have been whole
        self.changed = 0  # values they changed

    @staticmethod
    def off_loop(new: torch.Tensor) -> bool:
        """Whether ``stage`` of ``new`` belongs on a worker thread: a large CPU row (the compiled encoder
        lets go of the GIL; a GPU row's launches stay on the loop's thread and stream)."""
        return new.device.type == "cpu" and new.numel() * new.element_size() >= OFF_LOOP_BYTES

    @staticmethod
    def batches(new: torch.Tensor) -> int:
        """Bytes of rows like ``new`` that ``stage_many`` should take together (``delta_rows.batched``,
        ``batch_bytes``); 0: ``stage`` takes it alone."""
        return delta_rows.batch_bytes(new) if delta_rows.batched(new) else 0

    def stage(self, t: Transfer, new: torch.Tensor) -> Optional[tuple[torch.Tensor, int, int, int]]:
        """Row ``t`` of a delta lane, its new bytes ``new``: (packed delta, its offset in the receiver's
        delta region, its fingerprint change, the values it changes), or None to send ``new`` whole."""
        return self._staged(t, self.bases.advance(t, new))

    def stage_many(self, rows: Sequence[tuple[Transfer, torch.Tensor]],
                   wait: bool = True) -> list[Optional[tuple[torch.Tensor, int, int, int]]]:
        """``stage`` of many rows: GPU rows in one batch (``Bases.advance_many``; without ``wait`` their
        packed bytes are complete once the work queued on their device's current stream is)."""
        return [self._staged(t, done) for (t, _), done in zip(rows, self.bases.advance_many(rows, wait))]

    def _staged(self, t: Transfer, done: _Pending) -> Optional[tuple[torch.Tensor, int, int, int]]:
        held = self.held.get(t.dst_rank)
        if not done.sends or held is None or done.before != held:
            return None
        start, capacity = window(t.dst_offset, t.nbytes, *self.windows.get(t.dst_rank, (0, 0)))
        if done.nbytes > capacity:
            return None
        with self.bases.lock:
            self.rows += 1
            self.whole_bytes += t.nbytes
            self.changed += done.changes
        packed = done.packed if done.packed is not None else codec.pack_tensor(done.delta)  # type: ignore[arg-type]
        return packed, start, done.change, done.changes
