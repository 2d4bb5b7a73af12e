"""Membership churn: members leave and come back as new sessions at random moments while the others
push, and every round's outcome is checked against what the receivers serve.

    .venv/bin/python bench/churn.py --cycles 1000 --out docs/results/churn_cpu.json   # the target run
    .venv/bin/python bench/churn.py --cycles 30 --json                                # a short run (make test)

How this works: a controller, S senders and R shadow receivers run in one event loop over real ZeroMQ
and TCP on loopback (each a real session with its own sockets and data-plane connections). Every
tensor is a pure function of (name, version). Each cycle pushes the next version from every sender and,
at a moment the seeded generator picks, replaces one sender and one receiver by new sessions of the
same rank (a clean leave or a silent death; the same or another host id): before the pushes, among
them (after a random number of loop turns), or while the controller is computing a plan. Then, per
cycle:

- every push ends in a commit or a typed error (``WeightSyncError``) within the round timeout, else it
  is a **stall**;
- a round the controller records as committed is served by every receiver session it was planned for,
  bit for bit (else a **false commit**), and no receiver serves a version the controller does not
  know as committed, or goes back;
- an aborted round blames only a member replaced in that cycle (or before it, where the senders could
  not hold a plan naming its new session when the cycle began; for a push carried from the cycle before,
  one replaced then), one that joined again as a new session on its own, or nobody (else **wrong blame**).

The last line (``--json``) is one object with those counts, the rounds committed and aborted, and the
command; exit status 1 on any false commit, stall, wrong blame or mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import pathlib
import random
import sys
import time

import torch
import zmq

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from weightsync.engine.errors import RoundAborted  # noqa: E402
from weightsync.engine.transport import TransportOptions  # noqa: E402
from weightsync.roles import (Controller, ControllerOptions, ReceiverOptions, SenderOptions,  # noqa: E402
                              WeightReceiver, WeightSender)
from weightsync.wire.errors import WeightSyncError  # noqa: E402

SHAPES = {"embed": (257, 64), "layers.0.w": (64, 192), "layers.0.b": (192,), "layers.1.w": (192, 64), "norm": (64,)}


def weights(version: int) -> dict[str, torch.Tensor]:
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 1e-3 + version + i
            for i, (name, shape) in enumerate(SHAPES.items())}


def blank() -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, -1.0) for name, shape in SHAPES.items()}


def matches(tensors: dict[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(tensors[n], t) for n, t in weights(version).items())


class Fleet:
    """The controller and the current session of every rank; ``replace`` swaps one for a new session."""

    def __init__(self, args, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        self.ctl = Controller(senders=args.senders, receivers=args.receivers, options=ControllerOptions(
            heartbeat_s=args.heartbeat, timeout_s=args.timeout, round_timeout_s=args.round_timeout))
        self.senders: dict[int, WeightSender] = {}
        self.receivers: dict[int, WeightReceiver] = {}
        self.served: dict[int, int] = {}  # receiver object id -> the newest version it served
        self.carried: list = []  # late pushes whose round ended without them (settled next cycle)
        self.changed: set[str] = set()  # the members the last cycle replaced (a carried push may blame them)
        self.sessions: dict[int, tuple[str, bytes]] = {}  # worker object id -> (name, session) as the cycle began
        self.rounds: dict[int, dict] = {}  # version -> the plan's sessions when its round started
        start_round = self.ctl.rounds.start

        def recorded(version: int) -> None:
            self.rounds[version] = dict(self.ctl.planning.sessions)
            start_round(version)

        self.ctl.rounds.start = recorded

    def _transport(self) -> TransportOptions:
        return TransportOptions(host_id=self.rng.choice(["host-a", "host-b"]))

    async def start(self) -> None:
        await self.ctl.start()
        for r in range(self.args.receivers):
            self.receivers[r] = await self._receiver(r)
        for s in range(self.args.senders):
            self.senders[s] = await self._sender(s)
        await asyncio.wait_for(self.ctl.wait_ready(), 30)

    async def _sender(self, rank: int) -> WeightSender:
        opts = SenderOptions(transport_options=self._transport(), rank_wait_s=10.0)
        return await WeightSender(self.ctl.address, weights(0), rank=rank, options=opts).__aenter__()

    async def _receiver(self, rank: int) -> WeightReceiver:
        opts = ReceiverOptions(transport_options=self._transport(), rank_wait_s=10.0)
        return await WeightReceiver(self.ctl.address, blank(), rank=rank, options=opts).__aenter__()

    async def replace(self, role: str, rank: int) -> None:
        """The rank's session goes (a clean leave, or a death that says nothing) and a new one joins."""
        group = self.senders if role == "sender" else self.receivers
        old = group.pop(rank)
        if self.rng.random() < 0.5:
            await old.close()
        else:  # killed: its sockets go, nothing is said; the controller replaces or times it out
            old._channel.close()
            tasks = [*old._tasks, *[t for t in (getattr(old, "_plan_task", None), getattr(old, "_round", None)) if t]]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            old._channel = None
            await old.close()
        group[rank] = await (self._sender(rank) if role == "sender" else self._receiver(rank))

    def members(self) -> list:
        return [*self.senders.values(), *self.receivers.values()]

    def rejoined(self) -> set[str]:
        """Members that joined again as a new session during this cycle without being replaced (their
        session was dropped, say as silent, and they rejoined): changed as much as a replaced one."""
        return {was[0] for w in self.members() if (was := self.sessions.get(id(w))) is not None
                and _identity(w) not in (b"", was[1])}

    async def close(self) -> None:
        for worker in self.members():
            await worker.close()
        await self.ctl.close()


async def cycle(fleet: Fleet, version: int, rng: random.Random, tally: dict) -> None:
    ctl = fleet.ctl
    sender, receiver = rng.randrange(fleet.args.senders), rng.randrange(fleet.args.receivers)
    changed = {f"sender/{sender}", f"receiver/{receiver}"} | unplanned(fleet)
    fleet.sessions = {id(w): (f"{w.role.value}/{w.rank}", _identity(w)) for w in fleet.members()}
    moment = rng.choice(["before", "among", "planning"])

    async def churn() -> None:
        await fleet.replace("receiver", receiver)
        if moment == "planning":  # the sender goes while the plan for the receiver's new session is made
            while ctl.planning.task is None and not ctl.planning.ready.is_set():
                await asyncio.sleep(0)
        await fleet.replace("sender", sender)

    if moment == "before":
        await churn()
    pushes = {}
    churning = None
    for rank, s in sorted(fleet.senders.items()):
        if moment != "before" and churning is None and rng.random() < 0.5:
            churning = asyncio.ensure_future(churn())
            for _ in range(rng.randrange(20)):
                await asyncio.sleep(0)  # (a random number of loop turns: the churn lands mid-push)
        s = fleet.senders.get(rank)  # (None while the churn replaces it)
        if s is not None and s._last_version < version:
            update_weights(s, version)
            try:
                pushes[rank] = s.push_nowait(version)
            except WeightSyncError as exc:  # (refused at once: typed)
                tally["errors"][type(exc).__name__] = tally["errors"].get(type(exc).__name__, 0) + 1
    if churning is None and moment != "before":
        churning = asyncio.ensure_future(churn())
    if churning is not None:
        await churning
    late = {}
    for rank, s in sorted(fleet.senders.items()):  # a new session pushes too (its predecessor's push went with it)
        if s._last_version < version and s.lost is None:
            update_weights(s, version)
            try:
                late[rank] = s.push_nowait(version)
            except WeightSyncError as exc:  # (refused at once: typed)
                tally["errors"][type(exc).__name__] = tally["errors"].get(type(exc).__name__, 0) + 1
    await settle(fleet, version, pushes, late, changed, tally)


def unplanned(fleet: Fleet) -> set[str]:
    """Members replaced before this cycle whose new session no plan has named yet, or one the senders may
    not hold yet: the receivers whose session the controller's current arm does not name (another session,
    or none: it was made while the rank was away), since an armed push made under it aborts blaming them
    once the plan that names the new session comes, in this cycle (``Arm.kept``)."""
    planned, arm = fleet.ctl.planning.sessions, fleet.ctl.rounds.arming.arms.current
    return {f"{w.role.value}/{w.rank}" for w in fleet.members()
            if planned.get((w.role, w.rank)) != _identity(w)
            or (w.role.value == "receiver" and arm is not None and arm.receivers.get(w.rank) != _identity(w))}


def note(tally: dict, kind: str, text: str) -> None:
    """A problem of ``kind`` (the first ten of each kind are kept)."""
    kept = tally["problems"].setdefault(kind, [])
    if len(kept) < 10:
        kept.append(text)


def update_weights(sender: WeightSender, version: int) -> None:
    for name, t in weights(version).items():
        sender.tensors[name].copy_(t)


async def settle(fleet: Fleet, version: int, pushes: dict, late: dict, changed: set, tally: dict) -> None:
    """Every push ends in time; a late push (a new session's) whose round already ended without it is
    carried to the next cycle, whose newer pushes must end it promptly (``PushBook.dead``)."""
    limit = fleet.args.round_timeout + 2 * fleet.args.timeout + 2.0
    carried, fleet.carried = fleet.carried, []
    await outcomes(fleet, version, list(pushes.values()), changed, limit, tally)
    await outcomes(fleet, version, carried, changed | fleet.changed, limit, tally)  # (their own cycle's too)
    fleet.changed = changed
    if any(h.committed.done() and h.committed.exception() is None for h in pushes.values()) or not pushes:
        await outcomes(fleet, version, list(late.values()), changed, limit, tally)
    else:
        fleet.carried = [h for h in late.values() if not h.committed.done()]
    await check(fleet, version, limit, tally)


async def outcomes(fleet: Fleet, version: int, handles: list, changed: set, limit: float, tally: dict) -> None:
    for handle in handles:
        try:
            await asyncio.wait_for(asyncio.shield(handle.committed), limit)
        except asyncio.TimeoutError:
            tally["stalls"] += 1
            senders = {s.rank: (s.session.state.value, sorted(s._handles), sorted(s._in_doubt))
                       for s in fleet.senders.values()}
            note(tally, "stalls", f"v{version}: {handle!r} not ended after {limit}s; controller {fleet.ctl!r}; "
                                  f"senders (state, pending, in doubt): {senders}; {_inside(fleet)}")
        except RoundAborted as exc:
            tally["errors"]["RoundAborted"] = tally["errors"].get("RoundAborted", 0) + 1
            if exc.culprit and exc.culprit not in changed | fleet.rejoined():
                tally["wrong_blame"] += 1
                note(tally, "wrong_blame", f"v{version}: blamed {exc.culprit}, changed {sorted(changed)}: {exc.text[:200]}; "
                                           f"last log: {list(RECENT)[-20:]}")
        except WeightSyncError as exc:
            kind = type(exc).__name__
            tally["errors"][kind] = tally["errors"].get(kind, 0) + 1
            if fleet.args.verbose:
                print(f"v{version}: {exc!r}", file=sys.stderr)
        except Exception as exc:  # an untyped error is a bug
            tally["untyped"] += 1
            note(tally, "untyped", f"v{version}: {exc!r}")


async def check(fleet: Fleet, version: int, limit: float, tally: dict) -> None:
    ctl = fleet.ctl
    if version in fleet.rounds:  # its round started: judge it once it has ended (commit acks included)
        try:
            await asyncio.wait_for(ctl.wait_round(version), limit)
        except (RoundAborted, asyncio.TimeoutError):
            pass
    report = next((r for r in reversed(ctl.reports) if r.version == version), None)
    if report is not None and report.ok:
        tally["committed"] += 1
        planned = fleet.rounds.get(version, {})
        members = [r for r in fleet.receivers.values() if planned.get((r.role, r.rank)) == _identity(r)]
        try:  # every receiver session the round was planned for serves it
            await asyncio.wait_for(asyncio.gather(*[r.wait_for(version) for r in members]), limit)
        except (asyncio.TimeoutError, WeightSyncError) as exc:
            tally["false_commits"] += 1
            note(tally, "false_commits", f"v{version} committed; its receivers serve "
                                     f"{[r.version for r in members]} ({exc!r})")
    elif report is not None:
        tally["aborted"] += 1
    for r in fleet.receivers.values():
        seen = fleet.served.get(id(r), -1)
        if r.version is not None:
            if r.version < seen:
                tally["rollbacks"] += 1
                note(tally, "rollbacks", f"v{version}: receiver/{r.rank} went from v{seen} to v{r.version}")
            fleet.served[id(r)] = r.version
            if ctl.committed is None or r.version > ctl.committed:
                tally["false_commits"] += 1
                said = next((f"{x.reason} {x.culprit}" for x in reversed(ctl.reports) if x.version == r.version), "no report")
                note(tally, "false_commits", f"v{version}: receiver/{r.rank} serves v{r.version}, controller committed "
                                             f"v{ctl.committed} (its round: {said}); last log: {list(RECENT)[-20:]}")
            if not matches(r.tensors, r.version):
                tally["mismatches"] += 1
                note(tally, "mismatches", f"v{version}: receiver/{r.rank} serves v{r.version} with other bytes")
    if ctl.committed is not None and not any(r.version == ctl.committed for r in fleet.receivers.values()) \
            and report is not None and report.ok and report.version == ctl.committed:
        tally["false_commits"] += 1
        note(tally, "false_commits", f"v{version} recorded committed; receivers serve {[r.version for r in fleet.receivers.values()]}")


def _inside(fleet: Fleet) -> str:
    """For a stall: the controller's tasks, each pending push's sessions and age, the plan's sender
    sessions, each sender's session, and the last log records."""
    ctl, now = fleet.ctl, time.monotonic()
    tasks = [("done: " + repr(t.exception()) if not t.cancelled() and t.exception() else "done") if t.done()
             else "running" for t in ctl._tasks]
    book = ctl.rounds.pushes
    pending = {v: (sorted(i.hex()[:8] for i in ids), round(now - book.since.get(v, now), 1)) for v, ids in book.pushes.items()}
    planned = sorted(i.hex()[:8] for i in ctl.planning.sender_sessions())
    ours = {s.rank: _identity(s).hex()[:8] for s in fleet.senders.values()}
    return (f"controller tasks {tasks}; pushes (sessions, age s) {pending}; planned sender sessions {planned}; "
            f"sender sessions {ours}; round task {ctl.rounds.task!r}; last log: {list(RECENT)}")


class _Recent(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        RECENT.append(f"{record.created:.2f} {record.levelname} {record.getMessage()[:300]}")


RECENT: "collections.deque[str]" = collections.deque(maxlen=40)


def _identity(worker) -> bytes:
    return worker._channel.sock.getsockopt(zmq.ROUTING_ID) if worker._channel is not None else b""


async def run(args) -> dict:
    rng = random.Random(args.seed)
    fleet = Fleet(args, rng)
    tally = {"cycles": 0, "committed": 0, "aborted": 0, "false_commits": 0, "stalls": 0, "wrong_blame": 0,
             "rollbacks": 0, "mismatches": 0, "untyped": 0, "errors": {}, "problems": {}}
    t0 = time.perf_counter()
    await fleet.start()
    try:
        for version in range(1, args.cycles + 1):
            await cycle(fleet, version, rng, tally)
            tally["cycles"] += 1
    finally:
        await fleet.close()
    tally["seconds"] = round(time.perf_counter() - t0, 1)
    tally["command"] = "bench/churn.py " + " ".join(sys.argv[1:])
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument("--receivers", type=int, default=8)
    ap.add_argument("--heartbeat", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--round-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print each push's typed error")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.INFO if args.verbose else logging.ERROR)
    recent = _Recent(logging.INFO)  # (the last records, for a stall's note)
    logging.getLogger("weightsync").addHandler(recent)
    logging.getLogger("weightsync").setLevel(logging.INFO)
    tally = asyncio.run(run(args))
    line = json.dumps(tally)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(tally, indent=1) + "\n")
    print(line if args.json else json.dumps(tally, indent=1))
    bad = tally["false_commits"] + tally["stalls"] + tally["wrong_blame"] + tally["rollbacks"] + tally["mismatches"]
    return 1 if bad + tally["untyped"] else 0


if __name__ == "__main__":
    sys.exit(main())
