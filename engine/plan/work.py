"""What the schedule makes: a ``Segment`` (pieces one sender sends one receiver back to back, from a
start), ``Runs`` (such work as columns over one list of pieces), and the ``Schedule`` (the flexible
segments, the forced runs, each port's busy time), which levelling moves and the tables read.

How this works: plain containers, no scheduling: ``schedule.py`` fills them, ``levelling.py`` moves
segments between senders and ``tables.build_tables`` orders every run (``Schedule.runs``) into the
senders' tables.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from itertools import chain
from typing import Sequence

import numpy as np

from .links import LinkClass, LinkModel
from .sources import Piece, pooled, ranges


class Segment:
    """Pieces one sender sends one receiver back to back, from ``start`` in the schedule's time."""

    __slots__ = ("sender", "receiver", "cls", "pieces", "nbytes", "start", "cands")

    def __init__(self, receiver: int, cls: LinkClass, pieces: list[Piece], sender: int, nbytes: int,
                 cands: frozenset[int] = frozenset()) -> None:
        self.sender = sender
        self.receiver = receiver
        self.cls = cls
        self.pieces = pieces
        self.nbytes = nbytes
        self.start = 0.0
        self.cands = cands  # the senders that could send it (its stream's), when more than one


@dataclasses.dataclass
class Runs:
    """Work as columns, a row per run (pieces one sender sends one receiver back to back): when it
    starts in the schedule's time, its receiver, its sender, its bytes, and its pieces,
    ``pool[first:first + count]`` (ranges of one list: no list per run)."""

    start: np.ndarray  # float64
    receiver: np.ndarray  # int64, each column
    sender: np.ndarray
    nbytes: np.ndarray
    first: np.ndarray
    count: np.ndarray
    pool: list[Piece]

    @classmethod
    def empty(cls) -> "Runs":
        return cls(np.zeros(0), *(np.zeros(0, np.int64) for _ in range(5)), [])

    @classmethod
    def of_lists(cls, start: np.ndarray, receiver: np.ndarray, sender: np.ndarray, nbytes: np.ndarray,
                 pieces: Sequence[list[Piece]]) -> "Runs":
        """Runs whose pieces are given as a list each."""
        pool, first, count = pooled(pieces)
        return cls(start, receiver, sender, nbytes, first, count, pool)

    @classmethod
    def joined(cls, parts: Sequence["Runs"]) -> "Runs":
        """``parts`` one after the other."""
        if not parts:
            return cls.empty()
        at = np.cumsum([0, *(len(r.pool) for r in parts[:-1])])  # where each part's pool lands in the one pool
        return cls(*(np.concatenate([getattr(r, f) for r in parts]) for f in ("start", "receiver", "sender", "nbytes")),
                   np.concatenate([r.first + a for r, a in zip(parts, at.tolist())]),
                   np.concatenate([r.count for r in parts]), list(chain.from_iterable(r.pool for r in parts)))

    @property
    def pieces(self) -> list[list[Piece]]:
        """Each run's pieces as a list of its own."""
        return ranges(self.pool, self.first, self.count)

    def __len__(self) -> int:
        return len(self.first)


@dataclasses.dataclass
class Schedule:
    """What the schedule made: the flexible work as ``segments`` (what levelling may move), the forced
    work as ``Runs``, one per link class in class order, each in the order placed, and each port's
    busy time in both (seconds of data at the pair's bandwidth) keyed (sender or receiver, class): the
    sums ``of`` makes from segments, which the schedule keeps as it goes."""

    segments: list[Segment]
    sending: dict[tuple[int, LinkClass], float]
    receiving: dict[tuple[int, LinkClass], float]
    forced: list[Runs] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, segments: list[Segment], link: LinkModel) -> "Schedule":
        sending: dict[tuple[int, LinkClass], float] = defaultdict(float)
        receiving: dict[tuple[int, LinkClass], float] = defaultdict(float)
        for seg in segments:
            t = seg.nbytes / link.bandwidth(seg.cls, seg.sender, seg.receiver)
            sending[seg.sender, seg.cls] += t
            receiving[seg.receiver, seg.cls] += t
        return cls(segments, sending, receiving)

    def runs(self) -> Runs:
        """All the work: the forced runs (class by class, each in the order placed), then the segments."""
        segs = self.segments
        flexible = Runs.of_lists(*(np.fromiter(map(operator.attrgetter(f), segs), t, len(segs)) for f, t in (
            ("start", np.float64), ("receiver", np.int64), ("sender", np.int64), ("nbytes", np.int64))),
            list(map(operator.attrgetter("pieces"), segs)))
        return Runs.joined([*self.forced, flexible])
