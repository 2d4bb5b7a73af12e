"""The controller's members: who is joined, as which session, and whether a newcomer may join.

How this works: a ``Peer`` is one worker's session (its ZeroMQ routing id, its ``hello``, the session
state machine, when it was last heard, a shadow receiver's landing slot). ``Membership`` holds the
peers by routing id and by (role, rank), and the ``Catalog`` of what the joined members hold (a join
is checked against it; the planner reads its index). ``admission`` decides a ``hello`` in the
protocol's order (docs/PROTOCOL.md, Join): a rank held by a live session is a ``DUPLICATE_RANK``
(cheap, retried by the worker, never charged to the host's joins), then the host's joins per minute,
then the rank range and the manifest (``admission.admission_problem``). ``displaced`` names the
session a newcomer replaces: one of the same worker object (its ``incarnation``), or one silent for
``silent_s`` (a restarted process: the old one is gone). ``Hearing`` says when a member's silence is
more likely the controller's own (no member heard at all). Pure bookkeeping; time is passed in.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Mapping, Optional

from weightsync.engine.plan import Catalog, Participant
from weightsync.wire import Role, Session
from weightsync.wire import messages as m

from .admission import admission_problem, participants
from .limits import JoinLimiter, PeerLimits


class Hearing:
    """When the controller last heard any member, and its newest deaf spell: ``quiet_s`` or more in which
    no member was heard while two or more were joined. A member that went quiet just as such a spell
    began is not to blame for its silence (nor for joining again after it): the controller's own
    network most likely is."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self.last: Optional[float] = None  # the newest message from any member
        self.spell: Optional[tuple[float, float]] = None  # (last heard before it, first heard after)

    def __repr__(self) -> str:
        return f"<Hearing quiet_s={self.quiet_s} last={self.last} spell={self.spell}>"

    def heard(self, now: float, members: int) -> None:
        if self.last is not None and members >= 2 and now - self.last >= self.quiet_s:
            self.spell = (self.last, now)
        self.last = now

    def _spells(self, now: float, members: int) -> list[tuple[float, float]]:
        """The newest ended spell, and the one going on at ``now`` (ending now), if any."""
        spells = [self.spell] if self.spell is not None else []
        if self.last is not None and members >= 2 and now - self.last >= self.quiet_s:
            spells.append((self.last, now))
        return spells

    def explains(self, last_seen: float, now: float, members: int) -> bool:
        """Whether a deaf spell (ended, or still going at ``now``) began within ``quiet_s`` after a member
        was last heard at ``last_seen``."""
        return any(0 <= start - last_seen <= self.quiet_s and end > last_seen
                   for start, end in self._spells(now, members))

    def recent(self, now: float, within: float, members: int) -> bool:
        """Whether a deaf spell ended (or still goes on) within ``within`` seconds before ``now``: a
        member that joins again as a new session meanwhile most likely lost us to our own network (its
        old session's delayed messages, delivered after the heal, say nothing of when it went quiet)."""
        return any(now - end <= within for _, end in self._spells(now, members))


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


class Membership:
    def __init__(self, expected: Mapping[Role, int], mapping, limits: PeerLimits, silent_s: float) -> None:
        self.expected = dict(expected)
        self.peers: dict[bytes, Peer] = {}
        self.by_rank: dict[tuple[Role, int], bytes] = {}
        self.catalog = Catalog(mapping)  # what the joined members hold: a join is checked against it
        self.joins = JoinLimiter(limits)
        self.silent_s = silent_s

    def __repr__(self) -> str:
        counts = self.counts()
        return (f"<Membership senders={counts[Role.SENDER]}/{self.expected[Role.SENDER]} "
                f"receivers={counts[Role.RECEIVER]}/{self.expected[Role.RECEIVER]}>")

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self.peers.values()))

    def get(self, identity: bytes) -> Optional[Peer]:
        return self.peers.get(identity)

    def sessions(self) -> dict[tuple[Role, int], bytes]:
        """(role, rank) -> the routing id of its session, for every joined member."""
        return {p.key: p.identity for p in self.peers.values()}

    def counts(self) -> dict[Role, int]:
        return {role: sum(1 for p in self.peers.values() if p.hello.role is role) for role in Role}

    def complete(self) -> bool:
        """Every configured member is joined."""
        counts = self.counts()
        return all(counts[r] >= self.expected[r] for r in Role)

    def displaced(self, hello: m.Hello, now: float) -> Optional[tuple[Peer, str]]:
        """The session ``hello`` replaces, and why: the same worker on a new channel, or a session of its
        rank silent for ``silent_s`` (its process is gone; the newcomer proved the key by joining)."""
        held = self.peers.get(self.by_rank.get((hello.role, hello.rank), b""))
        if held is None:
            return None
        if hello.incarnation and held.hello.incarnation == hello.incarnation:
            return held, "replaced by a new session of the same process"
        if now - held.last_seen > self.silent_s:
            return held, f"replaced by a new session: silent for {now - held.last_seen:.2f}s"
        return None

    def admission(self, hello: m.Hello, now: float) -> tuple[Optional[m.RejectCode], str]:
        """Admit ``hello`` (recorded in the catalog) or say why not."""
        if (hello.role, hello.rank) in self.by_rank:
            return m.RejectCode.DUPLICATE_RANK, f"{hello.role.value}/{hello.rank} is already joined (and alive)"
        if not self.joins.allow(hello.host, now):
            return m.RejectCode.LIMIT_EXCEEDED, f"too many joins from host {hello.host!r} in the last minute"
        self.sync_catalog()
        return admission_problem(hello, self.expected, self.by_rank, self.catalog)

    def add(self, identity: bytes, hello: m.Hello, session: Session) -> Peer:
        slot = (1 if hello.landing is None else hello.landing) if "slots:2" in hello.capabilities else 0
        peer = self.peers[identity] = Peer(identity, hello, session, time.monotonic(), slot=slot)
        self.by_rank[peer.key] = identity
        return peer

    def remove(self, peer: Peer) -> bool:
        """Forget ``peer``'s session; False if it was gone already."""
        if self.peers.pop(peer.identity, None) is None:
            return False
        if self.by_rank.get(peer.key) == peer.identity:
            del self.by_rank[peer.key]
        return True

    def silent(self, now: float, timeout_s: float) -> list[Peer]:
        return [p for p in self.peers.values() if now - p.last_seen > timeout_s]

    def participants(self) -> tuple[list[Participant], list[Participant]]:
        return participants(p.hello for p in self.peers.values())

    def sync_catalog(self) -> None:
        """The catalog holds exactly the joined members (those gone since are released)."""
        members: dict[Role, dict] = {Role.SENDER: {}, Role.RECEIVER: {}}
        for p in self.peers.values():
            members[p.hello.role][p.hello.rank] = p.hello.manifest
        self.catalog.sync(members[Role.SENDER], members[Role.RECEIVER])
