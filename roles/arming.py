"""Arming: the controller's part that offers the senders arms and decides what writes under them are.

How this works: ``Rounds`` owns one ``Arming``. Once every receiver applied a round, ``offer`` sends each
sender that can take one an ``arm`` (``roles.arms``: the next round's parameters), where every receiver
lands in a second buffer and none waits for a ``before_update`` hook. When a round starts, ``begin_with``
sets what its ``begin`` names: the arm's parameters where its senders wrote under one that still holds
(the plan may have been replaced by one that kept what they wrote), the usual ones where those writes
reached no receiver still planned, and otherwise marks the round ``broken`` (it aborts). An armed
sender whose plan held gets no ``begin``: its ``armed_push`` stood for it, and a ``writes_done`` (or an
``error``) it sent before the round started is kept for it (``before_round``). ``void`` makes a
version written under an arm that will not run never run: the sessions that pushed it hear why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

from weightsync.engine.errors import RoundAborted
from weightsync.wire import Origin, Role, State
from weightsync.wire import messages as m

from .arms import Arms
from .membership import Peer
from .planning import Planning
from .pushes import PushBook
from .round_inputs import RoundInputs
from .round_state import RoundState

if TYPE_CHECKING:
    from .controller_options import ControllerOptions

log = logging.getLogger("weightsync")


class Arming:
    def __init__(self, planning: Planning, inputs: RoundInputs, pushes: PushBook, options: "ControllerOptions",
                 send: Callable[..., Awaitable[None]], wake: Callable[[], None]) -> None:
        self.planning, self.inputs, self.pushes, self.options = planning, inputs, pushes, options
        self.send, self.wake = send, wake
        self.arms = Arms()
        self.voided = -1  # the newest version written under an arm that did not hold (never run)
        self.done: dict[int, dict[int, m.WritesDone]] = {}  # version -> sender rank -> writes_done before its round
        self.failed: dict[int, tuple] = {}  # version -> (reason, text, culprit): a sender's writes under its arm
        #                                     failed before its round
        self.driven = False  # rounds are started by ``Controller.update``, not pushes: no arms

    def __repr__(self) -> str:
        return f"<Arming {self.arms!r} voided=v{self.voided}>"

    # --- what the plan holds now --------------------------------------------------------------------

    def devices(self) -> set[str]:
        return {peer.hello.device for key in self.planning.sessions if (peer := self.planning.peer_of(key))}

    def landing(self, receivers: set[int]) -> tuple[m.Slot, ...]:
        return tuple(m.Slot(r, peer.slot) for r in sorted(receivers)
                     if (peer := self.planning.peer_of((Role.RECEIVER, r))) is not None)

    def tables(self, sessions: set[bytes]) -> dict:
        """The current plan's table of each sender session in ``sessions`` (None: not one of its senders)."""
        plan, by_session = self.planning.plan, {i: key for key, i in self.planning.sessions.items()}
        return {i: plan.senders.get(by_session[i][1]) if i in by_session and plan is not None else None
                for i in sessions}

    def sessions(self, role: Role) -> dict[int, bytes]:
        """The planned members of ``role``: rank -> session."""
        return {r: i for (of, r), i in self.planning.sessions.items() if of is role}

    # --- arms ---------------------------------------------------------------------------------------

    async def offer(self, rnd: RoundState, committing: bool = False) -> Optional[tuple[m.Arm, set[bytes]]]:
        """Every receiver applied ``rnd``: offer the senders the next round's parameters. ``committing``
        (their ``commit`` goes next): a sender that offered capability ``commit_arm`` gets the arm in its
        commit, and the returned (arm, sessions) says to whom; the others get an ``arm`` now."""
        made = self._arm(rnd, committing)
        if made is None:
            return None
        message, riding, apart = made
        for peer in apart:
            if peer.session.allowed(Origin.CONTROLLER, m.Arm.TYPE):
                await self.send(peer, message, version=rnd.version)
        return message, riding

    def _arm(self, rnd: RoundState, committing: bool) -> Optional[tuple[m.Arm, set[bytes], list[Peer]]]:
        """``offer``'s arm, made current: (its message, the sessions it rides with in their commit, the
        senders it goes to as a message of its own); None where no arm is offered."""
        plan = self.planning.plan
        if (not self.options.arm_pushes or self.driven or rnd.applied < rnd.receivers or plan is None or plan.plan_id != rnd.plan_id
                or not self.planning.ready.is_set() or not self.planning.live() or self.pushes):
            return None  # (a push already waiting begins the usual way)
        peers = [(key, peer) for key in sorted(self.planning.sessions) if (peer := self.planning.peer_of(key))]
        if any(key[0] is Role.RECEIVER and ("slots:2" not in peer.hello.capabilities
                                            or "begin_ack" in peer.hello.capabilities) for key, peer in peers):
            return None
        armed = [peer for key, peer in peers if key[0] is Role.SENDER and "arm" in peer.hello.capabilities]
        if not armed:
            return None
        arm = self.arms.offer(plan.plan_id, self.inputs.checksum(self.devices(), peek=True),
                              self.landing(rnd.receivers), self.inputs.bases_for(rnd.receivers), self.inputs.delta(),
                              self.tables({peer.identity for peer in armed}), self.sessions(Role.RECEIVER),
                              self.sessions(Role.SENDER))
        riding = {peer.identity for peer in armed if committing and "commit_arm" in peer.hello.capabilities}
        return arm.message(), riding, [peer for peer in armed if peer.identity not in riding]

    def commit_senders(self, rnd: RoundState) -> None:
        """A one-phase round's lone receiver applied ``rnd`` (its ``commit_ack``, being handled): send the
        senders their ``commit`` now, rather than a loop turn later from the round's task (``rnd.stage``
        says which did), with the next round's arm inside where the sender offered ``commit_arm``, else
        as an ``arm`` of its own handed to the socket just before (sends to a peer leave in order)."""
        rnd.stage = "committing"
        arm, riding, apart = self._arm(rnd, committing=True) or (None, set(), [])
        for peer in apart:
            if peer.session.allowed(Origin.CONTROLLER, m.Arm.TYPE):
                self._posted(self.send(peer, arm, version=rnd.version), "arm", rnd.version, peer)
        for key in sorted(self.planning.sessions):
            if key[0] is Role.SENDER and (peer := self.planning.peer_of(key)) is not None:
                commit = m.Commit(rnd.version, arm if peer.identity in riding else None)
                self._posted(self.send(peer, commit, version=rnd.version), "commit", rnd.version, peer)

    @staticmethod
    def _posted(sending: asyncio.Future, what: str, version: int, peer: Peer) -> None:
        """A message handed to the socket without awaiting it: a failure is logged, not lost."""
        sending.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.warning(
            "controller: %s of v%d to %s not sent: %s", what, version, peer.name, f.exception()))

    def begin_with(self, rnd: RoundState, devices: set[str]) -> None:
        """What round ``rnd`` (just made) begins with: its checksum, slots, bases and delta mode, and
        whether writes made under an arm are part of it (``rnd.arm``) or make it fail (``rnd.broken``)."""
        plan = self.planning.plan
        arm, armed_by, rnd.void = self.arms.take(rnd.version)
        rnd.checksum, rnd.landing = self.inputs.checksum(devices), self.landing(rnd.receivers)
        rnd.bases, rnd.delta = self.inputs.bases_for(rnd.receivers), self.inputs.delta()
        if arm is not None and (arm.plan_id, arm.landing) != (plan.plan_id, rnd.landing):  # (a plan made since)
            receivers = self.sessions(Role.RECEIVER)
            kept = arm.kept(self.tables(armed_by), receivers, rnd.landing, rnd.bases, self.sessions(Role.SENDER))
            rnd.broken = None if kept is None else (m.AbortReason.MEMBERSHIP_CHANGED, f"senders wrote v{rnd.version} under "
                                                    f"arm {arm.arm_id} of plan {arm.plan_id}, which plan {plan.plan_id} "
                                                    f"did not keep: {kept[0]}", kept[1])
            if rnd.broken is not None and arm.landed_nowhere(receivers):
                arm, armed_by, rnd.broken = None, set(), None  # (its senders write again from their begin)
        done, failed = self.done.pop(rnd.version, {}), self.failed.pop(rnd.version, None)
        if arm is not None:
            rnd.checksum, rnd.landing, rnd.bases, rnd.delta = arm.checksum, arm.landing, arm.bases, arm.delta
            rnd.broken = rnd.broken or failed
            if arm.plan_id == plan.plan_id:  # (its senders are writing already: no begin goes to them)
                for rank, body in done.items():
                    rnd.on_writes_done(rank, body)
        rnd.arm, rnd.armed_by = arm, armed_by

    def pending(self, version: Optional[int]) -> bool:
        """``version`` was pushed under an arm, and its round has not started."""
        return version is not None and version in self.arms.wrote

    def before_round(self, peer: Peer, body: "m.WritesDone | m.Error") -> None:
        """An armed sender's writes_done, or its error, before the round of its version started: kept
        for that round (an error fails it, unless its writes turn out to have reached no one planned)."""
        if isinstance(body, m.WritesDone):
            self.done.setdefault(body.version, {})[peer.hello.rank] = body
        else:
            culprit = body.field if body.code == m.ErrorCode.TRANSPORT and body.field.startswith("receiver/") else peer.name
            self.failed.setdefault(body.version, (m.AbortReason.PEER_ERROR, f"{peer.name}: {body.text}", culprit))

    async def before_begin(self, rnd: RoundState) -> None:
        """Other versions written under an arm never run now; a ``broken`` round aborts."""
        for version in rnd.void:
            await self.void(version, f"v{version} was written under an arm, and v{rnd.version} started first")
        if rnd.broken is not None:
            raise RoundAborted(rnd.version, *rnd.broken)

    async def void(self, version: int, why: str, peer: Optional[Peer] = None, field: str = "arm") -> None:
        """Writes were made under an arm for ``version``, which will not run: it never runs (its late
        writes land under a round that is over at every receiver: the next ``begin`` closes it), the
        next round is checked end to end, and every session that pushed it hears why: ``error`` with
        ``field`` (``arm``: its push fails with ``RoundAborted``; ``version``, a push that can never start:
        ``VersionError``), then ``abort`` where its session is writing under the arm."""
        log.warning("controller: %s", why)
        self.voided = max(self.voided, version)
        self.inputs.after_abort = True
        sessions = self.pushes.forget(version) | self.arms.void(version) | ({peer.identity} if peer else set())
        self.done.pop(version, None)
        self.failed.pop(version, None)
        for identity in sorted(sessions):
            member = self.planning.members.get(identity)
            if member is not None and member.session.allowed(Origin.CONTROLLER, m.Error.TYPE):
                await self.send(member, m.Error(m.ErrorCode.BAD_REQUEST, why, field, version), version=version)
            if member is not None and member.session.state in (State.WRITING, State.WRITTEN):  # (writing under it)
                await self.send(member, m.Abort(version, m.AbortReason.CANCELLED, why, "controller"), version=version)
        self.wake()
