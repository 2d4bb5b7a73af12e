"""Planning, as the controller does it: when to plan, the plan itself, and handing tables out in order.

How this works: ``Planner`` is a mixin of ``Controller``. ``_maybe_plan`` decides whether the
membership calls for a (re-)plan (never during a round, never before the previous plan is
acknowledged; the first plan waits for every configured worker); ``_plan`` runs the pure planner in a
worker thread, on the senders' index the controller's ``Catalog`` kept as they joined (lent: the
catalog copies what a join or a leave changes meanwhile), which also makes the plan's data-plane
keys (one per sender/receiver pair it routes, bound to both members' sessions: a pair of the same
two processes keeps its key, and its connection, from plan to plan) and encodes every member's
message (``plan_messages``, off the event loop); it sends each receiver its table; senders get
theirs (``_send_sender_plans``) only once every receiver has acknowledged, so no sender connects
before its receiver accepts the key. ``_on_plan_ack`` marks the plan ready when every worker has
acknowledged it, and starts rounds that were waiting.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from typing import TYPE_CHECKING, Mapping, NamedTuple, Optional

from weightsync.engine import dataauth
from weightsync.engine.errors import PlanError
from weightsync.engine.plan import RoutingPlan, plan
from weightsync.engine.plan.planner import collector_paused
from weightsync.wire import DEFAULT_LIMITS, Envelope, Limits, PeerInfo, ReceiverTable, Role, SenderTable, State
from weightsync.wire.errors import InvalidMessage
from weightsync.wire import messages as m
from weightsync.wire.splice import PartsEncoder

from .admission import participants

if TYPE_CHECKING:
    from .controller import Peer

log = logging.getLogger("weightsync")


class Planner:
    """Mixin of ``Controller``: plans over the controller's sessions."""

    def _maybe_plan(self) -> None:
        if self._planning is not None or self._round_task is not None or self._acks_pending:
            return
        if any(p.session.state is State.PLAN_RECEIVED for p in self.peers.values()):
            return  # a plan may only follow an acknowledged one; the ack will call us again
        members = {p.key: p.identity for p in self.peers.values()}
        if members == self.plan_sessions and (self.plan is not None or self.plan_error is not None):
            return
        counts = {role: sum(1 for r, _ in members if r is role) for role in Role}
        if not self.planned_once and any(counts[r] < self.expected[r] for r in Role):
            return  # the first plan waits for everyone configured
        if counts[Role.SENDER] == 0 or counts[Role.RECEIVER] == 0:
            if self.plan is not None or self.plan_error is not None:
                log.info("controller: waiting for members to plan with (%d senders, %d receivers joined)",
                         counts[Role.SENDER], counts[Role.RECEIVER])
            self.plan, self.plan_error, self.plan_sessions = None, None, members
            self._ready.clear()
            return  # nothing to plan: wait for members
        self._ready.clear()
        self._planning = asyncio.ensure_future(self._plan())

    async def _plan(self) -> None:
        """Plan for the members joined now, held by session: the plan goes to exactly these sessions,
        and one that changed while the plan was made (a member left, or came back as a new session)
        makes it void: it is planned again, never installed with a session it was not made for."""
        peers = list(self.peers.values())
        members = {p.key: p.identity for p in peers}  # (the sessions the plan and its keys bind)
        senders, receivers = participants(p.hello for p in peers)
        self._sync_catalog()
        index = self.catalog.lend()  # (the senders' index kept as they joined: the thread reads, the catalog copies)
        self._plan_ids += 1
        plan_id = self._plan_ids
        try:
            routing, bodies = await asyncio.to_thread(self._plan_and_encode, senders, receivers, plan_id, members,
                                                      index)
        except PlanError as exc:
            self._planning = None
            if self._members_changed(members):
                self._maybe_plan()
                return
            self.plan, self.plan_error, self.plan_sessions = None, exc, members
            self.plan_error_final = self._members_complete()
            if not self.plan_error_final:  # a member still to (re)join may hold what is missing
                log.warning("controller: cannot plan until more members join: %s", exc)
                return
            log.error("controller: cannot plan: %s", exc)
            for peer in list(self.peers.values()):  # every configured member is here: the pushes can never start
                await self._send(peer, m.Error(m.ErrorCode.PLAN, str(exc), exc.param or "", None))
            for version in sorted(self.pushes.pushes):
                self.pushes.forget(version)
            self._wake()
            return
        if self._members_changed(members):
            log.info("controller: plan %d is void: the members changed while it was made; planning again", plan_id)
            self._planning = None
            self._maybe_plan()
            return
        self.plan, self.plan_error, self.planned_once = routing, None, True
        self.plan_sessions = members
        self._acks_pending = set()
        self._sender_plans = {}
        for key, identity in sorted(members.items()):
            peer = self.peers[identity]
            prepared = bodies[key]
            self._acks_pending.add(key)
            if peer.hello.role is Role.SENDER:
                self._sender_plans[identity] = prepared
            else:
                await self._send(peer, prepared[0], body_frame=prepared[1])
        await self._send_sender_plans()
        self._planning = None
        log.info("controller: plan %d: %d transfers, %.3f GB", plan_id, routing.transfer_count, routing.nbytes / 1e9)

    def _members_complete(self) -> bool:
        """Every configured member is joined: a planning error then is final (no join can fix it)."""
        counts = {role: sum(1 for p in self.peers.values() if p.hello.role is role) for role in Role}
        return all(counts[r] >= self.expected[r] for r in Role)

    def _members_changed(self, members: Mapping[tuple[Role, int], bytes]) -> bool:
        """Whether the sessions joined now differ from ``members`` (one left, joined or rejoined)."""
        return {p.key: p.identity for p in self.peers.values()} != dict(members)

    def _plan_and_encode(self, senders, receivers, plan_id: int, identities, index) -> tuple[RoutingPlan, dict]:
        """In the planning thread: the routing tables (from the catalog's lent ``index``), then every
        member's message (``plan_messages``), its keys bound to the members' sessions (``identities``)."""
        routing = plan(senders, receivers, self.options.link, self.options.plan, {}, plan_id, self.options.mapping,
                       self.plan_cache, index)
        return routing, plan_messages(routing, self.options.limits, sessions=identities, cache=self._messages,
                                      committed=self.committed)

    async def _send_sender_plans(self) -> None:
        """Senders get their tables (and connect) only once every receiver has acknowledged its own:
        by then each receiver's transport accepts exactly the keys of this plan."""
        if any(role is Role.RECEIVER for role, _ in self._acks_pending):
            return
        plans, self._sender_plans = self._sender_plans, {}
        for identity, (body, frame) in plans.items():
            if identity in self.peers:
                await self._send(self.peers[identity], body, body_frame=frame)

    async def _on_plan_ack(self, peer: "Peer", env: Envelope) -> None:
        current = self.plan is not None and env.body.plan_id == self.plan.plan_id and peer.key in self._acks_pending
        if current:
            self._acks_pending.discard(peer.key)
            if env.body.landing is not None and "slots:2" in peer.hello.capabilities:
                peer.slot = env.body.landing  # (it may have applied a prepared version since its hello)
            if not env.body.ok:
                log.error("controller: %s could not take plan %d: %s", peer.name, env.body.plan_id, env.body.text)
                self.plan_error = PlanError(f"{peer.name} refused the plan: {env.body.text}", ranks=[peer.name])
                self.plan_error_final = False  # (a peer it could not reach, say: the next membership change replans)
            await self._send_sender_plans()
            if not self._acks_pending and self.plan_error is None:
                self._ready.set()
                self._wake()
                self._maybe_start_rounds()
        self._maybe_plan()


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
