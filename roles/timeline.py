"""Per-round timelines: when each message of a round was sent and received, on one clock.

How this works: every role keeps a ``Timeline``; the channel owner marks ``send:<type>`` and
``recv:<type>`` for each message that belongs to a version (begin, writes_done, fence, ...), and the
sender adds its pipeline's steps (``Pipeline.run``'s ``mark``). Marks are ``time.perf_counter()`` values, which on Linux
read ``CLOCK_MONOTONIC``: one clock for every process of a host, so the marks of the controller, a
sender and a receiver on one machine can be merged (``merge``) into one timeline of the round,
relative to its start, and many rounds' into each event's median (``medians``). Only the last ``keep`` versions are kept. A mark costs a dict store.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Iterable, Mapping, Optional


class Timeline:
    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._versions: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"<Timeline versions={list(self._versions)}>"

    def mark(self, version: Optional[int], event: str, at: Optional[float] = None) -> None:
        """Record ``event`` of ``version`` (now, unless ``at``); the first mark of an event wins."""
        if version is None:
            return
        marks = self._versions.get(version)
        if marks is None:
            marks = self._versions[version] = {}
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        marks.setdefault(event, time.perf_counter() if at is None else at)

    def of(self, version: int) -> dict[str, float]:
        """A copy of ``version``'s marks (absolute ``perf_counter`` seconds); empty if unknown."""
        return dict(self._versions.get(version, {}))


def merge(start: float, sources: Mapping[str, Mapping[str, float]]) -> list[tuple[float, str]]:
    """``{role: marks}`` -> [(milliseconds since ``start``, "role event")], in time order."""
    rows = [((t - start) * 1e3, f"{role} {event}") for role, marks in sources.items() for event, t in marks.items()]
    return sorted(rows)


def medians(timelines: Iterable[Iterable[tuple[float, str]]]) -> list[tuple[str, float]]:
    """Merged timelines of many rounds (``merge``) -> each event's median milliseconds since its round's
    start, in time order."""
    at: dict[str, list[float]] = {}
    for rows in timelines:
        for ms, event in rows:
            at.setdefault(event, []).append(ms)
    return sorted(((event, statistics.median(v)) for event, v in at.items()), key=lambda x: x[1])


def hops(rows: Iterable[tuple[float, str]]) -> list[tuple[str, float]]:
    """Consecutive marks of a merged timeline -> [("a -> b", milliseconds between them)]."""
    rows = list(rows)
    return [(f"{a} -> {b}", tb - ta) for (ta, a), (tb, b) in zip(rows, rows[1:])]


def push_wait(marks: Mapping[str, float]) -> float:
    """What a trainer waited for a version (a sender's ``Timeline.of``): from its push, armed or not, until
    it held the commit (0 where it made no push)."""
    done = marks["recv:commit"]
    return done - marks.get("send:armed_push", marks.get("send:push", done))
