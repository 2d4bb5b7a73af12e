"""``Controller``: admits workers, plans routing, and runs update rounds over one ZeroMQ ROUTER.

How this works: the controller is its socket loop, its dispatch and the wiring of three parts it owns:
``Membership`` (who is joined, as which session, and whether a ``hello`` may join:
``roles.membership``), ``Planning`` (when to plan, the plan and its keys, held by session:
``roles.planning``) and ``Rounds`` (pushes, the round's state machine, verdicts and the committed
version: ``roles.rounds``, whose transitions are ``roles.round_state.ROUND_STEPS``); its options are
``roles.controller_options``. One receive loop handles every message in order: ``hello`` goes through
admission (a ``reject`` otherwise); identity comes from the hello, never from arrival order. Each
session message is checked against the session state machine and handed to the part that owns it
(``_handlers``). A membership change re-plans between rounds; a plan acknowledged by every member starts
the rounds its senders pushed for; a round's end lets the next plan or round go. A heartbeat loop keeps
peers alive and drops silent ones; a session whose stream ended is dropped when the receive loop reaches
that end (``StreamEnded``, after everything the stream brought).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Awaitable, Callable, Optional

import zmq

from weightsync.engine.aio import AsyncResource, Spinner, Waiters
from weightsync.engine.errors import ConfigError
from weightsync.engine.logs import Repeats
from weightsync.engine.plan import RoutingPlan
from weightsync.wire import PROTOCOL_VERSION, Envelope, Origin, Role, Session, State
from weightsync.wire import messages as m
from weightsync.wire.auth import Replayed, Unauthenticated
from weightsync.wire.errors import FieldError, ProtocolError, VersionMismatch

from .channel import ControlChannel, StreamEnded, check_exposure, endpoint_host
from .controller_options import ControllerOptions
from .costs import Costs
from .limits import RateLimiter
from .membership import Hearing, Membership, Peer
from .planning import Planning
from .pulse import SUFFIX as PULSE
from .round_state import RoundReport
from .rounds import Rounds, crossed
from .status import controller_status, run_command
from .timeline import Timeline

log = logging.getLogger("weightsync")


class Controller(AsyncResource):
    def __init__(self, bind_addr: str = "tcp://127.0.0.1:0", *, senders: int, receivers: int,
                 options: ControllerOptions = ControllerOptions(),
                 on_round: Optional[Callable[[RoundReport], Any]] = None) -> None:
        if senders < 1 or receivers < 0:
            raise ConfigError("senders", f"need at least one sender, got senders={senders} receivers={receivers}")
        check_exposure("bind_addr", bind_addr, options.auth_key)
        self.bind_addr = bind_addr
        self.options = options
        self.on_round = on_round
        self.address = ""
        self.timeline = Timeline()  # per version: when each round message was sent / received
        self.spinner = Spinner(bool(options.spin))  # (None: decided per round, ``Rounds.start``)
        self.waiters = Waiters()  # ``wait_plan`` and tests wait on conditions the parts wake
        self.hearing = Hearing(3 * options.heartbeat_s)  # (members beat every heartbeat_s)
        self.membership = Membership({Role.SENDER: senders, Role.RECEIVER: receivers}, options.mapping,
                                     options.peer_limits, min(3 * options.heartbeat_s, options.timeout_s))
        self.planning = Planning(self.membership, options, self._send, busy=lambda: self.rounds.task is not None,
                                 committed=lambda: self.rounds.committed, on_ready=self._planned,
                                 on_final_error=lambda exc: self.rounds.drop_pushes())
        self.costs = Costs(options.link)  # what rounds cost beyond the makespan model, learned; predictions
        self.rounds = Rounds(self.planning, options, self._send, timeline=self.timeline, spinner=self.spinner,
                             wake=self.waiters.wake, on_finished=self._round_over, predict=self.costs.predict)
        self.dropped = 0  # messages dropped unauthenticated, replayed or over a peer's rate
        self._drops = Repeats(log)  # (a flood of bad messages logs a line per peer and window, with a count)
        self._rates = RateLimiter(options.peer_limits)
        self._tasks: list[asyncio.Task] = []
        self._chan: Optional[ControlChannel] = None
        self.last_reject: Optional[tuple[str, m.RejectCode, str]] = None  # (member, code, why) of the newest refused join
        # what each session message does (a handler may be a coroutine function)
        self._handlers: dict[str, Callable[[Peer, Envelope], Optional[Awaitable[None]]]] = {
            m.Push.TYPE: lambda peer, env: self.rounds.on_push(peer, env.body.version),
            m.ArmedPush.TYPE: lambda peer, env: self.rounds.on_armed_push(peer, env.body.version, env.body.arm_id),
            m.PlanAck.TYPE: lambda peer, env: self.planning.on_plan_ack(peer, env.body),
            **{t: lambda peer, env: self.rounds.on_round_message(peer, env.body)
               for t in (m.BeginAck.TYPE, m.WritesDone.TYPE, m.FenceAck.TYPE, m.CommitAck.TYPE)},
            m.Error.TYPE: lambda peer, env: self.rounds.on_error(peer, env.body),
            m.Leave.TYPE: lambda peer, env: self._drop(peer, f"left: {env.body.reason}"),
        }

    def __repr__(self) -> str:
        return (f"<Controller {self.address} {self.membership!r} {self.planning!r} {self.rounds!r} "
                f"dropped={self.dropped}>")

    # --- what the parts hold, read by users and tools ------------------------------------------------

    @property
    def peers(self) -> dict[bytes, Peer]:
        return self.membership.peers

    @property
    def plan(self) -> Optional[RoutingPlan]:
        return self.planning.plan

    @property
    def refused(self) -> int:
        """Connections whose CURVE handshake failed (a peer without the auth key)."""
        return self._chan.refused if self._chan is not None else 0

    @property
    def committed(self) -> Optional[int]:
        return self.rounds.committed

    @property
    def reports(self) -> list[RoundReport]:
        return self.rounds.reports

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._chan = ControlChannel(zmq.ROUTER, "controller", limits=self.options.limits,
                                    auth_key=self.options.auth_key, dscp=self.options.control_dscp)
        self._chan.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.address = self._chan.bind(self.bind_addr)
        except zmq.ZMQError as exc:
            self._chan.close()
            raise ConfigError("bind_addr", f"cannot bind {self.bind_addr}: {exc}") from exc
        host = endpoint_host(self.address)
        if self.options.session_streams and host is not None:
            try:
                self._chan.listen_stream(host, self.options.stream_port)
            except OSError as exc:
                self._chan.close()
                raise ConfigError("stream_port", f"cannot listen on {host}:{self.options.stream_port}: {exc}") from exc
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._heartbeat_loop())]

    async def _teardown(self) -> None:
        self.spinner.cancel()
        for task in self._tasks:
            task.cancel()
        pending = [*self._tasks, *self.rounds.cancel(), *filter(None, [self.planning.cancel()]), *self.costs.cancel()]
        await asyncio.gather(*pending, return_exceptions=True)
        for peer in self.membership:
            if peer.session.allowed(Origin.CONTROLLER, m.Leave.TYPE):
                try:
                    await self._send(peer, m.Leave("controller shutting down"))
                except zmq.ZMQError:
                    pass
        if self._chan is not None:
            self._chan.close()

    # --- public API -------------------------------------------------------------------------------

    async def wait_ready(self) -> RoutingPlan:
        """Wait until a plan has been computed and acknowledged by every worker in it."""
        await self.planning.ready.wait()
        return self.planning.plan

    async def wait_plan(self, after: int = 0) -> RoutingPlan:
        """Wait for an acknowledged plan newer than ``after`` (a re-plan after a membership change)."""
        await self.waiters.wait(lambda: self.planning.ready.is_set() and self.plan is not None
                                and self.plan.plan_id > after)
        return self.planning.plan

    async def wait_round(self, version: int) -> RoundReport:
        """Wait for the round of ``version``; returns its report or raises ``RoundAborted``."""
        return await self.rounds.wait_round(version)

    def update(self, version: int) -> None:
        """Start a round for ``version`` without waiting for pushes (the daemon's and CLI's way). Rounds
        started this way offer no arms from then on (``roles.arming``: no push will take them)."""
        self.rounds.arming.driven = True
        self.rounds.start(version)

    def status(self) -> dict:
        return controller_status(self.address, self.membership, self.planning, self.rounds, self.costs)

    # --- what the parts tell each other -----------------------------------------------------------

    def _planned(self) -> None:
        """A plan is acknowledged by every member: rounds its senders pushed for may start."""
        self.costs.on_plan(self.planning.plan, self.planning.participants)
        self.waiters.wake()
        self.rounds.maybe_start()

    def _round_over(self, report: RoundReport) -> None:
        self.costs.on_round(report, self.planning.plan, self.planning.participants)
        if self.on_round is not None:
            self.on_round(report)
        self.planning.maybe_plan()
        self.rounds.maybe_start()

    # --- receive loop -----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            try:
                identity, env = await self._chan.recv()
            except (Unauthenticated, Replayed) as exc:  # dropped and logged, never executed or answered
                self.dropped += 1
                peer_id = getattr(exc, "peer", None)
                self._drops.log((peer_id, type(exc).__name__), f"controller: dropped a message from {peer_id!r}: {exc}")
                continue
            except FieldError as exc:
                if exc.field.startswith("hello.manifest") and getattr(exc, "peer", None) is not None:
                    log.warning("controller: malformed manifest from %r: %s", exc.peer, exc)  # a join refused
                    await self._chan.send(m.Reject(m.RejectCode.MANIFEST_MISMATCH, f"malformed manifest: {exc}",
                                                   PROTOCOL_VERSION[0], PROTOCOL_VERSION[1], 0, 0), to=exc.peer)
                else:
                    await self._bad_message(exc)
                continue
            except ProtocolError as exc:
                await self._bad_message(exc)
                continue
            except StreamEnded as exc:  # (a process gone, or one that closed it: no network's silence)
                if (peer := self.membership.get(exc.identity)) is not None:
                    self._drop(peer, f"its session stream {exc.why}", ended=True)
                continue
            if not self._rates.allow(identity, time.monotonic()):
                self.dropped += 1
                self._on_abusive(identity)
                continue
            try:
                await self._dispatch(identity, env)
            except zmq.ZMQError:
                raise
            except Exception:  # one bad message must not take the controller down
                log.exception("controller: failed to handle %s from %r", env.type, identity)

    async def _bad_message(self, exc: ProtocolError) -> None:
        """Answer what could not be decoded: another major version gets its ``reject`` (whose layout every
        version reads); anything else an ``error`` naming the field, logged aggregated."""
        if isinstance(exc, VersionMismatch):
            if getattr(exc, "peer", None) is not None:
                body = m.Reject(m.RejectCode.VERSION_MISMATCH, str(exc), PROTOCOL_VERSION[0], PROTOCOL_VERSION[1],
                                exc.theirs[0], exc.theirs[1])
                await self._chan.send(body, to=exc.peer, parent_id=exc.header.msg_id)
            return
        self._drops.log((getattr(exc, "peer", None), "bad"), f"controller: bad message from {getattr(exc, 'peer', None)!r}: {exc}")
        peer_id = getattr(exc, "peer", None)
        if peer_id is not None:
            await self._chan.send(m.Error(m.ErrorCode.PROTOCOL, str(exc), getattr(exc, "field", ""), None),
                                  to=peer_id)

    async def _dispatch(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        if isinstance(body, m.StatusRequest):
            await self._chan.send(m.StatusReply(self.status()), to=identity, parent_id=env.msg_id)
            return
        if isinstance(body, m.CommandRequest):
            ok, result, text = run_command(body, self.status, self.update)
            await self._chan.send(m.CommandReply(ok, result, text), to=identity, parent_id=env.msg_id)
            return
        peer = self.membership.get(identity)
        if isinstance(body, m.Hello) and peer is None:
            await self._admit(identity, env)
            return
        if peer is None and identity.endswith(PULSE):  # a session's heartbeat from its worker's thread (roles.pulse)
            owner = self.membership.get(identity[:-len(PULSE)])
            if isinstance(body, m.Heartbeat) and owner is not None and env.sender == owner.name:
                owner.last_seen = time.monotonic()
                self.hearing.heard(owner.last_seen, len(self.peers))
            return  # (never answered)
        if peer is None:
            # field "hello": this identity has no session here (a restarted controller): join again
            await self._chan.send(m.Error(m.ErrorCode.PROTOCOL, f"{env.type} before hello", "hello", env.version),
                                  to=identity, parent_id=env.msg_id)
            return
        peer.last_seen = time.monotonic()
        self.hearing.heard(peer.last_seen, len(self.peers))
        self.timeline.mark(env.version, f"recv:{env.type}<{peer.name}")
        if crossed(self.rounds.round, env.type, env.version) and not self.rounds.arming.pending(env.version):
            log.debug("controller: %s: %s of v%s crossed its abort: dropped", peer.name, env.type, env.version)
            return
        illegal = peer.session.accept(env.type, env.version)
        if illegal is not None:
            log.warning("controller: %s: %s", peer.name, illegal.text)
            await self._send(peer, illegal)
            return
        handler = self._handlers.get(env.type)
        done = handler(peer, env) if handler is not None else None
        if done is not None:
            await done

    def _on_abusive(self, identity: bytes) -> None:
        if self._rates.abusive(identity):
            peer = self.peers.get(identity)
            log.warning("controller: disconnecting %s: over its message rate", peer.name if peer else identity)
            if peer is not None:
                self._drop(peer, "over its message rate")
            self._rates.forget(identity)

    # --- admission --------------------------------------------------------------------------------

    async def _admit(self, identity: bytes, env: Envelope) -> None:
        hello: m.Hello = env.body
        now = time.monotonic()
        displaced = self.membership.displaced(hello, now)
        if displaced is not None:
            self._drop(*displaced, replaced=True)
        code, text = self.membership.admission(hello, now)
        session = Session(hello.role, Origin.CONTROLLER)
        session.receive(m.Hello.TYPE)
        if code is not None:
            log.warning("controller: rejecting %s/%d: %s", hello.role.value, hello.rank, text)
            self.last_reject = (f"{hello.role.value}/{hello.rank}", code, text)
            body = m.Reject(code, text, PROTOCOL_VERSION[0], PROTOCOL_VERSION[1], hello.proto_major, hello.proto_minor)
            await self._chan.send(body, to=identity, parent_id=env.msg_id)
            return
        peer = self.membership.add(identity, hello, session)
        if hello.committed is not None and (self.committed is None or hello.committed > self.committed):
            # a restarted controller learns how far the workers got: no round may go back behind it
            log.info("controller: %s reports v%d committed", peer.name, hello.committed)
            self.rounds.learn_committed(hello.committed)
        listener = self._chan.streams.listener if "stream" in hello.capabilities else None
        token = secrets.token_bytes(16) if listener is not None else b""
        welcome = m.Welcome(f"{peer.name}@{self.address}", PROTOCOL_VERSION[0], PROTOCOL_VERSION[1],
                            int(self.options.heartbeat_s * 1000), int(self.options.timeout_s * 1000),
                            ("checksum", "pulse", *(("stream",) if listener else ())), self.committed,
                            listener.port if listener else None, token)
        sending = self._send(peer, welcome, parent_id=env.msg_id)
        if listener is not None:  # (from here on what goes to the session waits for its stream)
            self._chan.expect(identity, token)
        await sending
        log.info("controller: %s joined from %s (%s)", peer.name, hello.host, hello.transport.address)
        self.planning.maybe_plan()

    # --- liveness ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            seq += 1
            try:
                await self._beat(seq, time.monotonic())
            except zmq.ZMQError:
                raise
            except Exception:  # liveness must outlive one bad peer or send (as the receive loop does)
                log.exception("controller: heartbeat %d failed", seq)

    async def _beat(self, seq: int, now: float) -> None:
        """One heartbeat: drop the silent, tell every member we are here, fail pushes that can never start."""
        for peer in self.membership.silent(now, self.options.timeout_s):
            self._drop(peer, f"silent for more than {self.options.timeout_s}s")
        for peer in self.membership:
            if peer.session.allowed(Origin.CONTROLLER, m.Heartbeat.TYPE):
                await self._send(peer, m.Heartbeat(seq))
        if self.rounds.pushes:
            await self.rounds.refuse_dead_pushes(now)

    def _drop(self, peer: Peer, why: str, *, replaced: bool = False, ended: bool = False) -> None:
        """End a member's session; a round it is in aborts blaming it, or the controller where no member
        at all was heard as it went quiet, or shortly before it joined again (``Hearing``: our own
        network, most likely). ``ended``: its session stream ended, which the member's side did (a
        network's silence ends no stream), so the member is blamed whatever we heard."""
        now, members = time.monotonic(), len(self.peers)
        if ended or why.startswith("left"):
            ours = False
        elif replaced:
            ours = self.hearing.recent(now, self.options.timeout_s + self.hearing.quiet_s, members)
        else:
            ours = self.hearing.explains(peer.last_seen, now, members)
        culprit = "controller" if ours else peer.name
        if ours:
            why = f"{why} (no member was heard around then: the controller's own network, likely)"
        if not self.membership.remove(peer):
            return
        self._rates.forget(peer.identity)  # (per-session tables keep nothing of a session that is over)
        self._chan.forget(peer.identity)
        self.planning.member_left(peer)
        (log.info if why.startswith("left") else log.warning)("controller: %s dropped: %s", peer.name, why)
        self.rounds.member_left(peer, why, culprit)
        self.planning.maybe_plan()
        self.waiters.wake()  # (whoever waits on the members)

    # --- sending ----------------------------------------------------------------------------------

    def _send(self, peer: Peer, body: m.Message, *, version: Optional[int] = None,
              parent_id: Optional[int] = None, body_frame: Optional[bytes] = None) -> asyncio.Future:
        """Hand ``body`` to ``peer``'s socket now (``ControlChannel.post``, in order with every earlier
        send): the future completes once ZeroMQ took it, failing as the send failed. Callers await it,
        except where a message must leave within the handler of the one that prompted it (a one-phase
        round's commit: ``Arming.commit_senders``)."""
        peer.session.send(body.TYPE)
        sending = self._chan.post(body, to=peer.identity, version=version, parent_id=parent_id, body_frame=body_frame)
        self.timeline.mark(version, f"send:{body.TYPE}>{peer.name}")
        if peer.session.state is State.CLOSED:
            self.membership.remove(peer)
        return sending
