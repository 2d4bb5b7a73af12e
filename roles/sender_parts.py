"""Parts of a ``WeightSender``: the handle of one push, its data connections, what it writes under an arm.

How this works: a ``PushHandle`` is what ``push`` returns: ``released`` resolves once the sender no
longer reads its tensors, awaiting the handle waits for the commit (or raises ``RoundAborted``).
``DataConnections`` is the sender's connection per receiver of its table (a dict by
receiver rank) with the (address, pair key) each was made for: ``connect`` keeps a connection while the
plan keeps both, makes one again for a restarted receiver (a new session: a new key) and closes one
the plan no longer names; ``forget_broken`` drops one whose peer failed, so the next round connects
again. ``EarlyWrites`` holds the controller's ``arm`` (``roles.arms``) until a push takes it, then the
version written under it, which its ``armed_push`` began, and its ``writes_done`` (said again at the
``begin`` a plan that kept those writes brings). ``drop`` forgets it all when a plan, an abort or an
error makes those writes moot, and stops them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping, Optional

from weightsync.engine.datapath.pipeline import PushReport
from weightsync.engine.errors import StagingError, TransportError, WeightSyncError
from weightsync.engine.transport import Connection, Transport
from weightsync.wire import PeerInfo
from weightsync.wire import messages as m

log = logging.getLogger("weightsync")


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: the user may never await a handle of a failed push


class PushHandle:
    """One push. ``sent``: the push has left, True under an arm (its writes started at once), False as a
    plain ``push`` (its writes wait for ``begin``). ``released``: sources free again. Awaiting the handle
    waits for the global commit."""

    def __init__(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        self.version = version
        self.sent: asyncio.Future[bool] = loop.create_future()
        self.released: asyncio.Future[PushReport] = loop.create_future()
        self.committed: asyncio.Future[int] = loop.create_future()
        for fut in (self.sent, self.released, self.committed):
            fut.add_done_callback(_quiet)
        self.cause: Optional[BaseException] = None  # this rank's own failure, while the verdict is awaited

    def __repr__(self) -> str:
        state = "committed" if self.committed.done() and not self.committed.exception() else (
            "failed" if self.committed.done() else "released" if self.released.done() else "pending")
        return f"<PushHandle v{self.version} {state}>"

    def __await__(self):
        return self.committed.__await__()

    def fail(self, exc: BaseException) -> None:
        for fut in (self.sent, self.released, self.committed):
            if not fut.done():
                fut.set_exception(exc)

    def release_committed(self, why: str) -> None:
        """A round may commit while its last completions drain (its handle is no longer tracked then,
        so nothing else would settle it); if the drain ends otherwise (the session lost, a connection
        failed), nothing reads the tensors any more: the push is released, with an empty report."""
        committed = self.committed
        if not self.released.done() and committed.done() and not committed.cancelled() \
                and committed.exception() is None:
            log.info("v%d committed before its writes' completions drained, then %s", self.version, why)
            self.released.set_result(PushReport({}, 0.0))

    @property
    def report(self) -> Optional[PushReport]:
        if self.released.done() and not self.released.exception():
            return self.released.result()
        return None


class DataConnections(dict):
    """receiver rank -> Connection; ``made_for``: receiver rank -> (address, pair key) it was made with."""

    def __init__(self) -> None:
        super().__init__()
        self.made_for: dict[int, tuple[str, bytes]] = {}

    async def connect(self, transport: Transport, peers: tuple[PeerInfo, ...], keys: Mapping[int, bytes]) -> None:
        """One connection per receiver of the table, proving the plan's key for the pair. A connection
        is kept while the plan keeps the receiver's address and key: a pair's key is bound to both
        processes' sessions, so a replan keeps the connections to receivers that stayed, and a restarted
        receiver (a new session: a new key) is connected to again; one the plan no longer names is closed."""
        named = {p.rank for p in peers}
        for rank in [r for r in self if r not in named]:
            await self.pop(rank).close()
            self.made_for.pop(rank, None)
        for peer in peers:
            key = keys.get(peer.rank, b"")
            if self.made_for.get(peer.rank) == (peer.transport.address, key):
                continue
            old: Optional[Connection] = self.pop(peer.rank, None)
            if old is not None:
                await old.close()
            self[peer.rank] = await transport.connect(peer, key)
            self.made_for[peer.rank] = (peer.transport.address, key)

    async def forget_broken(self, exc: Exception, name: str) -> None:
        """A data connection that failed (a partitioned or restarted peer) is closed and forgotten: the
        next round connects to that receiver again (``connect``, with its timeout)."""
        peer = getattr(exc, "peer", None) if isinstance(exc, TransportError) else None
        role, _, rank = (peer or "").partition("/")
        if role == "receiver" and rank.isdigit() and int(rank) in self:
            log.warning("%s: data connection to %s failed (%s); it is made again for the next round", name, peer, exc)
            conn = self.pop(int(rank))
            self.made_for.pop(int(rank), None)
            await conn.close()

    async def close(self) -> None:
        for conn in self.values():
            await conn.close()
        self.clear()
        self.made_for.clear()


class EarlyWrites:
    def __init__(self) -> None:
        self.arm: Optional[m.Arm] = None  # the next round's parameters, from the controller
        self.under: Optional[tuple[int, m.Arm]] = None  # (version, arm) written under it, its round not over
        self.held: Optional[m.WritesDone] = None  # its writes_done (said again at a begin a replan brings)
        self.pushes = 0  # pushes that wrote under an arm

    def __repr__(self) -> str:
        return f"<EarlyWrites arm={self.arm.arm_id if self.arm else None} writing={self.under and self.under[0]} pushes={self.pushes}>"

    def offered(self, arm: m.Arm, plan_id: Optional[int]) -> None:
        """The controller's arm (its own message, or in a commit): held where it is for our plan."""
        self.arm = arm if arm.plan_id == plan_id else None

    def take(self, plan_id: Optional[int]) -> Optional[m.Arm]:
        """The arm, for a push that may write under it now (it is for our plan, nothing is written under
        another); held for one push at most."""
        arm, self.arm = self.arm, None
        return arm if arm is not None and arm.plan_id == plan_id and self.under is None else None

    def start(self, version: int, arm: m.Arm) -> None:
        self.under = (version, arm)
        self.pushes += 1

    def writing(self, version: int) -> bool:
        """``version`` is written under an arm, and its begin has not come."""
        return self.under is not None and self.under[0] == version

    def finish(self, version: int) -> None:
        """``version``'s round is over (the arm for the next, which may have come first, stays)."""
        if self.writing(version):
            self.under, self.held = None, None

    def drop(self, task: Optional[asyncio.Future]) -> Optional[int]:
        """Forget the arm and what was written under one (stopping ``task``, its writes): the version, if any."""
        under, self.arm, self.under, self.held = self.under, None, None, None
        if under is None:
            return None
        if task is not None and not task.done():
            task.cancel()
        return under[0]


def error_code(exc: Exception) -> m.ErrorCode:
    """The error code a sender reports a failed round's exception with."""
    if isinstance(exc, StagingError):
        return m.ErrorCode.STAGING
    if isinstance(exc, (TransportError, WeightSyncError)):
        return m.ErrorCode.TRANSPORT
    return m.ErrorCode.INTERNAL
