"""``ControllerOptions``: how a controller runs (timing, checks, commits, deltas, arming, session streams),
checked whole when made: a bad value is a ``ConfigError`` naming its field."""

from __future__ import annotations

import dataclasses
from typing import Optional

from weightsync.engine.datapath.checksums import validate as validate_checksum
from weightsync.engine.datapath.deltas import DELTA_MODES
from weightsync.engine.errors import ConfigError
from weightsync.engine.plan import LinkModel, Mapping, PlanOptions, get_mapping
from weightsync.wire import DEFAULT_LIMITS, Limits

from .channel import CONTROL_DSCP, check_auth_key, check_dscp
from .limits import PeerLimits


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
    spin: Optional[bool] = None  # poll the event loop while a round runs (aio.Spinner): one busy core while a
    #                              round is open, its hops seen sooner; None: where a member's tensors are on a GPU
    control_dscp: int = CONTROL_DSCP  # the control channel's packets' DSCP (0: unmarked)
    delta: str = "auto"  # changed bytes only: "auto" (where the link pays for it), "always" or "off" (docs/DELTAS.md)
    full_check_every: int = 8  # with ``checksum`` off: every row of every Nth round (and of the first, and of
    #                            the one after an abort) checked end to end with ``full_check``; 0: never
    arm_pushes: bool = True  # once a round is applied, offer the senders the next one's parameters: each then
    #                          writes on its own push, which stands for its begin (roles.arms)
    full_check: str = "auto"  # the algorithm of those rounds (engine.datapath.checksums); "auto": fp64 (on the
    #                           device) where a member's tensors are on a GPU, crc32 (zlib, fastest on a CPU) otherwise
    session_streams: bool = True  # after welcome, a session's messages on a TCP stream of its own where the worker
    #                               offers it (roles.channel_stream): no ZeroMQ I/O threads on a round's hops
    stream_port: int = 0  # the streams' port, on the host ``bind_addr`` names (0: one the system picks)

    def __post_init__(self) -> None:
        check_auth_key(self.auth_key)
        validate_checksum(self.checksum)
        if self.full_check != "auto":
            validate_checksum(self.full_check)
        if self.full_check_every < 0 or (self.full_check_every and not self.full_check):
            raise ConfigError("full_check_every", f"must be >= 0 with an algorithm in full_check, got "
                                                  f"{self.full_check_every} and {self.full_check!r}")
        if self.delta not in DELTA_MODES:
            raise ConfigError("delta", f"must be one of {DELTA_MODES}, got {self.delta!r}")
        check_dscp("control_dscp", self.control_dscp)
        if not isinstance(self.stream_port, int) or not 0 <= self.stream_port < 65536:
            raise ConfigError("stream_port", f"a TCP port in 0..65535 (0: any free one), got {self.stream_port!r}")
        get_mapping(self.mapping)  # an unknown name is a ConfigError now, not at the first plan
