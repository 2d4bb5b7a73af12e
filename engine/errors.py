"""Errors of the data plane, the planner and update rounds, grouped by cause.

How this works: every class derives from ``weightsync.wire.errors.WeightSyncError``. Each names its culprit in
attributes (parameter, rank, field, peer) as well as in its message. Boundaries translate foreign
exceptions (OSError, torch errors, UCCL return codes) into these with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Iterable, Optional

from weightsync.wire.errors import WeightSyncError


class ConfigError(WeightSyncError, ValueError):
    """A bad argument or option given to weightsync by its user."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field


# --- planning -------------------------------------------------------------------------------------


class PlanError(WeightSyncError):
    """The manifests cannot be planned; raised before any byte moves."""

    def __init__(self, detail: str, *, param: Optional[str] = None, ranks: Iterable[str] = ()) -> None:
        self.param = param
        self.ranks = tuple(ranks)
        where = []
        if param is not None:
            where.append(f"parameter {param!r}")
        if self.ranks:
            shown = ", ".join(self.ranks[:8])
            more = f" and {len(self.ranks) - 8} more" if len(self.ranks) > 8 else ""
            where.append(f"ranks {shown}{more}")
        super().__init__(f"{detail} ({'; '.join(where)})" if where else detail)


class UnknownParameter(PlanError):
    """A receiver asks for a name no sender has; ``closest`` lists the nearest names."""

    def __init__(self, param: str, rank: str, closest: list[str], part_of: Optional[str] = None) -> None:
        hint = f"; closest: {', '.join(closest)}" if closest else ""
        what = f"this part of {part_of!r}" if part_of else "this parameter"
        super().__init__(f"no sender has {what}{hint}", param=param, ranks=[rank])
        self.closest = closest
        self.part_of = part_of


class Unsuppliable(PlanError):
    """A parameter exists but no sender (or combination of shards) can supply the needed slice."""


class ManifestMismatch(PlanError):
    """Sources or a source and a receiver disagree on dtype or shape."""


class BadTiling(PlanError):
    """Shards of one parameter overlap without being equal, or leave a gap that is needed."""


# --- data plane -----------------------------------------------------------------------------------


class TransportError(WeightSyncError):
    """A transport failed: connect, write, fence or registration. ``peer`` names the other end."""

    def __init__(self, detail: str, *, peer: Optional[str] = None) -> None:
        super().__init__(f"{detail} (peer {peer})" if peer else detail)
        self.peer = peer


class TransportUnavailable(TransportError):
    """A forced transport cannot run here; the message says what is missing."""


class RegistrationError(TransportError):
    """A buffer could not be registered, or a write targets memory outside a registered region."""


class ConnectionClosed(TransportError):
    """The connection was closed (by us or the peer) while operations were pending."""


class StagingError(WeightSyncError):
    """A source tensor could not be prepared (sliced, copied, transformed) for writing."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"parameter {param!r}: {detail}")
        self.param = param


# --- rounds and membership ------------------------------------------------------------------------


class JoinRejected(WeightSyncError):
    """The controller refused our hello; ``code`` is the wire RejectCode."""

    def __init__(self, code: object, text: str) -> None:
        super().__init__(f"join rejected ({getattr(code, 'name', code)}): {text}")
        self.code = code
        self.text = text


class RoundAborted(WeightSyncError):
    """An update round was aborted; receivers kept their last committed version."""

    def __init__(self, version: int, reason: object, text: str, culprit: str = "") -> None:
        who = f" culprit {culprit}" if culprit else ""
        super().__init__(f"round for version {version} aborted ({getattr(reason, 'name', reason)}){who}: {text}")
        self.version = version
        self.reason = reason
        self.text = text
        self.culprit = culprit


class ControllerLost(WeightSyncError):
    """The controller stopped answering (heartbeat timeout) or closed the session."""


class VersionError(WeightSyncError, ValueError):
    """Versions only move forward: a push or commit for a version that is not newer."""
