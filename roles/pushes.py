"""The controller's pending pushes: which session pushed which version, and which can never start.

How this works: a push belongs to the session (routing identity) that sent it, never to a rank, so a
departed or restarted sender's pending pushes go with it (``forget_session``). ``complete`` names the
oldest version every planned sender session has pushed. ``dead`` names the pushes that can never start
a round, with why: a version some planned sender has passed (versions only move forward, so it will
never push it), one at or below the committed version, or one that waited longer than the round
timeout. Pure bookkeeping; time and names are passed in.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional


class PushBook:
    def __init__(self) -> None:
        self.pushes: dict[int, set[bytes]] = {}  # version -> the sessions that pushed it
        self.since: dict[int, float] = {}  # version -> when its first push arrived
        self.newest: dict[bytes, int] = {}  # session -> the newest version it pushed

    def __bool__(self) -> bool:
        return bool(self.pushes)

    def add(self, session: bytes, version: int, now: float) -> None:
        self.pushes.setdefault(version, set()).add(session)
        self.since.setdefault(version, now)
        self.newest[session] = max(version, self.newest.get(session, -1))

    def forget(self, version: int) -> set[bytes]:
        """Drop version's pushes; returns the sessions that had pushed it."""
        self.since.pop(version, None)
        return self.pushes.pop(version, set())

    def forget_session(self, session: bytes) -> None:
        self.newest.pop(session, None)
        for pushed in self.pushes.values():
            pushed.discard(session)

    def complete(self, planned: set[bytes]) -> Optional[int]:
        """The oldest version every planned sender session has pushed, if any."""
        return next((v for v in sorted(self.pushes) if self.pushes[v] >= planned), None)

    def dead(self, planned: set[bytes], name: Callable[[bytes], str], committed: Optional[int],
             now: Optional[float] = None, limit: Optional[float] = None) -> Iterator[tuple[int, str]]:
        """(version, why) for each pending push that can never start a round."""
        for version in sorted(self.pushes):
            passed = sorted(name(i) for i in planned
                            if i not in self.pushes[version] and self.newest.get(i, -1) > version)
            if passed:
                yield version, f"push of v{version} can never start: {', '.join(passed)} pushed a newer version instead"
            elif committed is not None and version <= committed:
                yield version, f"push of v{version} is not newer than the committed v{committed}"
            elif now is not None and limit is not None and now - self.since[version] > limit:
                waiting = sorted(name(i) for i in planned if i not in self.pushes[version])
                yield version, f"push of v{version} waited {limit}s for {', '.join(waiting) or 'a plan'}"
