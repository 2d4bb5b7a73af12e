"""Data-plane authentication: who may write into a receiver's registered memory, and where.

How this works. The controller makes one random secret when it starts and derives a key for each
(sender, receiver) pair a plan routes bytes between, bound to both ends' control sessions
(``pair_key``): a pair of the same two processes keeps its key from plan to plan (and the sender its
connection), a restarted process gets new keys. Each worker gets the keys of its own pairs in its
(HMAC-authenticated) ``plan`` message. A receiver hands its keys to its transport's
``DataGuard`` (``authorize``). A connection proves its pair's key by answering a fresh random
challenge from the target (``prove``: HMAC-SHA256 over the nonce and the claimed sender rank), so the
key itself never travels on the data port and a recorded answer is useless on another connection.

The guard then decides every write: the connection must be authenticated with the key the current
plan gives that sender (a sender the new plan no longer names, or a restarted one, is refused), and
the target region must be open (``open_regions``: a shadow receiver opens only its landing slot,
never the live one; an in-place receiver opens its live region only between ``before_update`` and
the end of the round). A refused connection or write is counted, logged with the peer's address, and
never applied. Transports that hand out one-sided descriptors (cuda_ipc, UCCL's RDMA regions) rely on
the controller giving those descriptors only to the senders a plan names; UCCL's and TCP's side
channels answer the challenge too. No I/O here.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
from typing import Iterable, Mapping, Optional

from .logs import Repeats

log = logging.getLogger("weightsync")

NONCE_BYTES = 16
PROOF_BYTES = 32
KEY_BYTES = 32


def new_secret() -> bytes:
    return os.urandom(KEY_BYTES)


def pair_key(secret: bytes, sender: int, receiver: int, sessions: tuple[bytes, bytes] = (b"", b"")) -> bytes:
    """The key of one (sender, receiver) pair under the controller's secret, bound to both ends'
    control sessions (``sessions``: the sender's and the receiver's): a restarted process has a new
    session, so its pairs get new keys, while the pairs of processes that stay keep theirs."""
    return pair_keys(secret, sender, sessions[0], [(receiver, sessions[1])])[0]


def pair_keys(secret: bytes, sender: int, session: bytes, receivers: Iterable[tuple[int, bytes]]) -> list[bytes]:
    """``pair_key`` of one sender with each of ``receivers`` ((rank, session) pairs), made at once."""
    head = b"weightsync-data:%d>" % sender
    mine = b":" + session.hex().encode() + b">"
    digest = hmac.digest
    return [digest(secret, head + b"%d" % r + mine + s.hex().encode(), "sha256") for r, s in receivers]


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(key: bytes, nonce: bytes, sender: int) -> bytes:
    """A sender's answer to a target's challenge."""
    return hmac.digest(key, nonce + sender.to_bytes(4, "little"), "sha256")


class DataGuard:
    """The target side's decisions; one per transport (``auto`` shares one among its children)."""

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}  # sender rank -> its pair key under the current plan
        self.open: Optional[frozenset[int]] = None  # writable region ids; None: not restricted yet
        self.refused = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=16)
        self.listeners: list = []  # called when the open regions change (a transport stops writes in progress)
        self.logged = Repeats(log)

    def __repr__(self) -> str:
        return f"<DataGuard senders={sorted(self.keys)} open={sorted(self.open or ())} refused={self.refused}>"

    def authorize(self, keys: Mapping[int, bytes]) -> None:
        """The senders of the current plan and their keys (replaces the previous plan's)."""
        self.keys = dict(keys)

    def open_regions(self, regions: Iterable[int]) -> None:
        self.open = frozenset(regions)
        for listener in self.listeners:
            listener()

    def admit(self, sender: int, nonce: bytes, proof: bytes, peer: str) -> Optional[bytes]:
        """The key a connection authenticated with, or None (refused, counted, logged)."""
        key = self.keys.get(sender)
        if key is None:
            self.refuse(peer, f"claims sender/{sender}, which the current plan does not name")
            return None
        if not hmac.compare_digest(prove(key, nonce, sender), proof):
            self.refuse(peer, f"claims sender/{sender} without its key")
            return None
        return key

    def write_problem(self, sender: int, key: Optional[bytes], region: int) -> Optional[str]:
        """Why a write from an authenticated connection may not land, or None."""
        if key is None:
            return f"sender/{sender} is not authenticated under the current plan: its connection proved no key"
        if sender not in self.keys:
            return f"sender/{sender} is not authenticated under the current plan: the current plan does not name it"
        if self.keys[sender] != key:
            return (f"sender/{sender} is not authenticated under the current plan: its connection proved the key "
                    f"of an earlier pair of sessions")
        if self.open is not None and region not in self.open:
            return f"region {region} is not open for writing (open: {sorted(self.open)})"
        return None

    def refuse(self, peer: str, why: str, kind: str = "") -> None:
        """Count and log a refusal; repeats of one ``kind`` from one address are aggregated (``Repeats``)."""
        self.refused += 1
        self.recent.append(f"{peer}: {why}")
        self.logged.log((peer.rpartition(":")[0], kind or why), f"data plane: refused {peer}: {why}")
