"""The controller's status as a JSON-able dict (for ``status`` replies, the CLI and logs).

How this works: ``controller_status`` reads what a ``StatusSource`` exposes (the controller is one; this
module does not import it, so the two do not import each other) and returns plain data.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional, Protocol


class StatusSource(Protocol):
    """What the status reads of a controller."""

    address: str
    expected: dict
    peers: dict
    plan: Any
    plan_error: Optional[BaseException]
    committed: Optional[int]
    round: Any
    pushes: Any
    reports: list
    _ready: asyncio.Event


def controller_status(c: StatusSource) -> dict:
    now = time.monotonic()
    peers = [
        {
            "role": p.hello.role.value,
            "rank": p.hello.rank,
            "host": p.hello.host,
            "device": p.hello.device,
            "pid": p.hello.pid,
            "transport": p.hello.transport.kind,
            "address": p.hello.transport.address,
            "state": p.session.state.value,
            "last_seen_s": round(now - p.last_seen, 3),
            "tensors": len(p.hello.manifest.tensors),
        }
        for p in sorted(c.peers.values(), key=lambda p: (p.hello.role.value, p.hello.rank))
    ]
    plan = None
    if c.plan is not None:
        plan = {"id": c.plan.plan_id, "transfers": c.plan.transfer_count, "bytes": c.plan.nbytes,
                "acknowledged": c._ready.is_set()}
    return {
        "address": c.address,
        "expected": {role.value: n for role, n in c.expected.items()},
        "peers": peers,
        "plan": plan,
        "plan_error": str(c.plan_error) if c.plan_error else None,
        "committed_version": c.committed,
        "round": None if c.round is None else {"version": c.round.version, "stage": c.round.stage},
        "pending_pushes": {str(v): sorted(c.peers[i].name for i in ids if i in c.peers) for v, ids in sorted(c.pushes.pushes.items())},
        "rounds": [r.to_json() for r in c.reports[-10:]],
    }
