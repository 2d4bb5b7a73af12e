"""What each round starts from: the receivers' bases for delta rounds, and how much the round checks.

How this works: ``RoundInputs`` is the part of the controller's ``Rounds`` that remembers, across
rounds, what the next one needs besides the plan. ``bases``: per receiver session, the committed version
its deltas apply to (what it serves), learned from its ``commit_ack`` and forgotten when it takes part in a round it
does not apply (an abort, a missing acknowledgement) or leaves (docs/DELTAS.md). ``checksum``: the
round's end-to-end check: ``ControllerOptions.checksum`` when set, else ``full_check`` once every
``full_check_every`` rounds (the first included) and on the round after an abort ("auto": fp64,
computed on the device, where a member's tensors are on a GPU; crc32 otherwise). A two-slot receiver
lands alternate rounds in alternate slots, so with an even period every other check comes one round
later (rounds 0, 9, 16, 25, ... for 8): both slots take turns being checked. ``delta``: the round's
delta mode; under ``"auto"`` each sender decides per lane from its own rates (``engine.datapath.deltas``),
but only the whole round shows what a receiver's apply costs, so a round that went mostly as deltas and
took longer than the quickest of the last whole rounds turns deltas off for ``AUTO_OFF`` rounds, twice
as long after each try that is slower again (up to ``AUTO_OFF_MAX``). Pure bookkeeping.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Optional

from weightsync.wire import Role
from weightsync.wire import messages as m

from .membership import Peer

if TYPE_CHECKING:
    from .controller_options import ControllerOptions
    from .round_state import RoundReport, RoundState

AUTO_OFF = 16  # "auto": rounds with deltas off after a delta round slower than a whole one
AUTO_OFF_MAX = 1024  # (doubling after each try that is slower again, up to this)
WHOLE_KEPT = 4  # whole rounds whose quickest a delta round is judged against


class RoundInputs:
    def __init__(self, options: "ControllerOptions", peer_of: Callable[[tuple[Role, int]], Optional[Peer]]) -> None:
        self.options = options
        self.peer_of = peer_of
        self.bases: dict[bytes, int] = {}  # receiver session -> the committed version its deltas apply to
        self.started = 0  # rounds started
        self.after_abort = False
        self.whole_s: collections.deque = collections.deque(maxlen=WHOLE_KEPT)  # the last whole rounds' seconds
        self.whole_plan = 0  # ... of this plan
        self.auto_off = 0  # "auto": rounds left with deltas off
        self.auto_wait = AUTO_OFF  # how many the next slower delta round turns them off for

    def __repr__(self) -> str:
        return f"<RoundInputs bases={len(self.bases)} started={self.started} auto_off={self.auto_off}>"

    def checksum(self, devices: set[str], *, peek: bool = False) -> str:
        """The next round's checksum algorithm ("": none beyond each delta's fingerprint change), for
        members whose tensors are on ``devices``; ``peek``: say it without counting a round started (an arm)."""
        every = self.options.full_check_every
        if every:
            visit, at = divmod(self.started, every)
            full = at == (visit % 2 if every % 2 == 0 else 0) or self.after_abort
        else:
            full = False
        if not peek:
            self.started += 1
            self.after_abort = False
        algo = self.options.full_check
        if algo == "auto":
            algo = "fp64" if any(d.startswith("cuda") for d in devices) else "crc32"
        return self.options.checksum or (algo if full else "")

    def delta(self) -> str:
        """The next round's delta mode ("": none; "auto" may be off for a while: ``judge``)."""
        if self.options.delta == "off" or (self.options.delta == "auto" and self.auto_off):
            return ""
        return self.options.delta

    def judge(self, report: "RoundReport") -> None:
        """"auto": a committed round's time. A whole round (no deltas) is kept; a round that went mostly as
        deltas (under half its whole bytes) and took longer than the quickest kept whole round of its plan
        turns deltas off for ``auto_wait`` rounds and doubles that wait; one that did not restores it."""
        if self.options.delta != "auto" or not report.ok:
            return
        if report.plan_id != self.whole_plan:  # (another plan moves other bytes: its whole rounds anew)
            self.whole_s.clear()
            self.whole_plan = report.plan_id
        self.auto_off = max(0, self.auto_off - 1)
        if not report.delta_rows:
            self.whole_s.append(report.seconds)
        elif 2 * report.nbytes < report.whole_bytes and self.whole_s:
            if report.seconds > min(self.whole_s):
                self.auto_off, self.auto_wait = self.auto_wait, min(2 * self.auto_wait, AUTO_OFF_MAX)
            else:
                self.auto_wait = AUTO_OFF

    def bases_for(self, receivers: set[int]) -> tuple[m.Base, ...]:
        """The receivers a delta may go to, with the version each holds: those that take deltas and whose
        session applied the last round it took part in."""
        if self.options.delta == "off":
            return ()
        out = []
        for r in sorted(receivers):
            peer = self.peer_of((Role.RECEIVER, r))
            held = self.bases.get(peer.identity) if peer is not None and "delta" in peer.hello.capabilities else None
            if held is not None:
                out.append(m.Base(r, held))
        return tuple(out)

    def applied(self, peer: Peer, version: int) -> None:
        self.bases[peer.identity] = version

    def finished(self, rnd: "RoundState", ok: bool) -> None:
        """A round is over: whatever landed at a receiver that did not apply it, no committed version is
        known to be all of that receiver's landing memory."""
        self.after_abort = self.after_abort or not ok
        for r in rnd.receivers - rnd.applied:
            peer = self.peer_of((Role.RECEIVER, r))
            if peer is not None:
                self.bases.pop(peer.identity, None)

    def forget(self, peer: Peer) -> None:
        self.bases.pop(peer.identity, None)
