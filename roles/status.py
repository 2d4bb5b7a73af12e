"""The controller's status as a JSON-able dict (for ``status`` replies, the CLI and logs).

How this works: ``controller_status`` reads the controller's parts (membership, planning, rounds; this
module imports none of them, so none imports it back) and returns plain data.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from weightsync.engine.errors import ConfigError


def controller_status(address: str, membership: Any, planning: Any, rounds: Any, costs: Any) -> dict:
    """The controller's parts (``Membership``, ``Planning``, ``Rounds``, ``Costs``), as plain data."""
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
        for p in sorted(membership, key=lambda p: (p.hello.role.value, p.hello.rank))
    ]
    plan = None
    if planning.plan is not None:
        plan = {"id": planning.plan.plan_id, "transfers": planning.plan.transfer_count, "bytes": planning.plan.nbytes,
                "acknowledged": planning.ready.is_set(),
                "predicted_round_ms": round(costs.predict(planning.plan.plan_id) * 1e3, 3)}
    names = {p.identity: p.name for p in membership}
    return {
        "address": address,
        "expected": {role.value: n for role, n in membership.expected.items()},
        "peers": peers,
        "plan": plan,
        "plan_error": str(planning.error) if planning.error else None,
        "committed_version": rounds.committed,
        "round": None if rounds.round is None else {"version": rounds.round.version, "stage": rounds.round.stage},
        "arms": {"offered": rounds.arming.arms.offered, "current": rounds.arming.arms.current is not None,
                 "voided_version": rounds.arming.voided if rounds.arming.voided >= 0 else None},
        "pending_pushes": {str(v): sorted(names[i] for i in ids if i in names)
                           for v, ids in sorted(rounds.pushes.pushes.items())},
        "rounds": [r.to_json() for r in rounds.reports[-10:]],
        "costs": costs.status(),  # learned per-row and per-round costs (None: none yet)
    }


def run_command(request: Any, status: Callable[[], dict], update: Callable[[int], None]) -> tuple[bool, Any, str]:
    """A ``command_request`` to the controller (``status``, ``update``): (ok, result, error text)."""
    cmd, args = request.command, request.args if isinstance(request.args, dict) else {}
    try:
        if cmd == "status":
            return True, status(), ""
        if cmd == "update":
            update(int(args.get("version", -1)))
            return True, {"started": args.get("version")}, ""
        raise ConfigError("command", f"unknown command {cmd!r} (controller knows: status, update)")
    except (ConfigError, ValueError, TypeError) as exc:
        return False, None, str(exc)
