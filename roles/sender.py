"""``WeightSender``: the trainer side. Pushes a version of its weights through its routing table.

How this works: on ``plan`` the sender opens (and keeps) one data-plane connection per receiver in its
table and acknowledges. ``push(v)`` tells the controller the weights for v are ready and waits for
``begin(v)``, which comes once every planned sender has pushed v. The pipeline then writes every row of
the table; when all writes are done and fenced the sources are free again (``push`` returns, so the
optimizer may step), and ``writes_done`` goes to the controller. The returned ``PushHandle`` resolves
at ``commit`` or raises ``RoundAborted``. ``push_nowait`` does the same without waiting. A sender that
holds the controller's ``arm`` (the next round's parameters, ``roles.arms``; in the last ``commit`` or
on its own) when it pushes sends ``armed_push``, which stands for its ``begin``, and writes at once; a
plan that comes before its round starts keeps those writes (same table, same pair keys) or stops them,
and a ``begin`` then follows. A push first lets the receive loop handle what was delivered before it
(``roles.backlog``: an arm a training step left unread). The loop polls from a push until its commit
(``WorkerOptions.spin``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Mapping, Optional

import torch
import zmq

from weightsync.engine.datapath.deltas import DEFAULT_BASE_BUDGET, Bases, DeltaRound, check_bases, windows
from weightsync.engine.datapath.pipeline import Pipeline, PipelineOptions, PushReport
from weightsync.engine.datapath.staging import SourceSet, StagingPool, Transform
from weightsync.engine.datapath.tensors import Params, find_ties, named_tensors, spec_for
from weightsync.engine.errors import ConfigError, ControllerLost, PlanError, RoundAborted, StagingError, TransportError, VersionError, WeightSyncError
from weightsync.engine.transforms import group_bytes_for
from weightsync.engine.plan.windows import GATHER_BUDGET_BYTES
from weightsync.engine.transforms.gather import Gatherer, split_dtensors
from weightsync.wire import Envelope, Manifest, Role, SenderTable, ShardSpec, State
from weightsync.wire import messages as m

from .sender_parts import DataConnections, EarlyWrites, PushHandle, error_code
from .worker import Worker, WorkerOptions, with_device

log = logging.getLogger("weightsync")


@dataclasses.dataclass(frozen=True)
class SenderOptions(WorkerOptions):
    pipeline: PipelineOptions = PipelineOptions()
    gather_budget_bytes: int = GATHER_BUDGET_BYTES  # FSDP2: bytes of gathered full tensors alive at once on this rank
    quantize_on: str = ""  # a CUDA device ("cuda:0") where CPU-held sources are quantized; "": on the CPU
    base_budget_bytes: int = DEFAULT_BASE_BUDGET  # delta rounds: bytes of last-sent rows kept (docs/DELTAS.md)
    base_on: str = "device"  # where they are kept: "device" (the staged bytes' own) or "host" (pinned memory)
    arm: bool = True  # take the controller's arms: write on our own push, no begin awaited (roles.arms)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bases(self.base_budget_bytes, self.base_on)
        if self.quantize_on and not self.quantize_on.startswith("cuda"):
            raise ConfigError("quantize_on", f"must name a CUDA device (\"cuda:0\") or be empty, got {self.quantize_on!r}")


class WeightSender(Worker):
    role = Role.SENDER

    def __init__(self, controller_addr: str, params: Params, *, rank: int,
                 options: SenderOptions = SenderOptions(), shards: Mapping[str, ShardSpec] = {},
                 gatherable: bool = False, transforms: Mapping[str, Transform] = {}) -> None:
        tensors, dtensor_shards, dtensors = split_dtensors(named_tensors(params))
        options = with_device(options, tensors)
        if options.arm:
            options = dataclasses.replace(options, capabilities=(*options.capabilities, "arm", "commit_arm"))
        super().__init__(controller_addr, rank, options)
        self.tensors = tensors
        self.shards = {**shards, **dtensor_shards}
        self.gatherable = gatherable
        self.gathered = frozenset(dtensors)  # FSDP2 parameters: gathered per round (engine.transforms.gather)
        gatherer = Gatherer(dtensors, options.gather_budget_bytes, dtensor_shards) if dtensors else None
        self.sources = SourceSet(self.tensors, self.shards, transforms, gatherer,
                                 group_bytes_for(options.pipeline.max_inflight_bytes),
                                 torch.device(options.quantize_on) if options.quantize_on else None)
        self.pipeline = Pipeline(self.sources, options.pipeline, StagingPool(pin=torch.cuda.is_available()))
        self.table: Optional[SenderTable] = None
        self.plan_id: Optional[int] = None
        self.conns = DataConnections()  # receiver rank -> its connection
        self._conn_keys = self.conns.made_for  # receiver -> (address, pair key) of its connection
        self._keys: dict[int, bytes] = {}  # receiver -> the current plan's pair key
        self._handles: dict[int, PushHandle] = {}
        self._round: Optional[asyncio.Task] = None
        self._deferred: Optional[asyncio.Task] = None  # the last push that waited to read what was delivered
        self._plan_task: Optional[asyncio.Task] = None  # connecting and preparing a plan, off the receive loop
        self._in_doubt: dict[int, PushHandle] = {}  # pushes written, whose commit a lost session did not tell
        self._last_version = -1
        self.committed: Optional[int] = None  # the newest version this sender saw committed
        self.bases = Bases(options.base_budget_bytes, options.base_on)
        self.delta_side = "encode"
        self.last_delta: Optional[DeltaRound] = None  # the newest round's delta lanes and what went as deltas
        self.early = EarlyWrites()  # the controller's arm, and a version written under one

    def __repr__(self) -> str:
        return (f"<WeightSender {self.name} {self.session.state.value} plan={self.plan_id} "
                f"connections={len(self.conns)} pushed=v{self._last_version} {self.pipeline!r}>")

    def _manifest(self) -> Manifest:
        ties = find_ties(self.tensors)
        specs = tuple(
            spec_for(name, t, region=None, offset=0, tied_to=ties.get(name), shard=self.shards.get(name),
                     gatherable=(self.gatherable and name in self.shards) or name in self.gathered)
            for name, t in self.tensors.items()
        )
        return Manifest(specs, ())

    def _hello_fields(self) -> dict:
        return {"committed": self.committed}

    def _on_welcome(self, welcome: m.Welcome) -> None:
        if welcome.committed is not None:  # a fresh process resumes above what was committed before it
            self.committed = max(welcome.committed, -1 if self.committed is None else self.committed)
            self._last_version = max(self._last_version, welcome.committed)

    def _on_session_lost(self, exc: BaseException) -> None:
        """A round whose writes were all done may have committed without us hearing it: its handle
        waits for the next plan, which says (``Plan.committed``); every other push fails now."""
        if self._round is not None and not self._round.done():
            self._round.cancel()
        if self._plan_task is not None and not self._plan_task.done():
            self._plan_task.cancel()
        self.early.drop(None)  # (the round task was cancelled above)
        written = self.session.state is State.WRITTEN
        for version, handle in list(self._handles.items()):
            if written and handle.released.done() and not handle.released.exception():
                self._in_doubt[version] = handle
            else:
                handle.fail(exc)
        self._handles.clear()

    def _settle_in_doubt(self, committed: Optional[int]) -> None:
        """The outcome of pushes whose session was lost after their writes: the plan's committed version."""
        doubt, self._in_doubt = self._in_doubt, {}
        for version, handle in doubt.items():
            if committed is not None and committed == version:
                self.committed = max(version, self.committed if self.committed is not None else -1)
                if not handle.committed.done():
                    handle.committed.set_result(version)
            elif committed is not None and committed > version:
                handle.fail(ControllerLost(f"the outcome of v{version} is unknown: the session was lost after its "
                                           f"writes, and v{committed} has committed since"))
            else:
                handle.fail(RoundAborted(version, m.AbortReason.PEER_LOST, f"v{version} did not commit: the session "
                                         f"was lost after its writes (committed: v{committed})", self.name))

    # --- public API -------------------------------------------------------------------------------

    async def push(self, version: int) -> PushHandle:
        """Returns once this sender no longer reads its tensors; ``await`` the handle for the commit."""
        handle = self.push_nowait(version)
        await asyncio.shield(handle.released)
        return handle

    @property
    def last_version(self) -> int:
        """The newest version this sender pushed or learned was committed (-1: none): pushes go above it."""
        return self._last_version

    def push_nowait(self, version: int) -> PushHandle:
        if self.lost is not None:
            raise self.lost
        if self.transport is None:
            raise ConfigError("push", f"{self.name} is not started: use `async with WeightSender(...)` or await start()")
        if self.plan_error is not None:
            raise self.plan_error
        if version <= self._last_version:
            raise VersionError(f"push of version {version}: versions only move forward (last pushed or "
                               f"committed {self._last_version})")
        self._last_version = version
        handle = self._handles[version] = PushHandle(version)
        self._spin(True)  # until the round ends here: begin, then commit, come sooner to a polling loop
        unread, before = self.backlog.unread(), self._deferred
        if unread is None and (before is None or before.done()):
            self._push_now(handle)
            return handle

        async def push_after_reading() -> None:  # (after the push before it: pushes leave in order)
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            await self.backlog.read(unread or 0)
            if self.lost is not None:
                raise self.lost
            if not handle.committed.done():
                self._push_now(handle)
        task = self._deferred = asyncio.ensure_future(push_after_reading())
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or handle.fail(t.exception()))
        return handle

    def _push_now(self, handle: PushHandle) -> None:
        """Under the current plan's arm, write at once (``armed_push``); else ``push`` once the session is
        READY, unless the push failed meanwhile (its caller may have moved the tensors on)."""
        version = handle.version
        first = min(self._handles, default=version) == version  # (no earlier push of ours in flight)
        arm = self.early.take(self.plan_id) if self.session.state is State.READY and first \
            and not self._in_doubt else None  # (an arm: write now)
        sending = self._post_if_allowed(m.ArmedPush(version, arm.arm_id), version=version) if arm else None
        if sending is not None:
            sending.add_done_callback(lambda f: f.cancelled() or f.exception() is None or handle.fail(ControllerLost(
                f"push of v{version} not sent: the control channel is gone ({f.exception()})")))
            self.early.start(version, arm)
            self._start_writing(version, handle, arm)
            handle.sent.set_result(True)
            return

        async def push_when_ready() -> None:
            await self._wait_state(State.READY)
            if not handle.committed.done():
                try:
                    await self._send(m.Push(version), version=version)
                except zmq.ZMQError as exc:
                    raise ControllerLost(f"push of v{version} not sent: the control channel is gone ({exc})") from exc
                if not handle.sent.done():
                    handle.sent.set_result(False)
        task = asyncio.ensure_future(push_when_ready())
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or handle.fail(t.exception()))

    def _start_writing(self, version: int, handle: PushHandle, params: "m.UpdateBegin | m.Arm") -> None:
        self.pipeline.options = dataclasses.replace(self.pipeline.options, checksum=params.checksum)
        slots = {s.rank: s.slot for s in params.landing}
        held = {b.rank: b.version for b in params.bases}
        self._round = asyncio.ensure_future(self._write(version, handle, slots, self._round, (params.delta, held)))

    async def _on_arm(self, env: Envelope) -> None:
        self.early.offered(env.body, self.plan_id)

    # --- protocol handlers ------------------------------------------------------------------------

    async def _on_plan(self, env: Envelope) -> None:
        """Connect and prepare in a task of its own: the receive loop goes on reading (heartbeats, a
        leave) however long a peer takes to answer (``TransportOptions.connect_timeout_s`` at most)."""
        self._settle_in_doubt(env.body.committed)
        early = self._round if self.early.under is not None else None
        if early is not None and not (env.body.sender == self.table and self._keys == {k.rank: k.key for k in env.body.keys}):
            self.early.drop(self._round)  # (written under the plan this one replaces, which changed what we write)
        self.early.arm = None
        self.plan_error = None
        self.table = env.body.sender
        self.plan_id = env.body.plan_id
        self._keys = {k.rank: k.key for k in env.body.keys}
        self._plan_task = asyncio.ensure_future(self._take_plan(env.body, early))

    async def _take_plan(self, body: m.Plan, early: Optional[asyncio.Future] = None) -> None:
        ack = m.PlanAck(body.plan_id, True, "")
        if early is not None:  # (writes under an arm, kept or stopped: done with the sources and connections first)
            await asyncio.gather(early, return_exceptions=True)
        try:
            await self.conns.connect(self.transport, self.table.peers, self._keys)
            await asyncio.to_thread(self.sources.prepare, self.table.transfers)
        except WeightSyncError as exc:
            log.warning("%s: cannot take plan %d: %s", self.name, body.plan_id, exc)
            ack = m.PlanAck(body.plan_id, False, str(exc))
        try:
            if (sending := self._post_if_allowed(ack)) is not None:
                await sending
        except zmq.ZMQError as exc:  # (the session is being torn down: it will not need the ack)
            log.debug("%s: plan_ack %d not sent: %s", self.name, body.plan_id, exc)

    async def _on_begin(self, env: Envelope) -> None:
        version = env.body.version
        early, held = self.early.under, self.early.held
        self.early.arm = None
        if early is not None and early[0] == version:  # (a plan replaced the arm's, keeping our table: ``_on_plan``)
            self.early.under = self.early.held = None
            arm = early[1]
            if (self.plan_id, arm.checksum, arm.landing, arm.bases, arm.delta) == (
                    env.body.plan_id, env.body.checksum, env.body.landing, env.body.bases, env.body.delta):
                held = dataclasses.replace(held, plan_id=self.plan_id) if held is not None else None
                if held is not None and (sending := self._post_if_allowed(held, version=version)) is not None:
                    await sending  # (sealed before this begin came: said again, for this plan)
                return
            await self._fail_round(version, self._handles.get(version) or PushHandle(version), WeightSyncError(
                f"begin of v{version} differs from arm {arm.arm_id}, under which it was written"), m.ErrorCode.PROTOCOL)
            return
        if early is not None:  # (a round we did not push for came first: our early writes never count)
            self.early.drop(self._round)
        handle = self._handles.get(version)
        if handle is None:  # a round the controller started on its own
            handle = self._handles[version] = PushHandle(version)
            self._last_version = max(self._last_version, version)
        if env.body.plan_id != self.plan_id:
            await self._fail_round(version, handle, WeightSyncError(
                f"begin names plan {env.body.plan_id}, ours is {self.plan_id}"), m.ErrorCode.PLAN)
            return
        self._start_writing(version, handle, env.body)

    async def _write(self, version: int, handle: PushHandle, slots: dict[int, int],
                     previous: Optional[asyncio.Future], delta: tuple[str, dict[int, int]] = ("", {})) -> None:
        """Run the pipeline; ``writes_done`` goes out once every lane is sealed (for connections that
        prove delivery at the target, before the last copies finish), the handle is released once
        every write has completed. A round may commit before its last completions are drained:
        the next one starts after them (``previous``)."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        announced: list[asyncio.Future] = []

        def announce(sealed: PushReport) -> None:  # (posted at once: not behind the lanes' own steps)
            self.timeline.mark(version, "pipeline:sealed")
            done = m.WritesDone(version, self.plan_id, sealed.summaries(), sealed.stage_s, sealed.write_s,
                                sealed.encode_s, sealed.issue_s, bool(getattr(self.transport, "trying", ())))
            if self.early.writing(version):  # written under an arm: its armed_push stood for begin, unless a
                self.early.held = done         # plan came since (then said again at the begin it gets)
                if self.session.state is not State.WRITING:
                    return
            sending = self._post_if_allowed(done, version=version)
            if sending is not None:
                announced.append(sending)

        self.timeline.mark(version, "pipeline:start")
        try:
            if len(self.conns) < len(self.table.peers):  # a connection a failure closed: made again
                await self.conns.connect(self.transport, self.table.peers, self._keys)
            mode, held = delta  # (after the previous round: its bases are settled now)
            sizes = windows(mode, self.table.peers, self.conns, self.bases.pays)
            deltas = self.last_delta = self.bases.round(version, mode, held, sizes)
            report = await self.pipeline.run(self.table.transfers, self.conns, epoch=version, slots=slots,
                                             on_sealed=announce, deltas=deltas,
                                             mark=lambda event: self.timeline.mark(version, event))
        except asyncio.CancelledError:
            handle.release_committed(f"{self.name}: its round was stopped")
            raise
        except Exception as exc:  # reported, never left hanging; after writes_done if it went out already
            handle.release_committed(f"{self.name}: {exc}")
            await self.conns.forget_broken(exc, self.name)
            await asyncio.gather(*announced, return_exceptions=True)
            await self._fail_round(version, handle, exc, error_code(exc))
            if not isinstance(exc, (TransportError, StagingError, WeightSyncError)):
                log.exception("%s: round %s failed", self.name, version)  # a bug or a torch error
            return
        self.timeline.mark(version, "pipeline:end")
        self.bases.observe(report.lanes, report.seconds, deltas.lanes if deltas is not None else frozenset())
        if not handle.released.done():
            handle.released.set_result(report)
        await asyncio.gather(*announced)

    async def _fail_round(self, version: int, handle: PushHandle, exc: BaseException, code: m.ErrorCode) -> None:
        """Report a local failure; the handle fails with the controller's verdict (its ``abort``, whose
        ``RoundAborted`` names the culprit and has ``exc`` as its cause), the one every rank sees."""
        self._spin(False)
        field = getattr(exc, "peer", None) or getattr(exc, "param", None) or ""
        handle.cause = exc
        sending = self._post_if_allowed(m.Error(code, str(exc), field, version), version=version)
        if sending is None:
            handle.fail(exc)
        else:
            await sending

    async def _on_commit(self, env: Envelope) -> None:
        self.early.finish(env.body.version)
        if env.body.arm is not None:  # (the next round's arm, in the commit: held before the push it serves)
            self.early.offered(env.body.arm, self.plan_id)
        self.committed = env.body.version
        self.bases.commit(env.body.version)  # (an aborted round's deltas are undone before the next one)
        handle = self._handles.pop(env.body.version, None)
        if handle is not None and not handle.committed.done():
            handle.committed.set_result(env.body.version)
        self._spin(bool(self._handles))  # (last: the collector it held back may run from here, unless a
        #                                   newer push of ours is still in flight)

    async def _on_abort(self, env: Envelope) -> None:
        body = env.body
        dropped = self.early.drop(self._round)
        if dropped is not None and dropped != body.version:  # (another round's abort stopped them: that push
            stopped = self._handles.pop(dropped, None)        #  has no round to wait for)
            if stopped is not None:
                stopped.fail(RoundAborted(dropped, m.AbortReason.CANCELLED, f"its writes under an arm were stopped by "
                                          f"the abort of v{body.version}", "controller"))
        if self._round is not None and not self._round.done():
            self._round.cancel()  # (not awaited here: a write stuck on a partitioned peer must not stop this
            #                        loop; the next round's pipeline starts after it: ``_write``'s ``previous``)
        handle = self._handles.pop(body.version, None)
        self._spin(False)
        if handle is not None:
            aborted = RoundAborted(body.version, body.reason, body.text, body.culprit)
            aborted.__cause__ = handle.cause
            handle.fail(aborted)

    async def _on_error(self, env: Envelope) -> None:
        await super()._on_error(env)
        handle = self._handles.get(env.version) if env.version is not None else None
        if handle is not None and env.body.code == m.ErrorCode.BAD_REQUEST:
            if self.early.writing(env.version):
                self.early.drop(self._round)
            self._handles.pop(env.version, None)
            self._spin(False)
            if env.body.field == "arm":  # written under an arm that did not hold: the version never runs
                aborted = RoundAborted(env.version, m.AbortReason.CANCELLED, env.body.text, "controller")
                aborted.__cause__ = handle.cause
                handle.fail(aborted)
            else:
                handle.fail(VersionError(env.body.text))

    def _on_closed(self, exc: BaseException) -> None:
        super()._on_closed(exc)
        self._fail_handles(exc)

    def _on_plan_error(self, exc: PlanError) -> None:
        self._spin(False)
        self._fail_handles(exc)

    def _fail_handles(self, exc: BaseException) -> None:
        for handle in [*self._handles.values(), *self._in_doubt.values()]:
            handle.fail(exc)
        self._handles.clear()
        self._in_doubt.clear()

    async def _close_data_plane(self) -> None:
        for task in (self._round, self._plan_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.conns.close()
