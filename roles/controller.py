"""``Controller``: admits workers, plans routing, and runs update rounds over one ZeroMQ ROUTER.

How this works: one receive loop handles every message in order. ``hello`` goes through admission
(version, rank range, duplicate rank, manifest consistency; a ``reject`` otherwise); identity comes
from the hello, never from arrival order. Once the configured senders and receivers have joined, the
planner runs (in a worker thread) and each worker gets its table; a membership change later (a worker
lost, left or rejoined) triggers a re-plan between rounds. When every planned sender has pushed v, a
round task runs begin -> writes_done -> fence -> commit -> commit_ack, or sends ``abort`` on any failure
(a participant's error, a failed verification, a lost peer, a deadline). A heartbeat loop keeps peers
alive and drops silent ones. Round reports are kept for ``status`` and ``wait_round``. Planning lives
in ``weightsync.roles.planning`` (``Planner``), rounds in ``weightsync.roles.rounds`` (``RoundRunner``): both are mixins of
this class, over its sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Optional

import zmq

from weightsync.engine.aio import AsyncResource, Spinner
from weightsync.engine.errors import ConfigError, PlanError, RoundAborted
from weightsync.engine.logs import Repeats
from weightsync.engine.plan import Catalog, LinkModel, Mapping, Participant, PlanCache, PlanOptions, RoutingPlan, get_mapping
from weightsync.wire import PROTOCOL_VERSION, DEFAULT_LIMITS, Envelope, Limits, Origin, Role, Session, State
from weightsync.wire import messages as m
from weightsync.wire.auth import Replayed, Unauthenticated
from weightsync.wire.errors import FieldError, ProtocolError, VersionMismatch

from .admission import admission_problem, participants
from .channel import ControlChannel, check_auth_key
from .limits import JoinLimiter, PeerLimits, RateLimiter
from .planning import MessageCache, Planner
from .pushes import PushBook
from .rounds import RoundReport, RoundRunner, RoundState
from .status import controller_status
from .timeline import Timeline

log = logging.getLogger("weightsync")


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
    heartbeat_s: float = 0.5
    timeout_s: float = 5.0
    checksum: str = ""  # "crc32": senders checksum every transfer, receivers verify after the fence
    round_timeout_s: Optional[float] = None
    link: LinkModel = LinkModel()
    plan: PlanOptions = PlanOptions()
    limits: Limits = DEFAULT_LIMITS
    keep_reports: int = 100
    auth_key: Optional[bytes] = None  # HMAC key: only holders can join or command (wire.auth)
    peer_limits: PeerLimits = PeerLimits()
    mapping: "str | Mapping" = "identity"  # receiver names from sender names (engine.plan.mapping.MAPPINGS)
    one_phase_commit: bool = True  # a round with one receiver: fence and commit in one exchange
    spin: bool = False  # poll the event loop while a round runs (aio.Spinner): lower latency, one busy core

    def __post_init__(self) -> None:
        check_auth_key(self.auth_key)
        get_mapping(self.mapping)  # an unknown name is a ConfigError now, not at the first plan


@dataclasses.dataclass
class Peer:
    identity: bytes
    hello: m.Hello
    session: Session
    last_seen: float
    slot: int = 0  # the receiver's landing buffer this round (shadow receivers alternate 1, 0, 1, ...)

    @property
    def key(self) -> tuple[Role, int]:
        return (self.hello.role, self.hello.rank)

    @property
    def name(self) -> str:
        return f"{self.hello.role.value}/{self.hello.rank}"


class Controller(Planner, RoundRunner, AsyncResource):
    def __init__(self, bind_addr: str = "tcp://127.0.0.1:0", *, senders: int, receivers: int,
                 options: ControllerOptions = ControllerOptions(),
                 on_round: Optional[Callable[[RoundReport], Any]] = None) -> None:
        if senders < 1 or receivers < 0:
            raise ConfigError("senders", f"need at least one sender, got senders={senders} receivers={receivers}")
        self.bind_addr = bind_addr
        self.expected = {Role.SENDER: senders, Role.RECEIVER: receivers}
        self.options = options
        self.on_round = on_round
        self.address = ""
        self.peers: dict[bytes, Peer] = {}
        self.by_rank: dict[tuple[Role, int], bytes] = {}
        self.catalog = Catalog(options.mapping)  # what the joined members hold: a join is checked against it
        self.plan_cache = PlanCache()  # what the last plan resolved (the planning thread's own; one plan at a time)
        self.plan: Optional[RoutingPlan] = None
        self.plan_error: Optional[PlanError] = None
        self.plan_error_final = False  # the error holds with every configured member joined: pushes fail with it
        # the plan's members by session: its messages, rounds and keys go to these sessions, no others
        self.plan_sessions: dict[tuple[Role, int], bytes] = {}
        self.planned_once = False
        self.reports: list[RoundReport] = []
        self.committed: Optional[int] = None  # the newest version a receiver said it applied
        self.commit_sent = -1  # the newest version the controller told to commit (never reused)
        self.round: Optional[RoundState] = None
        self._plan_ids = 0
        self._messages = MessageCache()  # the data-plane keys' secret, and what the last plan's messages made
        self._acks_pending: set[tuple[Role, int]] = set()
        # senders' plans (each with its body frame) held back until the receivers have acknowledged theirs
        self._sender_plans: dict[bytes, tuple[m.Plan, bytes]] = {}
        self._planning: Optional[asyncio.Task] = None
        self._round_task: Optional[asyncio.Task] = None
        self.pushes = PushBook()  # pending pushes, by the session that made them
        self._ready = asyncio.Event()
        self._round_waiters: dict[int, asyncio.Future] = {}
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []
        self._tasks: list[asyncio.Task] = []
        self._chan: Optional[ControlChannel] = None
        self.timeline = Timeline()  # per version: when each round message was sent / received
        self.spinner = Spinner(options.spin)

    @property
    def plan_members(self) -> frozenset[tuple[Role, int]]:
        return frozenset(self.plan_sessions)

    def __repr__(self) -> str:
        return (f"<Controller {self.address} peers={len(self.peers)} plan={self.plan.plan_id if self.plan else None} "
                f"committed=v{self.committed} rounds={len(self.reports)} {self.round!r}>")

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._chan = ControlChannel(zmq.ROUTER, "controller", limits=self.options.limits,
                                    auth_key=self.options.auth_key)
        self._rates = RateLimiter(self.options.peer_limits)
        self._joins = JoinLimiter(self.options.peer_limits)
        self.dropped = 0
        self._drops = Repeats(log)  # (a flood of bad messages logs a line per peer and window, with a count)
        self._chan.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.address = self._chan.bind(self.bind_addr)
        except zmq.ZMQError as exc:
            self._chan.close()
            raise ConfigError("bind_addr", f"cannot bind {self.bind_addr}: {exc}") from exc
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._heartbeat_loop())]

    async def _teardown(self) -> None:
        self.spinner.cancel()
        if self.round is not None:
            self.round.abort(m.AbortReason.SHUTDOWN, "controller shutting down")
        for task in [*self._tasks, self._round_task, self._planning]:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*[t for t in [*self._tasks, self._round_task, self._planning] if t],
                             return_exceptions=True)
        for peer in list(self.peers.values()):
            if peer.session.allowed(Origin.CONTROLLER, m.Leave.TYPE):
                try:
                    await self._send(peer, m.Leave("controller shutting down"))
                except zmq.ZMQError:
                    pass
        for fut in self._round_waiters.values():
            if not fut.done():
                fut.set_exception(RoundAborted(-1, m.AbortReason.SHUTDOWN, "controller closed"))
        if self._chan is not None:
            self._chan.close()

    # --- public API -------------------------------------------------------------------------------

    async def wait_ready(self) -> RoutingPlan:
        """Wait until a plan has been computed and acknowledged by every worker in it."""
        await self._ready.wait()
        return self.plan

    async def wait_plan(self, after: int = 0) -> RoutingPlan:
        """Wait for an acknowledged plan newer than ``after`` (a re-plan after a membership change)."""
        await self._wait(lambda: self._ready.is_set() and self.plan is not None and self.plan.plan_id > after)
        return self.plan

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        if predicate():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, fut))
        try:
            await fut
        finally:
            self._waiters = [(p, f) for p, f in self._waiters if f is not fut]

    def _wake(self) -> None:
        for predicate, fut in self._waiters:
            if not fut.done() and predicate():
                fut.set_result(None)

    async def wait_round(self, version: int) -> RoundReport:
        """Wait for the round of ``version``; returns its report or raises ``RoundAborted``."""
        for report in self.reports:
            if report.version == version:
                return self._report_or_raise(report)
        fut = self._round_waiters.setdefault(version, asyncio.get_running_loop().create_future())
        return await asyncio.shield(fut)

    def update(self, version: int) -> None:
        """Start a round for ``version`` without waiting for pushes (the daemon's and CLI's way)."""
        self._check_version(version)
        self._start_round(version)

    def status(self) -> dict:
        return controller_status(self)

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
            except VersionMismatch as exc:
                await self._reject_version(exc)
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
            await self._command(identity, env)
            return
        peer = self.peers.get(identity)
        if isinstance(body, m.Hello) and peer is None:
            await self._admit(identity, env)
            return
        if peer is None:
            # field "hello": this identity has no session here (a restarted controller): join again
            await self._chan.send(m.Error(m.ErrorCode.PROTOCOL, f"{env.type} before hello", "hello", env.version),
                                  to=identity, parent_id=env.msg_id)
            return
        peer.last_seen = time.monotonic()
        self.timeline.mark(env.version, f"recv:{env.type}<{peer.name}")
        illegal = peer.session.accept(env.type, env.version)
        if illegal is not None:
            log.warning("controller: %s: %s", peer.name, illegal.text)
            await self._send(peer, illegal)
            return
        handler = getattr(self, f"_on_{env.type}", None)
        if handler is not None:
            await handler(peer, env)

    def _on_abusive(self, identity: bytes) -> None:
        if self._rates.abusive(identity):
            peer = self.peers.get(identity)
            log.warning("controller: disconnecting %s: over its message rate", peer.name if peer else identity)
            if peer is not None:
                self._drop(peer, "over its message rate")
            self._rates.forget(identity)

    async def _reject_version(self, exc: VersionMismatch) -> None:
        peer_id = getattr(exc, "peer", None)
        if peer_id is None:
            return
        body = m.Reject(m.RejectCode.VERSION_MISMATCH, str(exc), PROTOCOL_VERSION[0], PROTOCOL_VERSION[1],
                        exc.theirs[0], exc.theirs[1])
        await self._chan.send(body, to=peer_id, parent_id=exc.header.msg_id)

    # --- admission --------------------------------------------------------------------------------

    async def _admit(self, identity: bytes, env: Envelope) -> None:
        hello: m.Hello = env.body
        held = self.peers.get(self.by_rank.get((hello.role, hello.rank), b""))
        if held is not None and hello.incarnation and held.hello.incarnation == hello.incarnation:
            # the same worker joining on a new channel: its old session is abandoned, not a rival
            self._drop(held, "replaced by a new session of the same process")
        elif held is not None and time.monotonic() - held.last_seen > self._silent_s:
            # a restarted process (its key proven by the channel) takes over a session silent for several
            # heartbeats: the old process is gone, and waiting for its timeout would lock a restart storm out
            self._drop(held, f"replaced by a new session: silent for {time.monotonic() - held.last_seen:.2f}s")
        code, text = self._admission_problem(hello)
        session = Session(hello.role, Origin.CONTROLLER)
        session.receive(m.Hello.TYPE)
        if code is not None:
            log.warning("controller: rejecting %s/%d: %s", hello.role.value, hello.rank, text)
            body = m.Reject(code, text, PROTOCOL_VERSION[0], PROTOCOL_VERSION[1], hello.proto_major, hello.proto_minor)
            await self._chan.send(body, to=identity, parent_id=env.msg_id)
            return
        slot = (1 if hello.landing is None else hello.landing) if "slots:2" in hello.capabilities else 0
        peer = Peer(identity, hello, session, time.monotonic(), slot=slot)
        self.peers[identity] = peer
        self.by_rank[peer.key] = identity
        if hello.committed is not None and (self.committed is None or hello.committed > self.committed):
            # a restarted controller learns how far the workers got: no round may go back behind it
            log.info("controller: %s reports v%d committed", peer.name, hello.committed)
            self._learn_committed(hello.committed)
        welcome = m.Welcome(f"{peer.name}@{self.address}", PROTOCOL_VERSION[0], PROTOCOL_VERSION[1],
                            int(self.options.heartbeat_s * 1000), int(self.options.timeout_s * 1000), ("checksum",),
                            self.committed)
        await self._send(peer, welcome, parent_id=env.msg_id)
        log.info("controller: %s joined from %s (%s)", peer.name, hello.host, hello.transport.address)
        self._maybe_plan()

    @property
    def _silent_s(self) -> float:
        """A session unheard for this long may be replaced by a new one of its rank."""
        return min(3 * self.options.heartbeat_s, self.options.timeout_s)

    def _admission_problem(self, hello: m.Hello) -> tuple[Optional[m.RejectCode], str]:
        if (hello.role, hello.rank) in self.by_rank:  # (cheap, and retried: never charged to the host's joins)
            return m.RejectCode.DUPLICATE_RANK, f"{hello.role.value}/{hello.rank} is already joined (and alive)"
        if not self._joins.allow(hello.host, time.monotonic()):
            return m.RejectCode.LIMIT_EXCEEDED, f"too many joins from host {hello.host!r} in the last minute"
        self._sync_catalog()
        return admission_problem(hello, self.expected, self.by_rank, self.catalog)

    def _sync_catalog(self) -> None:
        """The catalog holds exactly the joined members (those gone since are released)."""
        members: dict[Role, dict] = {Role.SENDER: {}, Role.RECEIVER: {}}
        for p in self.peers.values():
            members[p.hello.role][p.hello.rank] = p.hello.manifest
        self.catalog.sync(members[Role.SENDER], members[Role.RECEIVER])

    def _participants(self) -> tuple[list[Participant], list[Participant]]:
        return participants(p.hello for p in self.peers.values())

    # --- rounds -----------------------------------------------------------------------------------

    def _learn_committed(self, version: int) -> None:
        """``version`` is applied by a receiver: it is the committed version from now on (never lower)."""
        if self.committed is None or version > self.committed:
            self.committed = version
            self._wake()

    def _check_version(self, version: int) -> None:
        floor = max([v for v in (self.committed, self.commit_sent, self.round.version if self.round else None)
                     if v is not None], default=-1)
        if version <= floor:
            raise ConfigError("version", f"version {version} is not newer than {floor}: versions only move forward")

    async def _on_push(self, peer: Peer, env: Envelope) -> None:
        version = env.body.version
        try:
            self._check_version(version)
        except ConfigError as exc:
            await self._send(peer, m.Error(m.ErrorCode.BAD_REQUEST, str(exc), "version", version), version=version)
            return
        if self.plan_error is not None and self.plan_error_final and self.plan_sessions.get(peer.key) == peer.identity:
            await self._send(peer, m.Error(m.ErrorCode.PLAN, str(self.plan_error), self.plan_error.param or "", version),
                             version=version)  # no plan can be made for these members: the push never starts
            return
        self.pushes.add(peer.identity, version, time.monotonic())
        self._wake()
        await self._refuse_dead_pushes()
        self._maybe_start_rounds()

    def _planned_senders(self) -> set[bytes]:
        """The sessions of the current plan's senders: a push counts only from the session that made it,
        and a planned session that is gone never pushes (its plan is replaced first)."""
        return {i for (role, _), i in self.plan_sessions.items() if role is Role.SENDER}

    def _maybe_start_rounds(self) -> None:
        if self._round_task is not None or not self._ready.is_set() or self.plan is None or not self._plan_live():
            return
        while (version := self.pushes.complete(self._planned_senders())) is not None:
            self.pushes.forget(version)
            if self.committed is None or version > self.committed:  # (a restarted controller may have
                self._start_round(version)                          #  learned more since the push)
                return

    async def _refuse_dead_pushes(self, now: Optional[float] = None) -> None:
        """Fail each pending push that can never start a round (``PushBook.dead``) with a typed error."""
        dead = list(self.pushes.dead(self._planned_senders(), lambda i: self.peers[i].name, self.committed,
                                     now, self.options.round_timeout_s))
        for version, why in dead:
            log.warning("controller: %s", why)
            for identity in self.pushes.forget(version):
                if identity in self.peers:
                    await self._send(self.peers[identity], m.Error(m.ErrorCode.BAD_REQUEST, why, "version", version),
                                     version=version)

    async def _on_error(self, peer: Peer, env: Envelope) -> None:
        log.warning("controller: %s reports %s: %s", peer.name, env.body.code.name, env.body.text)
        rnd = self._round_of(env.body.version)
        if rnd is not None and self._in_plan(peer):
            rnd.abort(m.AbortReason.PEER_ERROR, f"{peer.name}: {env.body.text}", self._culprit(peer, env.body))

    def _culprit(self, peer: Peer, error: m.Error) -> str:
        """Who failed: a data-plane error names the planned peer whose end failed (``field``:
        "receiver/3" when the connection to it broke or it refused our writes); otherwise the reporter."""
        role, _, rank = error.field.partition("/")
        if error.code == m.ErrorCode.TRANSPORT and role in ("sender", "receiver") and rank.isdigit() and (Role(role), int(rank)) in self.plan_sessions:
            return error.field
        return peer.name

    async def _on_leave(self, peer: Peer, env: Envelope) -> None:
        self._drop(peer, f"left: {env.body.reason}")

    # --- liveness ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            seq += 1
            now = time.monotonic()
            for peer in list(self.peers.values()):
                if now - peer.last_seen > self.options.timeout_s:
                    self._drop(peer, f"silent for more than {self.options.timeout_s}s")
                elif peer.session.allowed(Origin.CONTROLLER, m.Heartbeat.TYPE):
                    await self._send(peer, m.Heartbeat(seq))
            if self.pushes:
                await self._refuse_dead_pushes(now)

    def _drop(self, peer: Peer, why: str) -> None:
        if self.peers.pop(peer.identity, None) is None:
            return
        self.by_rank.pop(peer.key, None)
        self._rates.forget(peer.identity)  # (per-session tables keep nothing of a session that is over)
        self._chan.forget(peer.identity)
        self.pushes.forget_session(peer.identity)  # a departed session's pending pushes go with it
        if peer.key in self._acks_pending:  # the plan can never be complete: void it, plan again
            self._acks_pending.clear()
            self._sender_plans.clear()
        (log.info if why.startswith("left") else log.warning)("controller: %s dropped: %s", peer.name, why)
        rnd = self.round
        if rnd is not None and self._in_plan(peer):
            if not rnd.abort(m.AbortReason.PEER_LOST, f"{peer.name} {why}", peer.name):
                rnd.drop(peer.hello.role, peer.hello.rank)
        self._maybe_plan()

    # --- sending ----------------------------------------------------------------------------------

    async def _send(self, peer: Peer, body: m.Message, *, version: Optional[int] = None,
                    parent_id: Optional[int] = None, body_frame: Optional[bytes] = None) -> None:
        peer.session.send(body.TYPE)
        await self._chan.send(body, to=peer.identity, version=version, parent_id=parent_id, body_frame=body_frame)
        self.timeline.mark(version, f"send:{body.TYPE}>{peer.name}")
        if peer.session.state is State.CLOSED:
            self.peers.pop(peer.identity, None)
            self.by_rank.pop(peer.key, None)

    async def _command(self, identity: bytes, env: Envelope) -> None:
        cmd, args = env.body.command, env.body.args if isinstance(env.body.args, dict) else {}
        try:
            if cmd == "status":
                result = self.status()
            elif cmd == "update":
                self.update(int(args.get("version", -1)))
                result = {"started": args.get("version")}
            else:
                raise ConfigError("command", f"unknown command {cmd!r} (controller knows: status, update)")
        except (ConfigError, ValueError, TypeError) as exc:
            await self._chan.send(m.CommandReply(False, None, str(exc)), to=identity, parent_id=env.msg_id)
            return
        await self._chan.send(m.CommandReply(True, result, ""), to=identity, parent_id=env.msg_id)
