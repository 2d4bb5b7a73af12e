"""Per-peer limits for the controller: message rate (token bucket) and joins per host.

How this works: ``RateLimiter.allow(peer)`` refills a peer's bucket at ``rate`` tokens a second up
to ``burst`` and spends one per message; a refused message counts a strike, and a peer with
``max_strikes`` strikes is reported as abusive so its owner can disconnect it (other peers are not
affected). ``JoinLimiter`` caps hellos per host per sliding minute. Pure bookkeeping; time is passed in.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class PeerLimits:
    messages_per_s: float = 5000.0
    burst: int = 10000
    max_strikes: int = 1000
    joins_per_minute: int = 60


class RateLimiter:
    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self.buckets: dict[bytes, tuple[float, float]] = {}  # peer -> (tokens, last time)
        self.strikes: collections.Counter = collections.Counter()

    def allow(self, peer: bytes, now: float) -> bool:
        tokens, last = self.buckets.get(peer, (float(self.limits.burst), now))
        tokens = min(self.limits.burst, tokens + (now - last) * self.limits.messages_per_s)
        if tokens < 1:
            self.buckets[peer] = (tokens, now)
            self.strikes[peer] += 1
            return False
        self.buckets[peer] = (tokens - 1, now)
        return True

    def abusive(self, peer: bytes) -> bool:
        return self.strikes[peer] >= self.limits.max_strikes

    def forget(self, peer: bytes) -> None:
        self.buckets.pop(peer, None)
        self.strikes.pop(peer, None)


class JoinLimiter:
    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self.joins: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def allow(self, host: str, now: float) -> bool:
        recent = self.joins[host]
        while recent and now - recent[0] > 60.0:
            recent.popleft()
        if len(recent) >= self.limits.joins_per_minute:
            return False
        recent.append(now)
        return True
