"""What senders and receivers share: the join handshake, heartbeats, and message dispatch.

How this works: ``Worker.start`` opens the data-plane transport, builds the manifest (subclass),
connects a DEALER with a fresh random routing id, sends ``hello`` and waits for ``welcome`` (or turns
a ``reject`` into ``JoinRejected``). Then two tasks run: the receive loop checks each message against
the session state machine (an illegal one is answered with ``error`` and ignored) and dispatches it to
``_on_<type>``; the heartbeat loop sends ``heartbeat`` and declares the controller lost when nothing
was heard for the timeout. ``close`` says ``leave`` and tears down sockets, tasks and transport,
shielded from cancellation.

Self-healing: a join refused because this rank's previous session is still known (the process was
restarted before the controller noticed) is retried until ``join_timeout_s``. When the session is
lost later (the controller went silent, said ``leave``, or answers as if it never heard of us: it
restarted), a worker with ``rejoin`` on fails only what the session had in flight and joins again
with a fresh identity, backing off, until ``rejoin_deadline_s``; its data plane, tensors and versions
stay as they are, and its hello tells the new controller the newest version it saw committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import os
import secrets
import time
from typing import Any, Callable, Optional

import zmq

from weightsync.engine.aio import AsyncResource, Spinner, within
from weightsync.engine.errors import ConfigError, ControllerLost, JoinRejected, PlanError
from weightsync.engine.transport import Transport, TransportOptions, create_transport
from weightsync.wire import PROTOCOL_VERSION, DEFAULT_LIMITS, Envelope, Limits, Manifest, Origin, Role, Session, State, TransportInfo
from weightsync.wire import messages as m
from weightsync.wire.errors import ProtocolError

from .backlog import Backlog
from .channel import (CONTROL_DSCP, ControlChannel, StreamClosed, check_auth_key, check_dscp, check_exposure,
                      random_identity)
from .pulse import Pulse
from .timeline import Timeline

log = logging.getLogger("weightsync")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    transport: str = "tcp"
    transport_options: TransportOptions = TransportOptions()
    join_timeout_s: float = 60.0
    limits: Limits = DEFAULT_LIMITS
    capabilities: tuple[str, ...] = ("checksum",)
    auth_key: Optional[bytes] = None  # must match the controller's (wire.auth)
    rejoin: bool = True  # join again by ourselves when the session is lost (the controller restarted)
    rejoin_deadline_s: float = 60.0  # give up (ControllerLost) after trying this long
    rejoin_backoff_s: float = 0.05  # first pause between tries; doubles up to 1 s
    rank_wait_s: float = 30.0  # a join refused for a duplicate rank is tried again this long (a restarted
    #                            process waits for the controller to time out its previous session)
    spin: Optional[bool] = None  # poll the event loop while a round runs (aio.Spinner): one busy core while a
    #                              round is open, a round's hops seen sooner; None: where the tensors are on a GPU
    control_dscp: int = CONTROL_DSCP  # the control channel's packets' DSCP (0: unmarked)
    pulse: bool = True  # heartbeats from a thread of their own too, where the controller takes them (roles.pulse):
    #                     the session lives while the caller holds the event loop (a training step)
    session_stream: bool = True  # after welcome, the session's messages on a TCP stream of its own where the
    #                              controller offers one (roles.channel_stream): no ZeroMQ I/O threads on its hops

    def __post_init__(self) -> None:
        check_auth_key(self.auth_key)
        check_dscp("control_dscp", self.control_dscp)
        check_exposure("transport_options.bind_host", self.transport_options.bind_host, self.auth_key)


async def call_hook(hook: Optional[Callable[..., Any]], *args: Any) -> None:
    if hook is None:
        return
    result = hook(*args)
    if inspect.isawaitable(result):
        await result


class Worker(AsyncResource):
    role: Role

    def __init__(self, controller_addr: str, rank: int, options: WorkerOptions) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ConfigError("rank", f"must be a non-negative int, got {rank!r}")
        self.controller_addr = controller_addr
        self.rank = rank
        self.options = options
        self.name = f"{self.role.value}/{rank}"
        self.session = Session(self.role, Origin.WORKER)
        self.transport: Optional[Transport] = None
        self.transport_info: Optional[TransportInfo] = None
        self.welcome: Optional[m.Welcome] = None
        self.lost: Optional[BaseException] = None
        self.plan_error: Optional[PlanError] = None  # the controller's word that it cannot plan (until a plan comes)
        self._channel: Optional[ControlChannel] = None
        self._tasks: list[asyncio.Task] = []
        self._rejoining: Optional[asyncio.Task] = None
        self._hello_manifest: Optional[Manifest] = None
        self.sessions = 0  # sessions joined so far (1 + rejoins)
        self.incarnation = secrets.token_bytes(8)  # names this worker in every hello it sends
        self._last_heard = 0.0
        self._state_waiters: list[tuple[tuple, asyncio.Future]] = []
        self.backlog = Backlog(None)  # what the receive loop has still to handle (roles.backlog), per session
        self.pulse: Optional[Pulse] = None  # this session's heartbeats from a thread (roles.pulse)
        self._identity = b""  # this session's routing id
        self.streams_ok = options.session_stream  # offer session streams (not after one failed to connect)
        self.timeline = Timeline()  # per version: when each round message was sent / received (roles.timeline)
        self.spinner = Spinner(spins(options.spin, options.transport_options.device))
        self._spinning = False
        self.delta_side = ""  # the delta kernels it runs: "encode" (a sender), "apply" (a receiver with a region)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.session.state.value}>"

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            transport_options = self.options.transport_options
            if self.spinner.enabled:  # (its completion and proof polls keep polling too)
                transport_options = dataclasses.replace(transport_options, busy_poll=True)
            self.transport = create_transport(self.options.transport, transport_options)
            self.transport_info = await self.transport.start(self.rank)
            self._on_transport(self.transport)
            await warm_kernels(getattr(self, "tensors", {}), self.delta_side)
            self._hello_manifest = self._manifest()
            await self._join_retrying(time.monotonic() + self.options.join_timeout_s)
        except BaseException:
            await self.close()
            raise
        self._start_loops()

    def _start_loops(self) -> None:
        self.sessions += 1
        self.backlog.close()  # (whoever waited on the last session's messages stops)
        self.backlog = Backlog(self._channel)
        if self.pulse is not None:  # (the last session's)
            self.pulse.stop()
        self.pulse = None
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._heartbeat_loop())]
        if self.options.pulse and "pulse" in self.welcome.capabilities:
            self.pulse = Pulse(self.controller_addr, self._identity, self.name, self.welcome.heartbeat_ms / 1000,
                               limits=self.options.limits, auth_key=self.options.auth_key,
                               dscp=self.options.control_dscp,
                               alive=lambda tasks=tuple(self._tasks): not any(t.done() for t in tasks)).start()

    async def _teardown(self) -> None:
        if self._channel is not None and self.session.allowed(Origin.WORKER, m.Leave.TYPE):
            try:
                await self._send(m.Leave("closing"), timeout=0)  # best effort: never waits on a dead pipe
            except (zmq.ZMQError, ProtocolError):
                pass
        self.spinner.cancel()
        tasks = [*self._tasks, *([self._rejoining] if self._rejoining is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._on_closed(ControllerLost("worker closed"))
        await self._close_data_plane()
        if self.transport is not None:
            await self.transport.close()
        if self._channel is not None:
            self._channel.close()

    # --- the handshake ----------------------------------------------------------------------------

    async def _join_retrying(self, deadline: float, attempt_s: float = math.inf) -> None:
        """Join on a fresh channel; a refusal for a duplicate rank (our own previous session, not yet
        timed out) is tried again with backoff until ``deadline``, and so is a hello unanswered for
        ``attempt_s`` (on a fresh channel: whatever became of the last one)."""
        pause = self.options.rejoin_backoff_s
        rank_deadline = time.monotonic() + self.options.rank_wait_s
        while True:
            if self._channel is not None:
                self._channel.close()
            self.session = Session(self.role, Origin.WORKER)
            self._identity = random_identity(self.name)
            self._channel = ControlChannel(zmq.DEALER, self.name, limits=self.options.limits,
                                           identity=self._identity, auth_key=self.options.auth_key,
                                           dscp=self.options.control_dscp)
            self._channel.connect(self.controller_addr)
            try:
                await self._join(self._hello_manifest, max(0.01, min(attempt_s, deadline - time.monotonic())))
                return
            except ControllerLost:
                if time.monotonic() >= deadline:
                    raise
                continue  # unanswered: a fresh channel and hello at once
            except JoinRejected as exc:
                # a duplicate rank (our previous session, not yet replaced) and a host's join limit pass
                # with time: both are tried again, backing off; any other refusal is final
                until = {m.RejectCode.DUPLICATE_RANK: min(deadline, rank_deadline),
                         m.RejectCode.LIMIT_EXCEEDED: deadline}.get(exc.code)
                if until is None or time.monotonic() + pause > until:
                    raise
                log.info("%s: %s; trying again", self.name, exc)
            except (ProtocolError, zmq.ZMQError) as exc:  # a garbled or unexpected answer: a new channel, again
                if time.monotonic() + pause > deadline:
                    raise ControllerLost(f"no usable answer to hello: {exc}") from exc
                log.warning("%s: join failed (%r); trying again", self.name, exc)
            await asyncio.sleep(pause)  # backoff between tries, not synchronisation
            pause = min(1.0, pause * 2)

    async def _join(self, manifest: Manifest, timeout: float) -> None:
        hello = m.Hello(self.role, self.rank, self.transport_info.host, self.transport_info.device,
                        os.getpid() & 0xFFFFFFFF, PROTOCOL_VERSION[0], PROTOCOL_VERSION[1],
                        (*self.options.capabilities, *(("stream",) if self.streams_ok else ())),
                        manifest, self.transport_info, incarnation=self.incarnation,
                        **self._hello_fields())
        try:  # (a fresh channel queues it at once: unless its connection failed its handshake, no pipe left)
            await self._send(hello, timeout=timeout)
        except zmq.Again:
            raise ControllerLost(f"hello to {self.controller_addr} could not be sent within {timeout:.1f}s: "
                                 f"no connection (is it running? same auth key?)") from None
        try:
            _, env = await within(self._channel.recv(), timeout)
        except asyncio.TimeoutError:
            raise ControllerLost(f"no answer to hello from {self.controller_addr} within "
                                 f"{timeout:.1f}s (is it running? same auth key?)") from None
        self.session.receive(env.type)
        if isinstance(env.body, m.Reject):
            raise JoinRejected(env.body.code, env.body.text)
        if not isinstance(env.body, m.Welcome):
            raise ControllerLost(f"expected welcome, got {env.type}")
        if env.body.stream_port is not None and self.streams_ok:  # (the session's messages move to its stream)
            try:
                await self._channel.attach_to(self.controller_addr, env.body, timeout)
            except ControllerLost:  # (a port a firewall closes, most likely: we join again on ZeroMQ alone)
                self.streams_ok = False
                raise
        self.welcome = env.body
        self._last_heard = time.monotonic()
        self._on_welcome(env.body)

    # --- loops ------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        backlog = self.backlog  # (this session's: ``_start_loops``)
        try:
            while True:
                backlog.handled()
                try:
                    _, env = await self._channel.recv()
                except ProtocolError as exc:
                    log.warning("%s: undecodable message from controller: %s", self.name, exc)
                    continue
                except StreamClosed as exc:
                    self._session_lost(ControllerLost(str(exc)))
                    return
                backlog.taking()
                self._last_heard = time.monotonic()
                self.timeline.mark(env.version, f"recv:{env.type}")
                illegal = self.session.accept(env.type, env.version)
                if illegal is not None:
                    log.warning("%s: %s", self.name, illegal.text)
                    await self._send(illegal)
                    continue
                self._state_moved()
                handler = getattr(self, f"_on_{env.type}", None)
                if handler is not None:
                    try:
                        await handler(env)
                    except (ProtocolError, zmq.ZMQError):
                        raise
                    except Exception as exc:  # a failing handler must not silence the session
                        log.exception("%s: handling %s failed", self.name, env.type)
                        if self.session.allowed(Origin.WORKER, m.Error.TYPE):
                            await self._send(m.Error(m.ErrorCode.INTERNAL, f"{env.type}: {exc!r}", "", env.version),
                                             version=env.version)
                if self.session.state is State.CLOSED:  # (it said leave)
                    reason = getattr(env.body, "reason", env.type)
                    log.info("%s: controller asked us to leave: %s", self.name, reason)
                    self._session_lost(ControllerLost(f"controller closed the session ({env.type}: {reason})"))
                    return
                if isinstance(env.body, m.Error) and env.body.field == "hello":  # it knows no session of ours
                    self._session_lost(ControllerLost(f"controller no longer knows this session: {env.body.text}"))
                    return
        finally:
            backlog.close()

    async def _heartbeat_loop(self) -> None:
        period = self.welcome.heartbeat_ms / 1000
        timeout = self.welcome.timeout_ms / 1000
        seq = 0
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            if self.pulse is not None:
                self.pulse.beat()  # (the loop runs: the pulse need not speak for it)
            stalled = time.monotonic() - before - period
            if stalled > timeout / 2:  # our own event loop was blocked: do not blame the controller
                log.warning("%s: event loop stalled for %.1fs (a blocking call on the loop?)", self.name, stalled)
                self._last_heard = time.monotonic()
            if time.monotonic() - self._last_heard > timeout:
                self._session_lost(ControllerLost(f"controller silent for more than {timeout:.1f}s"))
                return
            seq += 1
            try:  # never blocks: this loop is what notices a controller gone silent
                await self._send(m.Heartbeat(seq), timeout=period)
            except zmq.Again:
                log.debug("%s: heartbeat %d not queued (no connection to the controller)", self.name, seq)

    async def _send(self, body: m.Message, *, version: Optional[int] = None, parent_id: Optional[int] = None,
                    timeout: Optional[float] = None) -> int:
        self.session.send(body.TYPE)
        self._state_moved()
        msg_id = await self._channel.send(body, version=version, parent_id=parent_id, timeout=timeout)
        self.timeline.mark(version, f"send:{body.TYPE}")
        return msg_id

    def _post_if_allowed(self, body: m.Message, *, version: Optional[int] = None) -> Optional[asyncio.Future]:
        """Send ``body`` unless the session has moved on (a round aborted or the session closed meanwhile),
        handed to ZeroMQ now (``Channel.post``, not behind the loop's other tasks): the send's future to
        await, or None where the session has moved on."""
        if not self.session.allowed(Origin.WORKER, body.TYPE):
            log.debug("%s: not sending %s in state %s", self.name, body.TYPE, self.session.state.value)
            return None
        self.session.send(body.TYPE)
        self._state_moved()
        sending = self._channel.post(body, version=version)
        self.timeline.mark(version, f"send:{body.TYPE}")
        return sending

    async def _wait_state(self, *states: State) -> None:
        """Wait until the session is in one of ``states``; raises if the session is lost first."""
        while self.session.state not in states:
            if self.lost is not None:
                raise self.lost
            fut = asyncio.get_running_loop().create_future()
            self._state_waiters.append((states, fut))
            await fut

    def _state_moved(self) -> None:
        keep = []
        for states, fut in self._state_waiters:
            if fut.done():
                continue
            if self.session.state in states or self.lost is not None:
                fut.set_result(None)
            else:
                keep.append((states, fut))
        self._state_waiters = keep

    def _spin(self, on: bool) -> None:
        """Hold the spinner from a round's start to its end (once per round, however it ends)."""
        if on != self._spinning:
            self._spinning = on
            self.spinner.hold() if on else self.spinner.release()

    def _session_lost(self, exc: ControllerLost) -> None:
        """This session is over; join a new one (``rejoin``) or give up."""
        if not self.options.rejoin or self._closed:
            self._on_closed(exc)
            return
        log.warning("%s: %s; joining again", self.name, exc)
        self._spin(False)
        self._on_session_lost(exc)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._rejoining = asyncio.ensure_future(self._rejoin(exc))

    async def _rejoin(self, cause: ControllerLost) -> None:
        deadline = time.monotonic() + self.options.rejoin_deadline_s
        attempt_s = 2 * self.welcome.timeout_ms / 1000 if self.welcome is not None else math.inf
        try:  # the hello waits in the socket until a controller is back at the address (zmq reconnects)
            await self._join_retrying(deadline, attempt_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever it was, the worker must not be left half-joined and silent
            if not isinstance(exc, (ControllerLost, JoinRejected)):
                log.exception("%s: joining again failed", self.name)
            self._on_closed(ControllerLost(f"could not join again within {self.options.rejoin_deadline_s}s "
                                           f"after: {cause} (last: {exc})"))
            return
        log.info("%s: joined again (session %d)", self.name, self.sessions + 1)
        self._start_loops()
        self._rejoining = None

    async def _on_error(self, env: Envelope) -> None:
        log.warning("%s: controller reported %s: %s", self.name, env.body.code.name, env.body.text)
        if env.body.code == m.ErrorCode.PLAN:  # no plan can be made for the members joined now
            self.plan_error = PlanError(f"the controller cannot plan: {env.body.text}", param=env.body.field or None)
            self._on_plan_error(self.plan_error)

    # --- for subclasses ---------------------------------------------------------------------------

    def _manifest(self) -> Manifest:
        raise NotImplementedError

    def _hello_fields(self) -> dict:
        """Optional hello fields (``committed``, ``landing``) this worker fills in."""
        return {}

    def _on_welcome(self, welcome: m.Welcome) -> None:
        """A session began (the first, or a rejoin)."""

    def _on_plan_error(self, exc: PlanError) -> None:
        """The controller cannot plan for the members joined now: fail whatever waits on a plan."""

    def _on_session_lost(self, exc: BaseException) -> None:
        """A session ended and another will be joined: fail what it had in flight."""

    def _on_transport(self, transport: Transport) -> None:
        """The transport is up (before the manifest is built)."""

    def _on_closed(self, exc: BaseException) -> None:
        """The session is over (controller lost or closing): fail whatever is waiting."""
        if self.lost is None:
            self.lost = exc
        self.backlog.close()
        if self.pulse is not None:
            self.pulse.stop()
        self._spin(False)
        self._state_moved()

    async def _close_data_plane(self) -> None:
        """Close connections the subclass opened."""


async def warm_kernels(tensors: dict, delta_side: str) -> None:
    """Compile the GPU kernels rounds may launch on the devices of ``tensors`` before joining
    (``engine.cuda.warm``: Triton compiles each on its first launch, which no round should pay); with
    ``delta_side`` and CPU tensors, load the compiled CPU delta kernels on a thread meanwhile
    (``delta_cpu.warm_soon``: joining does not wait for numba's import)."""
    widths: dict = {}
    for t in tensors.values():
        if t.device.type == "cuda":
            widths.setdefault(t.device, set()).add(t.element_size())
    if widths:
        from weightsync.engine.cuda.warm import warm

        await asyncio.to_thread(warm, widths, delta_side)
    if delta_side and any(t.device.type == "cpu" for t in tensors.values()):
        from weightsync.engine.transforms import delta_cpu

        delta_cpu.warm_soon()


def spins(spin: Optional[bool], device: str) -> bool:
    """Whether a process polls its loop while rounds run: ``spin`` if given, else where its tensors are
    on a GPU (a round there lasts milliseconds, and each hop to a sleeping loop costs tenths of one:
    docs/TRANSPORTS.md); not on a CPU, where the loop's core is the data plane's."""
    return spin if spin is not None else str(device).startswith("cuda")


def with_device(options: WorkerOptions, tensors: dict) -> WorkerOptions:
    """Tell the transport which device this worker's tensors live on (the first CUDA one, else cpu)."""
    device = next((str(t.device) for t in tensors.values() if t.device.type == "cuda"), "cpu")
    if options.transport_options.device == device:
        return options
    return dataclasses.replace(options, transport_options=dataclasses.replace(options.transport_options, device=device))
