"""The link model: who is where, and how fast bytes move between two ranks.

How this works: every sender and receiver has a host and a device (from its ``TransportInfo``).
A transfer between them is of one of three classes: ``LOCAL`` (same GPU: a device copy), ``HOST``
(same host, another device: NVLink/PCIe/shared memory), ``NET`` (another host: the NIC). Each rank
has one port per class and direction; a transfer occupies the sender's and the receiver's port of its
class. Bandwidths are per port, in bytes per second, with per-rank overrides for NIC speeds.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from typing import Mapping, Sequence

from weightsync.wire import Manifest, TransportInfo


class LinkClass(enum.IntEnum):
    LOCAL = 0
    HOST = 1
    NET = 2


GBIT = 1e9 / 8


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Bandwidths (bytes/s) per port class; ``per_transfer_s`` is each write's issue overhead."""

    net_bw: float = 400 * GBIT
    host_bw: float = 360e9
    local_bw: float = 1.5e12
    per_transfer_s: float = 2e-6
    net_bw_by_rank: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)

    def bandwidth(self, cls: LinkClass, sender: int, receiver: int) -> float:
        if cls is LinkClass.LOCAL:
            return self.local_bw
        if cls is LinkClass.HOST:
            return self.host_bw
        return min(
            self.net_bw_by_rank.get(("sender", sender), self.net_bw),
            self.net_bw_by_rank.get(("receiver", receiver), self.net_bw),
        )

    def port_bw(self, cls: LinkClass, role: str, rank: int) -> float:
        if cls is LinkClass.NET:
            return self.net_bw_by_rank.get((role, rank), self.net_bw)
        return self.host_bw if cls is LinkClass.HOST else self.local_bw


@dataclasses.dataclass(frozen=True)
class Participant:
    """One worker as the planner sees it."""

    rank: int
    manifest: Manifest
    transport: TransportInfo

    @property
    def host(self) -> str:
        return self.transport.host

    @property
    def device(self) -> str:
        return self.transport.device


def link_class(sender: Participant, receiver: Participant) -> LinkClass:
    if sender.host != receiver.host:
        return LinkClass.NET
    if sender.device == receiver.device and sender.device.startswith("cuda"):
        return LinkClass.LOCAL
    return LinkClass.HOST


def by_host(members: Sequence[Participant]) -> dict[str, list[Participant]]:
    out: dict[str, list[Participant]] = defaultdict(list)
    for p in members:
        out[p.host].append(p)
    return out


def mates_of(member: Participant, others: Mapping[str, Sequence[Participant]]) -> dict[int, LinkClass]:
    """The members of the other role on ``member``'s host (``others``: ``by_host`` of them) with their
    link class to it (the class is the same both ways); every other reaches it by NET. All the planner
    reads of where a member is."""
    return {p.rank: link_class(p, member) for p in others.get(member.host, ())}


def host_mates(senders: Sequence[Participant], receivers: Sequence[Participant]) -> dict[int, dict[int, LinkClass]]:
    """Per receiver, the senders on its host with their link class (``mates_of``)."""
    senders_at = by_host(senders)
    return {rp.rank: mates_of(rp, senders_at) for rp in receivers}


def classes_of(cands: tuple[int, ...], mates: Mapping[int, LinkClass]) -> dict[LinkClass, tuple[int, ...]]:
    """Candidate senders grouped by the class they reach one receiver by (``mates``: its ``host_mates``),
    classes in order."""
    if not mates or mates.keys().isdisjoint(cands):
        return {LinkClass.NET: cands}
    split: dict[LinkClass, list[int]] = defaultdict(list)
    for s in cands:
        split[mates.get(s, LinkClass.NET)].append(s)
    return {c: tuple(ss) for c, ss in sorted(split.items())}
