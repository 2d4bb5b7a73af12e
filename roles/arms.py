"""Arms: the next round's parameters, handed to the senders ahead of it, so each writes on its own push.

How this works: once a round is applied by every receiver, ``Rounds`` offers the senders an ``Arm``: the
checksum, landing slots, bases and delta mode the next round will begin with, under a fresh id
(``Arms.offer``). A sender that holds it may answer its next push with ``armed_push`` and start writing at
once, instead of waiting a control round trip for ``begin``; the round's ``begin`` then carries the same
parameters, and the sender's ``writes_done`` still waits for it. ``Arms`` remembers the offer and which
sessions wrote under it for which version (``took``). An offer holds until the next round starts
(``take``, which hands the round the arm its senders wrote under) or a plan replaces the plan it was made
for (``refusal``). Writes under an arm that no longer holds are void: their version never runs
(``Rounds.void``). A push made under an arm of a plan replaced since still runs: with the arm's
parameters where the new plan kept what it wrote (``kept``: each armed sender's table, the receivers'
sessions, their slots and bases), the usual way where its writes reached no receiver still planned
(``landed_nowhere``), and never otherwise. Offered only where every receiver lands in a second buffer (capability ``slots:2``):
early writes never touch served memory. Pure bookkeeping.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Optional

from weightsync.engine.errors import ConfigError
from weightsync.wire import SenderTable
from weightsync.wire import messages as m


@dataclasses.dataclass(frozen=True)
class Arm:
    arm_id: int
    plan_id: int
    checksum: str
    landing: tuple[m.Slot, ...]
    bases: tuple[m.Base, ...]
    delta: str
    tables: Mapping[bytes, SenderTable] = dataclasses.field(default_factory=dict, compare=False)  # by sender session
    receivers: Mapping[int, bytes] = dataclasses.field(default_factory=dict, compare=False)  # rank -> session
    senders: Mapping[int, bytes] = dataclasses.field(default_factory=dict, compare=False)  # rank -> session

    def kept(self, tables: Mapping[bytes, SenderTable], receivers: Mapping[int, bytes],
             landing: tuple[m.Slot, ...], bases: tuple[m.Base, ...],
             senders: Mapping[int, bytes] = {}) -> Optional[tuple[str, str]]:
        """Why writes under this arm by the sessions of ``tables`` are not the round the current plan would
        run, and the member to blame (None: they are): each of those senders' tables, the receivers'
        sessions, slots and bases. Tables changed by a sender that came, went or came back as a new
        session (``senders``: rank -> session now) blame it; otherwise the controller."""
        moved = _changed(self.receivers, receivers)
        if moved:
            return f"the session of receiver(s) {moved} changed", f"receiver/{moved[0]}"
        if (landing, bases) != (self.landing, self.bases):
            odd = sorted({s.rank for s in set(landing) ^ set(self.landing)} | {b.rank for b in set(bases) ^ set(self.bases)})
            return f"slots {landing} and bases {bases} differ from the arm's", f"receiver/{odd[0]}" if odd else "controller"
        changed = sorted(i for i, table in tables.items() if self.tables.get(i) != table)
        if not changed:
            return None
        came = _changed(self.senders, senders)
        return (f"{len(changed)} armed sender(s)' tables changed"
                + (f" (the session of sender(s) {came} changed)" if came else ""),
                f"sender/{came[0]}" if came else "controller")

    def landed_nowhere(self, receivers: Mapping[int, bytes]) -> bool:
        """No receiver session the arm was made for is one of ``receivers``: writes under it reached only
        processes that are gone, and a round of their version may run as if they never happened (their
        senders, whose keys changed with every receiver, stopped them at the plan: ``WeightSender._on_plan``)."""
        return not set(self.receivers.items()) & set(receivers.items())

    def message(self) -> m.Arm:
        return m.Arm(self.arm_id, self.plan_id, self.checksum, self.landing, self.bases, self.delta)


def _changed(then: Mapping[int, bytes], now: Mapping[int, bytes]) -> list[int]:
    """The ranks whose session differs between ``then`` and ``now`` (came, went or came back), in order."""
    return sorted(r for r in {*then, *now} if then.get(r) != now.get(r))


class Arms:
    def __init__(self) -> None:
        self.current: Optional[Arm] = None  # the offer an armed push may name now
        self.wrote: dict[int, tuple[Arm, set[bytes]]] = {}  # version -> the arm, the sessions writing under it
        self.offered = 0
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        current = f"arm {self.current.arm_id}" if self.current else "none"
        return f"<Arms {current} offered={self.offered} writing={sorted(self.wrote)}>"

    def offer(self, plan_id: int, checksum: str, landing: tuple[m.Slot, ...], bases: tuple[m.Base, ...],
              delta: str, tables: Mapping[bytes, SenderTable] = {}, receivers: Mapping[int, bytes] = {},
              senders: Mapping[int, bytes] = {}) -> Arm:
        self.current = Arm(next(self._ids), plan_id, checksum, landing, bases, delta, dict(tables), dict(receivers),
                           dict(senders))
        self.offered += 1
        return self.current

    def refusal(self, arm_id: int) -> Optional[str]:
        """Why an armed push naming ``arm_id`` cannot be honoured, or None. (One made for a plan replaced
        since is honoured: its round decides, ``Arm.kept`` and ``Arm.landed_nowhere``.)"""
        arm = self.current
        if arm is None or arm.arm_id != arm_id:
            return f"arm {arm_id} is not the current one ({arm.arm_id if arm else 'none'}: a round started since)"
        return None

    def took(self, version: int, session: bytes) -> None:
        """``session`` writes ``version`` under the current arm (``refusal`` said it holds)."""
        if self.current is None:
            raise ConfigError("arm", f"v{version} taken under an arm, and none is current")
        self.wrote.setdefault(version, (self.current, set()))[1].add(session)

    def take(self, version: int) -> tuple[Optional[Arm], set[bytes], list[int]]:
        """Round ``version`` starts: the arm its senders wrote under (None: nobody did), those sessions,
        and the other versions written under an arm, which can never run now. No offer holds past a
        round's start."""
        self.current = None
        arm, sessions = self.wrote.pop(version, (None, set()))
        others = sorted(self.wrote)
        return arm, sessions, others

    def void(self, version: int) -> set[bytes]:
        """Forget ``version``'s writes under an arm; returns the sessions that made them."""
        return self.wrote.pop(version, (None, set()))[1]
