"""Fault matrix: SIGKILL a random role at a random moment, restart it, and check that no receiver ever
serves a half-applied or an older version, and that rounds resume.

    .venv/bin/python bench/faults.py --trials 300            # the target run (docs/OPERATIONS.md)
    .venv/bin/python bench/faults.py --trials 10 --json      # figures as one JSON object on the last line

How this works: a controller, S senders and R shadow receivers run as separate processes over TCP on
loopback (this file, ``child`` verb). Senders push version after version, every tensor a pure function
of (name, version); receivers check their live tensors against the expected bytes of the version they
report, after every commit and between commits (continuously), and report each check. Each trial waits
until every receiver has moved past the last trial's versions, kills one random process (controller,
a sender or a receiver) after a random delay (so often mid-round), restarts it at once, and measures
how long until every receiver serves a version newer than any seen at the kill, with the restarted
process taking part (a restarted sender in a committed round). Resume times count from the moment
the restarted process has joined (its imports take about 2.5 s here, and are not the engine's). Half the trials run
with crc32 checksums, half without (``--checksum``). Exit status 1 on any half-applied version,
rollback or unresumed trial.

``--inject`` (with ``--delta``): injected faults besides the kills. Sender 0 corrupts one bit of one
delta payload (a random byte of it) in 10% of its pushes, after the payload is packed; receiver 0 flips
one bit of one served value in 5% of the versions it commits (memory gone bad). Each corrupted push must
abort naming the row it damaged (``corruptions_caught``; a push that commits is ``corruptions_missed``;
one a kill aborted first counts apart). Each flip is followed until the receiver has served two
versions in a row without it: an abort naming its parameter meanwhile (the round's checks, or the
next full check of that slot; not the abort of a corrupted push) makes it ``flips_caught``; gone without one, whole rows overwrote it
(``flips_overwritten``, e.g. after another abort); still there ``--full-check-every`` x 2 + 3 versions
later is ``flips_missed``. The receiver's checks excuse the one flipped value while it is there.

``--experts``: the trainers are expert-parallel: besides the replicated tensors each sender holds only
its own rows of an ``experts`` tensor (a non-gatherable shard), so no round can go without every
sender. The processes start in a random order, and a trial may kill a sender and a receiver at once:
the receiver then joins again while that sender is down (admission must not refuse it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {f"layer{i}.w": (64 * (i + 1), 96) for i in range(6)} | {"norm": (96,), "step": ()}
EXPERT_ROWS = 16  # ``--experts``: rows of the experts tensor each sender holds alone


def shapes(args) -> dict:
    return SHAPES | ({"experts": (EXPERT_ROWS * args.senders, 96)} if args.experts else {})


SPARSE = False  # ``--delta``: versions that differ in ~2% of their values, as RL steps do


def expected(name: str, shape: tuple, version: int):
    import torch

    if SPARSE:  # a fixed base; each value moves one unit in the last place every 20-79 versions
        gen = torch.Generator().manual_seed(sum(map(ord, name)) * 1_000_003)
        base = torch.randn(shape, generator=gen).reshape(-1)
        period = torch.randint(20, 80, (base.numel(),), generator=gen)
        phase = torch.randint(0, 80, (base.numel(),), generator=gen)
        return (base.view(torch.int32) + ((version + phase) // period).to(torch.int32)).view(torch.float32).reshape(shape)
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 1_000_003 + version)
    return torch.randn(shape, generator=gen)


def say(**event) -> None:
    print(json.dumps({"t": time.monotonic(), **event}), flush=True)


# --- the children ---------------------------------------------------------------------------------


async def controller_child(args) -> None:
    from weightsync.roles import Controller, ControllerOptions

    opts = ControllerOptions(heartbeat_s=args.heartbeat, timeout_s=args.timeout, checksum=args.checksum,
                             delta=args.delta or "auto", full_check_every=args.full_check_every)
    async with Controller(args.addr, senders=args.senders, receivers=args.receivers, options=opts):
        say(event="ready")
        await asyncio.Event().wait()


def _diagnosable(worker) -> None:
    """SIGUSR1: print the worker's state; SIGUSR2: dump every thread's stack (even with the loop stuck)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR2)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: say(
        event="state", repr=repr(worker), lost=repr(worker.lost), rejoining=repr(worker._rejoining),
        tasks=[repr(t.get_coro()) for t in asyncio.all_tasks()][:20]))


async def sender_child(args) -> None:
    from weightsync.roles import SenderOptions, WeightSender
    from weightsync.wire import ShardSpec

    full = shapes(args)
    rows = {"experts": slice(EXPERT_ROWS * args.rank, EXPERT_ROWS * (args.rank + 1))} if args.experts else {}

    def own(name: str, version: int):  # what this sender holds of ``name`` at ``version``
        value = expected(name, full[name], version)
        return value[rows[name]].clone() if name in rows else value

    tensors = {name: own(name, 0) for name in full}
    shards = {name: ShardSpec(full[name], 0, r.start, r.stop) for name, r in rows.items()}
    corrupt = _corrupting(random.Random(args.seed * 1000 + os.getpid())) if args.inject and args.rank == 0 else None
    async with WeightSender(args.addr, tensors, rank=args.rank, shards=shards,
                            options=SenderOptions(rejoin_deadline_s=120)) as sender:
        _diagnosable(sender)
        say(event="ready")
        while True:
            version = max(sender.committed or 0, sender._last_version) + 1
            for name, t in tensors.items():
                t.copy_(own(name, version))
            armed = corrupt is not None and corrupt.arm()
            try:
                await (await sender.push(version))
                say(event="committed", version=version, deltas=sender.last_delta.rows if sender.last_delta else 0)
                if armed and corrupt.row:
                    say(event="corrupted", version=version, row=corrupt.row, outcome="committed")
            except Exception as exc:  # every failure is surfaced to this process: report it, go on
                say(event="failed", version=version, error=type(exc).__name__, text=str(exc)[:500])
                if armed and corrupt.row:
                    say(event="corrupted", version=version, row=corrupt.row, outcome=str(exc)[:500])
                if sender.lost is not None:
                    return


class _corrupting:
    """``--inject``: flips one bit of the first delta payload of an armed push (``DeltaRound._staged``,
    wrapped in this process: a copy of the packed payload, the sender's base already moved)."""

    def __init__(self, rng: random.Random) -> None:
        from weightsync.engine.datapath.deltas import DeltaRound

        self.rng, self.armed, self.row = rng, False, ""
        real = DeltaRound._staged

        def staged(round_, t, done):
            out = real(round_, t, done)
            if self.armed and out is not None:  # (a delta: its packed bytes, copied: a batch's are shared)
                self.armed, self.row = False, t.name
                payload = out[0].clone()
                payload[self.rng.randrange(payload.numel())] ^= 1 << self.rng.randrange(8)
                out = (payload, *out[1:])
            return out

        DeltaRound._staged = staged

    def arm(self) -> bool:
        self.armed, self.row = self.rng.random() < 0.10, ""
        return self.armed


def _which(t, name: str, version: int) -> str:
    """What a tensor that is not ``version``'s holds instead: a nearby version's bytes, zeros, or other."""
    import torch

    near = [v for v in range(max(0, version - 3), version + 4) if torch.equal(t, expected(name, t.shape, v))]
    return f"v{near[0]}" if near else "zeros" if not t.any() else "other"


async def receiver_child(args) -> None:
    import torch

    from weightsync.roles import WeightReceiver

    tensors = {name: torch.zeros(shape) for name, shape in shapes(args).items()}
    rng = random.Random(args.seed * 1000 + os.getpid())
    flips: dict[str, dict] = {}  # ``--inject``: name -> the flipped element, since when, clean versions seen

    def check(version) -> None:
        bad = {} if version is None else {n: _which(t, n, version) for n, t in tensors.items()
                                          if not torch.equal(t, expected(n, t.shape, version))}
        for name, f in list(flips.items()):
            if name in bad and _only(tensors[name], expected(name, tensors[name].shape, version), f["element"]):
                del bad[name]  # (the injected value itself, still there: excused)
                f["clean"] = []
            elif name not in bad and version is not None and version > f["version"] and version not in f["clean"]:
                f["clean"].append(version)
                if len(f["clean"]) == 2:
                    say(event="flip_gone", name=name, version=version)
                    del flips[name]
        say(event="check", version=version, ok=not bad, bad=bad)

    def on_update(version) -> None:
        check(version)
        if args.inject and args.rank == 0 and rng.random() < 0.05:
            name = rng.choice([n for n in tensors if n not in flips and tensors[n].numel()])
            flat = tensors[name].reshape(-1)
            element = rng.randrange(flat.numel())
            flat.view(torch.uint8)[element * flat.element_size() + rng.randrange(flat.element_size())] ^= 1 << rng.randrange(8)
            flips[name] = {"element": element, "version": version, "clean": []}
            say(event="flip", name=name, version=version)

    async with WeightReceiver(args.addr, tensors, rank=args.rank, on_update=on_update) as receiver:
        _diagnosable(receiver)
        say(event="ready")
        while True:  # between commits too: serving must never see anything but a whole version
            check(receiver.version)
            await asyncio.sleep(0.02)  # a sampling period, not synchronisation


def _only(t, want, element: int) -> bool:
    """``t`` equals ``want`` bit for bit but for value ``element`` (of the flat tensor)."""
    import torch

    got, want = t.reshape(-1).clone(), want.reshape(-1)
    got[element] = want[element]
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# --- the driver -----------------------------------------------------------------------------------


class Cluster:
    """The child processes, their reports, and what the reports add up to."""

    def __init__(self, args, checksum: str) -> None:
        self.args, self.checksum = args, checksum
        self.procs: dict[tuple[str, int], asyncio.subprocess.Process] = {}
        self.readers: dict[tuple[str, int], asyncio.Task] = {}
        self.version: dict[int, int] = {}  # receiver -> version it serves now
        self.pushed: dict[int, int] = {}  # sender -> newest version it saw committed
        self.states: dict[str, dict] = {}  # a stuck cluster's workers, as they describe themselves
        self.ready: dict[tuple[str, int], asyncio.Event] = {}
        self.failures: list[float] = []  # when senders saw a failed push
        self.committed_pushes = 0
        self.delta_rows = 0  # rows sent as deltas, in committed pushes
        self.half_applied: list[str] = []
        self.trial = "start"  # (the trial running: what was killed, to name it in a problem)
        self.rollbacks: list[str] = []
        self.aborts: list[tuple[int, str]] = []  # (version, why) of the pushes senders saw fail
        self.corruptions: list[dict] = []  # ``--inject``: the pushes with a corrupted delta, and how they ended
        self.flips: list[dict] = []  # ``--inject``: the served values flipped, and when they were gone
        self.changed = asyncio.Event()
        port = _free_port()
        self.addr = f"tcp://127.0.0.1:{port}"

    def roles(self) -> list[tuple[str, int]]:
        return [("controller", 0), *(("sender", r) for r in range(self.args.senders)),
                *(("receiver", r) for r in range(self.args.receivers))]

    async def start(self, role: str, rank: int) -> None:
        a = self.args
        cmd = [sys.executable, __file__, "child", role, "--rank", str(rank), "--addr", self.addr,
               "--senders", str(a.senders), "--receivers", str(a.receivers), "--checksum", self.checksum,
               "--heartbeat", str(a.heartbeat), "--timeout", str(a.timeout), *(["--experts"] if a.experts else []),
               "--delta", a.delta, "--full-check-every", str(a.full_check_every), "--seed", str(a.seed),
               *(["--inject"] if a.inject else [])]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env={
            **os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        key = (role, rank)
        self.procs[key] = proc
        self.ready[key] = asyncio.Event()
        self.readers[key] = asyncio.ensure_future(self._read(key, proc))

    async def _read(self, key, proc) -> None:
        last = None
        async for line in proc.stdout:
            e = json.loads(line)
            if e["event"] == "ready":
                self.ready[key].set()
            elif e["event"] == "failed":
                self.failures.append(e["t"])
                self.aborts.append((e["version"], e.get("text", "")))
            elif e["event"] == "corrupted":
                self.corruptions.append(e)
            elif e["event"] == "flip":
                self.flips.append({"receiver": key[1], "name": e["name"], "version": e["version"], "gone": None})
            elif e["event"] == "flip_gone":
                for f in self.flips:
                    if f["receiver"] == key[1] and f["name"] == e["name"] and f["gone"] is None:
                        f["gone"] = e["version"]
            elif e["event"] == "state":
                self.states[f"{key[0]}/{key[1]}"] = e
                self.changed.set()
            elif e["event"] == "committed":
                self.pushed[key[1]] = e["version"]
                self.delta_rows += e.get("deltas", 0)
                self.committed_pushes += 1
                self.changed.set()
            elif e["event"] == "check":
                v = e["version"]
                if not e["ok"]:
                    self.half_applied.append(f"{key} serves v{v} with other bytes ({e.get('bad')}; trial {self.trial})")
                if last is not None and v is not None and v < last or last is not None and v is None:
                    self.rollbacks.append(f"{key} went from v{last} to v{v}")
                if v is not None:
                    last = v
                    self.version[key[1]] = v
                    self.changed.set()

    def victims(self) -> list[list[tuple[str, int]]]:
        """What a trial may kill: one process; with ``--experts``, also a sender and a receiver at once."""
        one = [[key] for key in self.roles()]
        if not self.args.experts:
            return one
        return one + [[("sender", s), ("receiver", r)] for s in range(self.args.senders)
                      for r in range(self.args.receivers)]

    async def kill_and_restart(self, keys: list[tuple[str, int]]) -> float:
        for key in keys:
            self.procs[key].send_signal(signal.SIGKILL)
        for role, rank in keys:
            await self.procs[(role, rank)].wait()
            await self.readers[(role, rank)]
            (self.version if role == "receiver" else self.pushed).pop(rank, None)  # a new process starts with none
            for f in self.flips:  # (its flipped values died with it)
                if role == "receiver" and f["receiver"] == rank and f["gone"] is None:
                    f["gone"] = "killed"
        for role, rank in keys:
            await self.start(role, rank)
        for key in keys:
            await self.ready[key].wait()
        return time.monotonic()

    async def until(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return predicate()
        return True

    def all_past(self, floor: int, sender: int | None = None) -> bool:
        """Every receiver serves a version newer than ``floor`` (and ``sender`` took part in one)."""
        if sender is not None and self.pushed.get(sender, -1) <= floor:
            return False
        return len(self.version) == self.args.receivers and min(self.version.values()) > floor

    async def diagnose(self) -> dict:
        """What a stuck cluster looks like: the controller's status and what the children last said."""
        from weightsync.roles.daemon import request
        from weightsync.wire import messages as m

        try:
            status = (await request(self.addr, m.StatusRequest(True), timeout_s=5.0)).body.status
            status = {k: status.get(k) for k in ("peers", "plan", "plan_error", "committed_version", "round",
                                                 "pending_pushes")} | {
                "last_rounds": [(r["version"], r["reason"]) for r in status.get("rounds", [])[-3:]]}
        except Exception as exc:  # the controller itself may be what is stuck
            status = {"unreachable": repr(exc)}
        for (role, _), proc in self.procs.items():
            if role != "controller" and proc.returncode is None:
                proc.send_signal(signal.SIGUSR1)
                proc.send_signal(signal.SIGUSR2)  # stacks go to stderr
        await self.until(lambda: len(self.states) >= self.args.senders + self.args.receivers, 5.0)
        return {"controller": status, "receivers": dict(self.version), "senders": dict(self.pushed),
                "workers": self.states}

    async def close(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        await asyncio.gather(*self.readers.values(), return_exceptions=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_matrix(args, checksum: str, trials: int, rng: random.Random, rows: list) -> None:
    cluster = Cluster(args, checksum)
    try:
        order = cluster.roles()
        if args.experts:  # as a launcher does: in any order (the controller first: workers need its address)
            order = order[:1] + rng.sample(order[1:], len(order) - 1)
        for role, rank in order:
            await cluster.start(role, rank)
        if not await cluster.until(lambda: cluster.all_past(0), args.resume_limit * 4):
            rows.append({"checksum": checksum, "start": "no round went through", "stuck": await cluster.diagnose()})
            return
        for _ in range(trials):
            floor = max(cluster.version.values())
            keys = rng.choice(cluster.victims())
            name = "+".join(f"{role}/{rank}" for role, rank in keys)
            cluster.trial = f"{len(rows)}: {name} killed after v{floor}"
            await asyncio.sleep(rng.uniform(0, args.max_delay))  # a random moment, often mid-round
            t_kill = time.monotonic()
            before = len(cluster.failures)
            t_ready = await cluster.kill_and_restart(keys)
            victim = next((rank for role, rank in keys if role == "sender"), None)
            resumed = await cluster.until(lambda: cluster.all_past(floor, victim), args.resume_limit)
            t_resumed = time.monotonic()
            surfaced = [t - t_kill for t in cluster.failures[before:] if t >= t_kill]
            rows.append({"checksum": checksum, "victim": name, "resumed": resumed,
                         "restart_s": t_ready - t_kill, "resume_after_restart_s": t_resumed - t_ready,
                         "resume_after_kill_s": t_resumed - t_kill,
                         "failure_surfaced_s": min(surfaced) if surfaced else None})
            if not resumed:
                rows[-1]["stuck"] = await cluster.diagnose()
                break  # the cluster is stuck: the remaining trials would measure nothing
    finally:
        rows.extend({"half_applied": h} for h in cluster.half_applied)
        rows.extend({"rollback": r} for r in cluster.rollbacks)
        rows.append({"pushes": cluster.committed_pushes, "delta_rows": cluster.delta_rows})
        if args.inject:
            rows.append({"injected": injected(cluster, max(cluster.version.values(), default=0))})
        await cluster.close()


def injected(cluster: Cluster, newest: int) -> dict:
    """``--inject``: what became of each corrupted push and each flipped value."""
    grace = 2 * cluster.args.full_check_every + 3
    out = {"corruptions": len(cluster.corruptions), "corruptions_caught": 0, "corruptions_missed": 0,
           "corruptions_aborted_otherwise": 0, "flips": len(cluster.flips), "flips_caught": 0,
           "flips_overwritten": 0, "flips_died": 0, "flips_missed": 0, "flips_pending": 0, "missed": []}
    corrupted = {c["version"] for c in cluster.corruptions}  # (their aborts name the corrupted row, not a flip)
    for c in cluster.corruptions:
        kind = ("missed" if c["outcome"] == "committed" else "caught" if c["row"] in c["outcome"]
                else "aborted_otherwise")
        out[f"corruptions_{kind}"] += 1
        if kind == "missed":
            out["missed"].append(c)
    for f in cluster.flips:
        if f["gone"] == "killed":
            out["flips_died"] += 1
        elif f["gone"] is None:
            late = newest - f["version"] > grace
            out["flips_missed" if late else "flips_pending"] += 1
            if late:
                out["missed"].append(f)
        elif any(f["version"] < v <= f["gone"] and v not in corrupted and f["name"] in why for v, why in cluster.aborts):
            out["flips_caught"] += 1
        else:
            out["flips_overwritten"] += 1
    return out


def summarize(rows: list, args) -> dict:
    trials = [r for r in rows if "victim" in r]
    resumed = [r for r in trials if r["resumed"]]
    after = [r["resume_after_restart_s"] for r in resumed]
    surfaced = [r["failure_surfaced_s"] for r in trials if r.get("failure_surfaced_s") is not None]
    limit = 2 * args.timeout + args.round_allowance
    return {
        "trials": len(trials),
        "half_applied": sum(1 for r in rows if "half_applied" in r),
        "rollbacks": sum(1 for r in rows if "rollback" in r),
        "resumed": len(resumed),
        "resumed_ratio": len(resumed) / len(trials) if trials else 0.0,
        "resumed_within_limit": sum(1 for s in after if s <= limit),
        "limit_s": limit,
        "resume_after_restart_median_s": statistics.median(after) if after else None,
        "resume_after_restart_max_s": max(after) if after else None,
        "resume_after_kill_median_s": statistics.median([r["resume_after_kill_s"] for r in resumed]) if resumed else None,
        "restart_median_s": statistics.median([r["restart_s"] for r in trials]) if trials else None,
        "failures_surfaced": len(surfaced),
        "failure_surfaced_median_s": statistics.median(surfaced) if surfaced else None,
        "victims": {v: sum(1 for r in trials if r["victim"] == v) for v in sorted({r["victim"] for r in trials})},
        "committed_pushes": sum(r.get("pushes", 0) for r in rows),
        "delta_rows": sum(r.get("delta_rows", 0) for r in rows),
        "problems": [r.get("half_applied") or r.get("rollback") for r in rows
                     if "half_applied" in r or "rollback" in r][:10],
        "stuck": [{"victim": r.get("victim", "start"), "checksum": r["checksum"], **r["stuck"]} for r in rows
                  if "stuck" in r],
        **({"injected": _added([r["injected"] for r in rows if "injected" in r])} if args.inject else {}),
    }


def _added(parts: list[dict]) -> dict:
    return {k: (sum((p[k] for p in parts), []) if k == "missed" else sum(p[k] for p in parts)) for k in parts[0]} if parts else {}


def ok(summary: dict) -> bool:
    inj = summary.get("injected")
    return (summary["half_applied"] == 0 and summary["rollbacks"] == 0 and summary["trials"] > 0 and not summary["stuck"]
            and summary["resumed_within_limit"] == summary["trials"]
            and (inj is None or (inj and not inj["missed"] and inj["corruptions_caught"] > 0 and inj["flips"] > 0)))


async def drive(args) -> dict:
    rng = random.Random(args.seed)
    rows: list = []
    modes = ["crc32", ""] if args.checksum == "both" else [args.checksum]
    for i, checksum in enumerate(modes):
        share = args.trials // len(modes) + (1 if i < args.trials % len(modes) else 0)
        await run_matrix(args, checksum, share, rng, rows)
    return summarize(rows, args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("verb", nargs="?", default="drive", choices=["drive", "child"])
    ap.add_argument("role", nargs="?", help="child only: controller, sender or receiver")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--checksum", default="both", help="crc32, '' (none) or both (half the trials each)")
    ap.add_argument("--heartbeat", type=float, default=0.1, help="controller heartbeat period (s)")
    ap.add_argument("--timeout", type=float, default=1.0, help="heartbeat timeout (s)")
    ap.add_argument("--round-allowance", type=float, default=0.5, help="one round and its plan, in the limit (s)")
    ap.add_argument("--resume-limit", type=float, default=20.0, help="give a trial up after this (s)")
    ap.add_argument("--max-delay", type=float, default=0.3, help="kill after a random delay up to this (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", action="store_true", help="expert-parallel senders; random start order, paired kills")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    ap.add_argument("--out", default="", help="also write the figures (JSON) to this file")
    ap.add_argument("--delta", default="", choices=["", "auto", "always"],
                    help="delta rounds (sparse versions: ~2%% of values change each); '': dense versions, auto")
    ap.add_argument("--full-check-every", type=int, default=8, help="the controller's full_check_every")
    ap.add_argument("--inject", action="store_true", help="with --delta: corrupt delta payloads, flip served values")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--addr", default="")
    args = ap.parse_args(argv)
    global SPARSE
    SPARSE = bool(args.delta)
    if args.inject and not args.delta:
        ap.error("--inject needs --delta (it corrupts delta payloads)")
    if args.verb == "child":
        child = {"controller": controller_child, "sender": sender_child, "receiver": receiver_child}[args.role]
        asyncio.run(child(args))
        return 0
    summary = asyncio.run(drive(args))
    summary["command"] = (f"bench/faults.py --trials {args.trials} --senders {args.senders} --receivers "
                          f"{args.receivers} --checksum '{args.checksum}' --timeout {args.timeout} --seed {args.seed}"
                          + (" --experts" if args.experts else "") + (f" --delta {args.delta}" if args.delta else "")
                          + (" --inject" if args.inject else ""))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    if not args.json:
        for key, value in summary.items():
            print(f"{key:32} {value}")
    print(json.dumps(summary) if args.json else ("PASS" if ok(summary) else "FAIL"))
    return 0 if ok(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
