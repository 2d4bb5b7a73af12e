"""What each round starts from: the receivers' bases for delta rounds, and how much the round checks.

How this works: ``RoundInputs`` is the part of the controller's ``Rounds`` that remembers, across
rounds, what the next one needs besides the plan. ``bases``: per receiver session, the committed version
its deltas apply to (what it serves), learned from its ``commit_ack`` and forgotten when it takes part in a round it
does not apply (an abort, a missing acknowledgement) or leaves (docs/DELTAS.md). ``checksum``: the
round's end-to-end check: ``ControllerOptions.checksum`` when set, else ``full_check`` once every
``full_check_every`` rounds (the first included) and on the round after an abort ("auto": fp64,
computed on the device, where a member's tensors are on a GPU; crc32 otherwise). A two-slot receiver
lands alternate rounds in alternate slots, so with an even period every other check comes one round
later (rounds 0, 9, 16, 25, ... for 8): both slots take turns being checked. Pure bookkeeping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from weightsync.wire import Role
from weightsync.wire import messages as m

from .membership import Peer

if TYPE_CHECKING:
    from .controller import ControllerOptions
    from .round_state import RoundState


class RoundInputs:
    def __init__(self, options: "ControllerOptions", peer_of: Callable[[tuple[Role, int]], Optional[Peer]]) -> None:
        self.options = options
        self.peer_of = peer_of
        self.bases: dict[bytes, int] = {}  # receiver session -> the committed version its deltas apply to
        self.started = 0  # rounds started
        self.after_abort = False

    def __repr__(self) -> str:
        return f"<RoundInputs bases={len(self.bases)} started={self.started}>"

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
        return "" if self.options.delta == "off" else self.options.delta

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
