"""``WeightReceiver``: the inference side. Lands versions and makes each visible atomically, or not at all.

How this works: at start the receiver re-homes its tensors into one flat, registered buffer (each
tensor becomes a view at an aligned offset; tied names share a slot). In ``shadow`` mode a second
buffer of the same layout is the landing zone: senders write there while serving reads the live one,
and ``commit`` makes the landing bytes live in one step without awaiting (serving never sees a mix):
host buffers exchange their memory, so every tensor (a view of the live storage) sees the new version
at once; GPU buffers rebind each tensor to the landing buffer; the old live memory becomes the next
landing zone. In ``inplace`` mode senders write into the live tensors: ``before_update`` runs at
``begin`` so serving can pause, ``after_update`` at commit or abort; an abort leaves the receiver
``dirty`` until the next successful round repairs it.
At ``fence`` the receiver checks that every expected transfer arrived (counts and bytes per sender)
and, when asked, recomputes each transfer's checksum; only then does it acknowledge. The check runs
off the receive loop (``_fence_task``: it may wait for bytes still in flight), which keeps reading:
heartbeats keep the session, and an abort meanwhile cancels the check.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Optional

import torch

from weightsync.engine.datapath import delta_checks as checks
from weightsync.engine.datapath.deltas import DELTA_REGION
from weightsync.engine.datapath.exchange import Exchange, memory_exchange
from weightsync.engine.datapath.registry import RegistrationCache
from weightsync.engine.datapath.tensors import FlatBuffer, Params, aligned_layout, find_ties, named_tensors, spec_for
from weightsync.engine.errors import ConfigError, RoundAborted
from weightsync.wire import Envelope, Manifest, Origin, ReceiverTable, Role, ShardSpec
from weightsync.wire import messages as m

from . import verify
from .delta_landing import DEFAULT_DELTA_FRACTION, DeltaLanding, check_fraction
from .worker import Worker, WorkerOptions, call_hook, with_device

log = logging.getLogger("weightsync")

REGION = 0
MODES = ("shadow", "inplace")


@dataclasses.dataclass(frozen=True)
class ReceiverOptions(WorkerOptions):
    mode: str = "shadow"
    proof_timeout_s: float = 60.0  # longest wait at fence for writes a sender announced with a delivery proof
    delta_fraction: float = DEFAULT_DELTA_FRACTION  # the delta region, as a fraction of the weights (0: whole rows only)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction(self.delta_fraction)
        if not self.proof_timeout_s > 0:
            raise ConfigError("proof_timeout_s", f"must be positive, got {self.proof_timeout_s}")


_SET_DATA = torch.Tensor.data.__set__  # (``t.data = v`` as a function)


class WeightReceiver(Worker):
    role = Role.RECEIVER

    def __init__(self, controller_addr: str, params: Params, *, rank: int,
                 options: ReceiverOptions = ReceiverOptions(), mode: Optional[str] = None,
                 shards: Mapping[str, ShardSpec] = {},
                 on_update: Optional[Callable[[int], Any]] = None,
                 before_update: Optional[Callable[[int], Any]] = None,
                 after_update: Optional[Callable[[int, bool], Any]] = None,
                 on_abort: Optional[Callable[[int, str], Any]] = None) -> None:
        if mode is not None:
            options = dataclasses.replace(options, mode=mode)
        if options.mode not in MODES:
            raise ConfigError("mode", f"must be one of {MODES}, got {options.mode!r}")
        tensors = named_tensors(params)
        super().__init__(controller_addr, rank, with_device(options, tensors))
        self.mode = options.mode
        self.on_update, self.before_update, self.after_update = on_update, before_update, after_update
        self.on_abort = on_abort
        self.tensors = tensors
        self.shards = dict(shards)  # name -> the slice of the full tensor this receiver holds (tensor parallel)
        unknown = sorted(set(self.shards) - set(tensors))
        if unknown:
            raise ConfigError("shards", f"shard specs for parameters this receiver does not hold: {unknown[:5]}")
        self.ties = find_ties(self.tensors)
        self.dtypes = {name: t.dtype for name, t in self.tensors.items()}
        self.offsets, self.nbytes = aligned_layout(self.tensors, self.ties)
        self.live = self._rehome()
        self.landing = FlatBuffer(self.nbytes, self.device) if self.mode == "shadow" else self.live
        self.buffers = [self.live, self.landing] if self.mode == "shadow" else [self.live]
        if self.mode == "shadow":
            memory_exchange(self.device)  # (on a torch without the binding, its layout probe runs now, not
            #                                in the first commit)
        self._views: dict[int, list[torch.Tensor]] = {}  # id(buffer) -> each tensor's view in it, in order
        self._prints: dict = {}  # the checked rounds' fp64 launch per landing slot (``verify.checksums``)
        self._entry_keys: Optional[list] = None  # the table's entries' (sender, index) (``verify.table_keys``)
        self._region_addresses: dict[int, int] = {}  # slot -> the memory it was registered with
        self.storage_swaps = 0  # commits made by exchanging the buffers' memory (``_swap``)
        self.deltas = DeltaLanding(options.delta_fraction, self.nbytes, self.device)
        self.delta_side = "apply" if self.deltas.region is not None else ""
        extra = ("fence_commit", "slots:2") if self.mode == "shadow" else ("fence_commit", "begin_ack")
        extra += ("delta",) if self.deltas.region is not None else ()
        self.options = dataclasses.replace(self.options, capabilities=(*self.options.capabilities, *extra))
        self.cache = RegistrationCache()
        self.table: Optional[ReceiverTable] = None
        self.version: Optional[int] = None
        self.dirty = False
        self._begin_task: Optional[asyncio.Task] = None  # an in-place begin waiting for before_update
        self._fence_task: Optional[asyncio.Task] = None  # a fence's verdict, waiting for bytes in flight
        self.rounds_committed = 0
        self.rounds_aborted = 0
        self.last_abort: Optional[RoundAborted] = None  # the newest round aborted here
        self.rounds_one_phase = 0  # of the committed rounds, those fenced and committed in one exchange
        self._pending: Optional[int] = None
        self.prepared: Optional[int] = None  # a version verified at its fence whose commit has not come yet
        self._algo = ""
        self._version_changed = asyncio.Event()

    def __repr__(self) -> str:
        return (f"<WeightReceiver {self.name} {self.mode} {self.session.state.value} version={self.version} "
                f"committed={self.rounds_committed} aborted={self.rounds_aborted} dirty={self.dirty} {self.cache!r}>")

    # --- layout -----------------------------------------------------------------------------------

    def _rehome(self) -> FlatBuffer:
        """Copy every tensor into one flat buffer (on their device) and make the tensor a view of it."""
        devices = sorted({str(t.device) for t in self.tensors.values()})
        if len(devices) > 1:
            raise ConfigError("params", f"a receiver's tensors must share one device, found {devices}")
        self.device = torch.device(devices[0] if devices else "cpu")
        buf = FlatBuffer(self.nbytes, self.device)
        for name, t in self.tensors.items():
            if name in self.ties:
                continue
            view = buf.view(self.offsets[name], t.dtype, tuple(t.shape))
            view.copy_(t.detach())
            t.data = view
        for name, canonical in self.ties.items():
            self.tensors[name].data = self.tensors[canonical].data
        return buf

    def _manifest(self) -> Manifest:
        """Region 0 (and 1 in shadow mode) are the buffers; senders add the round's slot to region 0."""
        wanted = {REGION + i: buf.storage for i, buf in enumerate(self.buffers)}
        if self.deltas.region is not None:
            wanted[DELTA_REGION] = self.deltas.region.storage
        infos = self.cache.apply(self.cache.plan(wanted), self.transport)
        self._region_addresses = {i: buf.storage.data_ptr() for i, buf in enumerate(self.buffers)}
        self._open_regions(False)
        specs = tuple(
            spec_for(name, t, region=REGION, offset=self.offsets[name], tied_to=self.ties.get(name),
                     shard=self.shards.get(name))
            for name, t in self.tensors.items()
        )
        return Manifest(specs, tuple(infos[r] for r in sorted(wanted)))

    @property
    def landing_slot(self) -> int:
        """The region (0 or 1) the next round lands in: the one registered with the landing buffer's
        memory (its storage may have exchanged memory with the live one since: ``_swap``)."""
        address = self.landing.storage.data_ptr()
        slot = next((i for i, a in self._region_addresses.items() if a == address), None)
        return slot if slot is not None else next(i for i, buf in enumerate(self.buffers) if buf is self.landing)

    def _open_regions(self, round_open: bool) -> None:
        """What senders may write into now (``weightsync.engine.dataauth``): a shadow receiver's landing slot and
        never its live one; an in-place receiver's live region only while a round it began is open."""
        if self.prepared is not None:  # a verified version whose outcome is not known yet: nothing may touch it
            self.transport.guard.open_regions(())
        elif self.mode == "shadow":
            self.transport.guard.open_regions({REGION + self.landing_slot, DELTA_REGION})
        else:
            self.transport.guard.open_regions({REGION, DELTA_REGION} if round_open else ())

    def _hello_fields(self) -> dict:
        return {"committed": self.version, "landing": self.landing_slot if self.mode == "shadow" else None}

    # --- public API -------------------------------------------------------------------------------

    async def wait_committed(self, version: int) -> int:
        """Like ``wait_for``, for a caller waiting on one version's outcome: a round for ``version`` (or a
        newer one) that aborts here raises its ``RoundAborted`` instead of waiting for a later version."""
        return await self.wait_for(version, strict=True)

    async def wait_for(self, version: int, *, strict: bool = False) -> int:
        """Wait until a version >= ``version`` is committed; returns the current version. ``strict``: see
        ``wait_committed``."""
        while self.version is None or self.version < version:
            if strict and self.last_abort is not None and self.last_abort.version >= version:
                raise self.last_abort
            if self.lost is not None:
                raise self.lost
            if self.plan_error is not None:
                raise self.plan_error
            self._version_changed.clear()
            await self._version_changed.wait()
        return self.version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    # --- protocol handlers ------------------------------------------------------------------------

    def _on_plan_error(self, exc: BaseException) -> None:
        self._version_changed.set()  # (wait_for raises it)

    async def _on_plan(self, env: Envelope) -> None:
        self.plan_error = None
        await self._settle_prepared(env.body.committed)
        self.table = env.body.receiver
        self._prints = {}  # (another table's launches: dropped)
        self._entry_keys = verify.table_keys(self.table)  # (what the checked rounds look checksums up by)
        self._expected: dict[int, tuple[int, int]] = {}  # sender -> (writes, bytes), fixed for this plan
        for e in self.table.entries:
            count, nbytes = self._expected.get(e.src_rank, (0, 0))
            self._expected[e.src_rank] = (count + 1, nbytes + e.nbytes)
        self.transport.guard.authorize({k.rank: k.key for k in env.body.keys})  # the plan's senders, no one else
        landing = self.landing_slot if self.mode == "shadow" else None
        await self._send(m.PlanAck(env.body.plan_id, True, "", landing))

    async def _settle_prepared(self, committed: Optional[int]) -> None:
        """A version this receiver verified but whose commit it never heard (its session was lost after
        the fence, or the controller restarted) is applied if the controller says it committed, and
        dropped otherwise; a version that reached its fence is never run again (PROTOCOL.md)."""
        version, self.prepared = self.prepared, None
        if version is None:
            return
        if committed == version and (self.version is None or version > self.version):
            log.info("%s: v%d was committed while this session was lost: applying it", self.name, version)
            await self._apply(version, ack=False)
            return
        log.info("%s: v%d was not committed (the controller's committed version is v%s): dropped",
                 self.name, version, committed)
        self._open_regions(False)  # (shut while it was prepared: the landing slot takes writes again)
        self.rounds_aborted += 1
        if self.mode == "inplace":
            await call_hook(self.after_update, version, False)

    async def _on_begin(self, env: Envelope) -> None:
        if self.prepared is not None:  # (a new round: the landing slot is written again)
            self.prepared = None
            self._open_regions(False)
        self._pending = env.body.version  # writes may have started already: they count under this epoch
        # every older round is over, begun here or not (one aborted before its begin reached us sent no abort)
        self.transport.close_epoch(self._pending - 1)
        self._algo = env.body.checksum
        self._spin(True)
        wrong_base = self.deltas.begin(self.rank, env.body.bases)
        if wrong_base is not None:
            await self._send(m.Error(m.ErrorCode.BAD_REQUEST, wrong_base, "base", self._pending), version=self._pending)
        if self.mode == "inplace":  # (off the receive loop, which keeps reading: serving may take a while to pause)
            self._begin_task = asyncio.ensure_future(self._begin_in_place(self._pending))

    async def _begin_in_place(self, version: int) -> None:
        try:
            await call_hook(self.before_update, version)
            self.dirty = True  # live bytes may change from now until commit
            self._open_regions(True)
            await self._send(m.BeginAck(version), version=version)  # senders may start now
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("%s: before_update(%s) failed", self.name, version)
            if self.session.allowed(Origin.WORKER, m.Error.TYPE):
                await self._send(m.Error(m.ErrorCode.INTERNAL, f"before_update: {exc!r}", "", version), version=version)

    def _cancel_round_tasks(self) -> None:
        for name in ("_begin_task", "_fence_task"):  # (an abort or a lost session ends both)
            task = getattr(self, name)
            setattr(self, name, None)
            if task is not None and not task.done():
                task.cancel()

    async def _on_fence(self, env: Envelope) -> None:
        """Verify the round and say so with ``fence_ack``, off the receive loop: waiting for a sender's
        bytes still in flight must not stop heartbeats, nor an abort, from being read. A
        ``fence_commit`` goes to the only receiver of the round: if verification passes it applies at
        once and says so with ``commit_ack`` alone (it tells the controller both); a failed verification
        is still a ``fence_ack``. An abort or a lost session cancels the check; once the verdict is in,
        it runs to its end (``_apply`` changes state before its first await)."""
        body = env.body

        async def fence() -> None:
            try:
                ack = await self._verdict(body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (as the receive loop does for a failing handler)
                log.exception("%s: checking v%d failed", self.name, body.version)
                if self.session.allowed(Origin.WORKER, m.Error.TYPE):
                    await self._send(m.Error(m.ErrorCode.INTERNAL, f"fence: {exc!r}", "", body.version),
                                     version=body.version)
                return
            self._fence_task = None  # (past the verdict: nothing cancels it now)
            if not ack.ok or not isinstance(body, m.FenceCommit):
                if self.session.allowed(Origin.WORKER, ack.TYPE):
                    await self._send(ack, version=ack.version)
                return
            self.rounds_one_phase += 1
            await self._apply(ack.version, carried=(ack.apply_s, ack.verify_s))  # (its commit_ack says them)
        self._fence_task = asyncio.ensure_future(fence())

    _on_fence_commit = _on_fence  # one handler for both messages

    async def _verdict(self, body: "m.Fence | m.FenceCommit") -> m.FenceAck:
        """Verify round ``body.version`` (``roles.verify``): delivery proofs, arrivals, checksums."""
        version = body.version
        unproven = await verify.await_proofs(self.transport, body.checksums, self.options.proof_timeout_s)
        self.timeline.mark(version, "proofs:checked")
        await self.transport.settle()  # landed bytes visible in the registered buffers (e.g. pinned -> GPU)
        expected = checks.expected(self._expected, self.table, body.checksums)  # (a delta counts its payload)
        problems, names, blame = verify.arrivals(self.transport, self.table, expected, self._pending, body.checksums)
        t0 = time.perf_counter()
        if not problems:
            problems, names, blame = await verify.deltas(self.deltas, self.table, self.landing.storage,
                                                         self.dtypes, body.checksums, self.live.storage)
        t1 = time.perf_counter()
        if unproven:
            problems += [f"sender/{src}: {why}" for src, why in sorted(unproven.items())]
            names = sorted({*names, *(e.name for e in self.table.entries if e.src_rank in unproven)})
        verify_s = 0.0
        if not problems and self._algo:
            t2 = time.perf_counter()
            bad = await verify.checksums(self.table, self.landing.storage, self._algo, body.checksums, self._prints,
                                         self._entry_keys)
            verify_s = time.perf_counter() - t2
            if bad:
                problems.append(f"{self._algo} mismatch in {len(bad)} parameter(s)")
                names = bad
        received = sum(s.nbytes for s in body.checksums)
        if not problems:
            self.prepared = version
            self._open_regions(False)  # (verified: nothing may write there until its commit or abort)
        return m.FenceAck(version, not problems, received, tuple(names), "; ".join(problems), blame,
                          apply_s=t1 - t0, verify_s=verify_s)

    async def _on_commit(self, env: Envelope) -> None:
        await self._apply(env.body.version)

    async def _apply(self, version: int, ack: bool = True, carried: tuple[float, float] = (0.0, 0.0)) -> None:
        """Make ``version`` live; ``ack``: say so with ``commit_ack`` (not for a prepared version
        settled at a plan, outside any round), with ``carried`` (a one-phase verdict's apply and verify
        seconds)."""
        self.prepared = None
        self.transport.close_epoch(version)
        if self.mode == "shadow":
            self._swap()
        self.deltas.committed(version)
        self._open_regions(False)
        self.timeline.mark(version, "applied")
        self.dirty = False
        self.version = version
        self._pending = None
        self.rounds_committed += 1
        self._version_changed.set()
        try:
            await call_hook(self.on_update, version)
            if self.mode == "inplace":
                await call_hook(self.after_update, version, True)
        finally:
            try:  # (allowed: a one-phase round's abort may have come while the hooks ran)
                if ack and self.session.allowed(Origin.WORKER, m.CommitAck.TYPE):
                    await self._send(m.CommitAck(version, True, "", *carried), version=version)
            finally:
                self._spin(False)  # (after the ack: the collector it paused may run from here)

    def _swap(self) -> None:
        """Make the landing buffer's bytes live; the next version lands in the old live memory.

        Where it may (``_exchange``), the two buffers' storages exchange their memory
        (``engine.datapath.exchange``): every tensor, a view of the live buffer's storage, sees the
        new bytes at once, whatever the tensor count. Otherwise every tensor is rebound to the landing
        buffer (``t.data = view``, one C-level call per tensor). Both memory
        blocks stay registered (regions 0 and 1); the controller flips this receiver's slot on our
        commit_ack, so senders follow without any re-registration (``landing_slot`` follows memory)."""
        exchange = self._exchange()
        if exchange is not None:
            exchange(self.live.storage.untyped_storage(), self.landing.storage.untyped_storage())
            self.storage_swaps += 1
            return
        new_live, new_landing = self.landing, self.live
        views = self._views.get(id(new_live))
        if views is None:  # made once per buffer: a swap is then one rebinding per tensor
            views = self._views[id(new_live)] = [new_live.view(self.offsets[name], t.dtype, tuple(t.shape))
                                                 for name, t in self.tensors.items()]
        # ``t.data = view`` for every tensor, the loop in C
        collections.deque(map(_SET_DATA, self.tensors.values(), views), maxlen=0)
        self.live, self.landing = new_live, new_landing

    def _exchange(self) -> Optional[Exchange]:
        """How a commit exchanges the buffers' memory, or None to rebind: only where the transport's
        regions are the memory they were registered with (the landing slot then follows memory) and this
        torch can exchange storages on the buffers' device (``memory_exchange``)."""
        if not getattr(self.transport, "stable_regions", False):
            return None
        return memory_exchange(self.device)

    async def _on_abort(self, env: Envelope) -> None:
        body = env.body
        self._cancel_round_tasks()
        self.prepared = None
        self.transport.close_epoch(body.version)
        self._open_regions(False)
        self._pending = None
        self._spin(False)
        self.rounds_aborted += 1
        aborted = self.last_abort = RoundAborted(body.version, body.reason, body.text, body.culprit)
        self._version_changed.set()  # (wait_committed raises it)
        log.warning("%s: %s", self.name, aborted)
        if self.mode == "inplace":
            await call_hook(self.after_update, body.version, False)
        await call_hook(self.on_abort, body.version, str(aborted))

    def _on_closed(self, exc: BaseException) -> None:
        self._cancel_round_tasks()
        super()._on_closed(exc)
        self._version_changed.set()

    def _on_session_lost(self, exc: BaseException) -> None:
        """A round in flight is over without a commit: nothing of it becomes visible (in place: the
        receiver stays ``dirty`` until a later round repairs it)."""
        self._cancel_round_tasks()
        if self._pending is not None:
            self.transport.close_epoch(self._pending)  # (no more writes land; a prepared landing slot stays)
            if self.prepared != self._pending:  # not verified: nothing of it can ever be applied
                if self.mode == "inplace":  # serving paused at begin: let it resume
                    asyncio.ensure_future(call_hook(self.after_update, self._pending, False))
                self.rounds_aborted += 1
            self._pending = None
        self._open_regions(False)
