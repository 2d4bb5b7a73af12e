"""Planning, as the controller does it: when to plan, the plan itself, and handing tables out in order.

How this works: ``Planning`` is the controller's part that owns the plan. ``maybe_plan`` decides
whether the membership calls for a (re-)plan (never during a round, never before the previous plan is
acknowledged; the first plan waits for every configured worker); ``_plan`` runs the pure planner in a
worker thread for the sessions joined at that moment, on the senders' index the ``Catalog`` kept as
they joined (lent: the catalog copies what a join or a leave changes meanwhile), which also makes the
plan's data-plane keys (one per sender/receiver pair it routes, bound to both members' sessions: a
pair of the same two processes keeps its key, and its connection, from plan to plan) and encodes every
member's message (``plan_messages``, off the event loop). A plan holds its members by session
(``sessions``); one whose members changed while it was made is void and made again. It sends each
receiver its table; senders get theirs (``_send_sender_plans``) only once every receiver has
acknowledged, so no sender connects before its receiver accepts the key. ``on_plan_ack`` marks the
plan ready when every worker has acknowledged it (``on_ready``). A plan a member refused but that is
not final (a sender that could not reach its receiver, say, in a partition that heals with the
membership unchanged) is made again for the same members ``options.timeout_s`` later
(``_plan_again_later``): no membership change may ever come to replan it.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, NamedTuple, Optional

from weightsync.engine import dataauth
from weightsync.engine.errors import PlanError
from weightsync.engine.plan import PlanCache, RoutingPlan, plan
from weightsync.engine.plan.planner import collector_paused
from weightsync.wire import DEFAULT_LIMITS, Limits, PeerInfo, ReceiverTable, Role, SenderTable, State
from weightsync.wire.errors import InvalidMessage
from weightsync.wire import messages as m
from weightsync.wire.splice import PartsEncoder

from .membership import Membership, Peer

if TYPE_CHECKING:
    from .controller_options import ControllerOptions

log = logging.getLogger("weightsync")

Send = Callable[..., Awaitable[None]]  # (peer, body, *, version=None, body_frame=None)


class Planning:
    def __init__(self, members: Membership, options: "ControllerOptions", send: Send, *,
                 busy: Callable[[], bool], committed: Callable[[], Optional[int]],
                 on_ready: Callable[[], None], on_final_error: Callable[[PlanError], None]) -> None:
        self.members = members
        self.options = options
        self.send = send
        self.busy, self.committed = busy, committed  # (a round is running; the committed version)
        self.on_ready, self.on_final_error = on_ready, on_final_error
        self.plan: Optional[RoutingPlan] = None
        self.error: Optional[PlanError] = None
        self.error_final = False  # the error holds with every configured member joined: pushes fail with it
        self.sessions: dict[tuple[Role, int], bytes] = {}  # the plan's members by session
        self.participants: tuple[list, list] = ([], [])  # the plan's senders and receivers, as it planned them
        self.planned_once = False
        self.ready = asyncio.Event()  # the plan is acknowledged by every member
        self.cache = PlanCache()  # what the last plan resolved (the planning thread's own; one plan at a time)
        self.messages = MessageCache()  # the data-plane keys' secret, and what the last plan's messages made
        self.task: Optional[asyncio.Task] = None
        self._ids = 0
        self._again = False  # plan again though the members are the plan's (a member refused it)
        self._retry: Optional[asyncio.TimerHandle] = None
        self._acks_pending: set[tuple[Role, int]] = set()
        # senders' plans (each with its body frame) held back until the receivers have acknowledged theirs
        self._sender_plans: dict[bytes, tuple[m.Plan, bytes]] = {}

    def __repr__(self) -> str:
        return (f"<Planning plan={self.plan.plan_id if self.plan else None} ready={self.ready.is_set()} "
                f"acks_pending={len(self._acks_pending)} error={self.error is not None}>")

    # --- the plan's sessions ------------------------------------------------------------------------

    def peer_of(self, key: tuple[Role, int]) -> Optional[Peer]:
        """The live session the current plan named for ``key``, or None (it left or was replaced)."""
        identity = self.sessions.get(key)
        return None if identity is None else self.members.get(identity)

    def live(self) -> bool:
        """Every session of the plan is still joined."""
        return bool(self.sessions) and all(self.members.get(i) is not None for i in self.sessions.values())

    def holds(self, peer: Peer) -> bool:
        return self.sessions.get(peer.key) == peer.identity

    def sender_sessions(self) -> set[bytes]:
        """The plan's sender sessions: a push counts only from these (a gone one never pushes)."""
        return {i for (role, _), i in self.sessions.items() if role is Role.SENDER}

    # --- when to plan, and the plan -----------------------------------------------------------------

    def maybe_plan(self) -> None:
        if self.task is not None or self.busy() or self._acks_pending:
            return
        if any(p.session.state is State.PLAN_RECEIVED for p in self.members):
            return  # a plan may only follow an acknowledged one; the ack will call us again
        members = self.members.sessions()
        if members == self.sessions and not self._again and (self.plan is not None or self.error is not None):
            return
        counts = self.members.counts()
        if not self.planned_once and not self.members.complete():
            return  # the first plan waits for everyone configured
        if counts[Role.SENDER] == 0 or counts[Role.RECEIVER] == 0:
            if self.plan is not None or self.error is not None:
                log.info("controller: waiting for members to plan with (%d senders, %d receivers joined)",
                         counts[Role.SENDER], counts[Role.RECEIVER])
            self.plan, self.error, self.sessions = None, None, members
            self.ready.clear()
            return  # nothing to plan: wait for members
        self.ready.clear()
        self._again = False
        self.task = asyncio.ensure_future(self._plan())

    async def _plan(self) -> None:
        """Plan for the members joined now, held by session: the plan goes to exactly these sessions,
        and one that changed while the plan was made (a member left, or came back as a new session)
        makes it void: it is planned again, never installed with a session it was not made for."""
        members = self.members.sessions()  # (the sessions the plan and its keys bind)
        senders, receivers = self.members.participants()
        self.members.sync_catalog()
        index = self.members.catalog.lend()  # (the thread reads; the catalog copies what changes meanwhile)
        self._ids += 1
        plan_id = self._ids
        try:
            routing, bodies = await asyncio.to_thread(self.plan_and_encode, senders, receivers, plan_id, members,
                                                      index)
        except PlanError as exc:
            self.task = None
            await self._failed(exc, members)
            return
        self.task = None
        if self.members.sessions() != members:
            log.info("controller: plan %d is void: the members changed while it was made; planning again", plan_id)
            self.maybe_plan()
            return
        self.participants = (senders, receivers)
        await self._install(routing, bodies, members)
        log.info("controller: plan %d: %d transfers, %.3f GB", plan_id, routing.transfer_count, routing.nbytes / 1e9)

    async def _failed(self, exc: PlanError, members: Mapping[tuple[Role, int], bytes]) -> None:
        if self.members.sessions() != members:
            self.maybe_plan()
            return
        self.plan, self.error, self.sessions = None, exc, dict(members)
        self.error_final = self.members.complete()
        if not self.error_final:  # a member still to (re)join may hold what is missing
            log.warning("controller: cannot plan until more members join: %s", exc)
            return
        log.error("controller: cannot plan: %s", exc)
        for peer in self.members:  # every configured member is here: the pushes can never start
            await self.send(peer, m.Error(m.ErrorCode.PLAN, str(exc), exc.param or "", None))
        self.on_final_error(exc)

    async def _install(self, routing: RoutingPlan, bodies: dict, members: dict[tuple[Role, int], bytes]) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self.plan, self.error, self.planned_once, self.sessions = routing, None, True, members
        self._acks_pending = set(members)
        self._sender_plans = {}
        for key, identity in sorted(members.items()):
            peer, (body, frame) = self.members.get(identity), bodies[key]
            if peer.hello.role is Role.SENDER:
                self._sender_plans[identity] = (body, frame)
            else:
                await self.send(peer, body, body_frame=frame)
        await self._send_sender_plans()

    def plan_and_encode(self, senders, receivers, plan_id: int, identities, index) -> tuple[RoutingPlan, dict]:
        """In the planning thread: the routing tables (from the catalog's lent ``index``), then every
        member's message (``plan_messages``), its keys bound to the members' sessions (``identities``)."""
        o = self.options
        routing = plan(senders, receivers, o.link, o.plan, {}, plan_id, o.mapping, self.cache, index)
        return routing, plan_messages(routing, o.limits, sessions=identities, cache=self.messages,
                                      committed=self.committed())

    async def _send_sender_plans(self) -> None:
        """Senders get their tables (and connect) only once every receiver has acknowledged its own:
        by then each receiver's transport accepts exactly the keys of this plan."""
        if any(role is Role.RECEIVER for role, _ in self._acks_pending):
            return
        plans, self._sender_plans = self._sender_plans, {}
        for identity, (body, frame) in plans.items():
            peer = self.members.get(identity)
            if peer is not None:
                await self.send(peer, body, body_frame=frame)

    async def on_plan_ack(self, peer: Peer, ack: m.PlanAck) -> None:
        if self.plan is not None and ack.plan_id == self.plan.plan_id and peer.key in self._acks_pending \
                and self.holds(peer):
            self._acks_pending.discard(peer.key)
            if ack.landing is not None and "slots:2" in peer.hello.capabilities:
                peer.slot = ack.landing  # (it may have applied a prepared version since its hello)
            if not ack.ok:
                log.warning("controller: %s could not take plan %d (planned again): %s", peer.name, ack.plan_id,
                            ack.text)  # (a member gone meanwhile, most often: churn, not a fault of ours)
                self.error = PlanError(f"{peer.name} refused the plan: {ack.text}", ranks=[peer.name])
                self.error_final = False  # (a peer it could not reach, say: planned again, below)
                self._plan_again_later()
            await self._send_sender_plans()
            if not self._acks_pending and self.error is None:
                self.ready.set()
                self.on_ready()
        self.maybe_plan()

    def member_left(self, peer: Peer) -> None:
        """A member's session is over: a plan it has not acknowledged can never be complete (void it)."""
        if peer.key in self._acks_pending and self.holds(peer):
            self._acks_pending.clear()
            self._sender_plans.clear()

    def _plan_again_later(self) -> None:
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(self.options.timeout_s, self._plan_again)

    def _plan_again(self) -> None:
        """A refused plan's time is up: plan again, for the same members if they have not changed (the
        plan waits, as any, for acknowledgements still due and for a running round)."""
        self._retry = None
        if self.error is not None and not self.error_final:
            log.info("controller: planning again after a refused plan")
            self._again = True
            self.maybe_plan()

    def cancel(self) -> Optional[asyncio.Task]:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        return self.task


class MessageCache:
    """What a controller keeps from one plan's messages to the next (one planning thread uses it): each
    sender's data-plane keys, by both members' sessions, and the encodings of the tables, peers and
    key lists (``wire.splice.PartsEncoder``). Each plan keeps only what it used, so a replan that keeps
    most tables (a restarted receiver back on its host: ``patched_plan``) makes and encodes only the
    keys and tables that changed."""

    def __init__(self, secret: Optional[bytes] = None) -> None:
        self.secret = secret or dataauth.new_secret()
        self.parts = PartsEncoder(split=(m.Plan, SenderTable, ReceiverTable), shared=(PeerInfo,))
        self.senders: dict[int, _SenderKeys] = {}
        self.receivers: dict[int, tuple[m.DataKey, ...]] = {}

    def __repr__(self) -> str:
        return f"<MessageCache senders={len(self.senders)} receivers={len(self.receivers)} parts={self.parts!r}>"


class _SenderKeys(NamedTuple):
    """One sender's keys: its session, its receivers and theirs (the pairs), its side and theirs."""

    session: bytes
    peers: tuple[int, ...]
    sessions: tuple[bytes, ...]
    mine: tuple[m.DataKey, ...]
    theirs: list[m.DataKey]

    def remake(self, secret: bytes, rank: int, session: bytes, peers: tuple, sessions: tuple) -> "_SenderKeys":
        """These keys for the pairs given: the same if they are, each pair's kept if it stayed."""
        if (session, peers, sessions) == (self.session, self.peers, self.sessions):
            return self
        kept = dict(zip(zip(self.peers, self.sessions), zip(self.mine, self.theirs))) if session == self.session else {}
        pairs = list(zip(peers, sessions))
        new = [pair for pair in pairs if pair not in kept]
        for pair, key in zip(new, dataauth.pair_keys(secret, rank, session, new)):
            kept[pair] = (m.DataKey(pair[0], key), m.DataKey(rank, key))
        keys = [kept[pair] for pair in pairs]
        return _SenderKeys(session, peers, sessions, tuple([k[0] for k in keys]), [k[1] for k in keys])


_NO_KEYS = _SenderKeys(b"", (), (), (), [])


def plan_messages(routing: RoutingPlan, limits: Limits = DEFAULT_LIMITS, secret: Optional[bytes] = None,
                  sessions: Mapping[tuple[Role, int], bytes] = {},
                  cache: Optional[MessageCache] = None,
                  committed: Optional[int] = None) -> dict[tuple[Role, int], tuple[m.Plan, bytes]]:
    """Every member's ``Plan`` message and its body frame, encoded (in the planning thread, off the
    event loop: at 1,000 ranks that is seconds), with the plan's data-plane keys: one per
    sender/receiver pair it routes, from ``secret`` (the controller's; a fresh one if None) and both
    members' ``sessions`` (their control sessions' identities: ``dataauth.pair_key``). ``cache``: the
    previous plan's keys and encodings (its secret is the one used). The collector is paused, as in
    ``plan``: each collection it would set off walks every manifest object. Raises ``PlanError``
    naming the member whose message the control channel's limits refuse."""
    if cache is None:
        cache = MessageCache(secret)
    elif secret is not None and secret != cache.secret:
        raise ValueError("plan_messages: the cache holds keys of another secret")
    return collector_paused(_plan_messages, routing, limits, cache, sessions, committed)


def _plan_messages(routing: RoutingPlan, limits: Limits, cache: MessageCache,
                   sessions: Mapping[tuple[Role, int], bytes],
                   committed: Optional[int] = None) -> dict[tuple[Role, int], tuple[m.Plan, bytes]]:
    bodies: dict[tuple[Role, int], m.Plan] = {}
    keys_of: dict[int, list[m.DataKey]] = {r: [] for r in routing.receivers}  # receiver -> its senders' keys
    theirs = {r: sessions.get((Role.RECEIVER, r), b"") for r in routing.receivers}
    senders = {}
    for rank, table in sorted(routing.senders.items()):
        peers = tuple([p.rank for p in table.peers])
        keys = senders[rank] = cache.senders.get(rank, _NO_KEYS).remake(
            cache.secret, rank, sessions.get((Role.SENDER, rank), b""), peers, tuple([theirs.get(r, b"") for r in peers]))
        for r, key in zip(peers, keys.theirs):
            keys_of[r].append(key)
        bodies[(Role.SENDER, rank)] = m.Plan(routing.plan_id, table, None, keys.mine, committed)
    receivers = {}
    for rank, rtable in routing.receivers.items():  # (a receiver's senders are exactly those whose peers name it)
        keys, last = tuple(keys_of[rank]), cache.receivers.get(rank, ())
        receivers[rank] = keys = last if len(last) == len(keys) and all(map(operator.is_, keys, last)) else keys
        bodies[(Role.RECEIVER, rank)] = m.Plan(routing.plan_id, None, rtable, keys, committed)
    cache.senders, cache.receivers = senders, receivers
    out = {}
    for (role, rank), body in bodies.items():
        try:
            out[(role, rank)] = (body, cache.parts.encode_body(body, limits))
        except InvalidMessage as exc:  # (a table larger than the control channel's frame limit)
            raise PlanError(f"the plan for {role.value}/{rank} cannot be sent: {exc}",
                            ranks=[f"{role.value}/{rank}"]) from exc
    cache.parts.retain()
    return out
