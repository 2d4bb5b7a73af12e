"""More than one host: a controller, trainer ranks and inference ranks on "hosts" that are network
namespaces joined by 1 Gbit/s shaped links (tests/netns.py), M -> N over TCP with auth on.

    .venv/bin/python bench/cluster.py --json                         # the shaped-link M -> N table
    .venv/bin/python bench/cluster.py --cases tiny-dense --rounds 2  # what make test-hosts runs

How this works: five hosts, ``c`` (the controller), ``t0`` and ``t1`` (a trainer rank each, data
parallel: each holds the full bf16 state), ``i0`` and ``i1`` (inference ranks, tensor parallel over
both, in vLLM's fused layout; ``fp8`` cases in block FP8). Each process runs this file's ``child``
verb inside its host's namespace (``ip netns exec``), binds its host's address (198.18.0.x) with the
shared key, and reports JSON lines on stdout; the driver sends ``push V`` lines to the trainers. Per
case, in one run: the bound, from a raw TCP stream through the same shaped links (the bytes the
busiest link must carry, at the stream's rate); the planner's prediction (its model's makespan of the
installed tables, with that rate as its network bandwidth); the engine's rounds (begin -> commit
acknowledged, the controller's reports); each receiver's tensors checked against the trainer's after
every round (after its commit is acknowledged, so outside the timed round; the driver pushes the next
version once both checks are in. The partition trials check before the acknowledgement instead, since
their rounds follow each other at once). The plan's link classes and the transports the senders chose are reported (every pair
crosses hosts: NET and tcp). Needs root and iproute2 (``netns.available()``).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import pathlib
import signal
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from fleet import Fleet, each_line, emit, lines, print_tasks, until_terminated  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve()  # (its ``child`` verb is what each process runs)
HOSTS = ("c", "t0", "t1", "i0", "i1")
CONTROL_PORT, DATA_PORT, STREAM_PORT = 5555, 6000, 7000
MAPPING = "qwen2"


# --- children, inside a host's namespace -------------------------------------------------------------


def case_of(args):
    from mn_setup import Case

    return Case(model=args.model, senders=2, receivers=2, device="cpu", fp8=args.fp8)


async def controller_child(args, key: bytes) -> None:
    from weightsync.engine.plan import LinkModel, build_pieces, link_class, lower_bound, makespan
    from weightsync.roles import Controller, ControllerOptions

    link = LinkModel(net_bw=args.rate_bytes, per_transfer_s=2e-5)
    opts = ControllerOptions(heartbeat_s=args.heartbeat, timeout_s=args.timeout, auth_key=key, mapping=MAPPING,
                             link=link, round_timeout_s=60.0, delta="off",
                             full_check_every=0)  # dense rounds against the bound: every value changes each round
    report = lambda r: emit("round", version=r.version, ok=r.ok, seconds=r.seconds, culprit=r.culprit,  # noqa: E731
                            links={f"{s.sender}>{s.receiver}": s.nbytes for s in r.links}, reason=r.reason)
    async with Controller(f"tcp://{args.addr}:{CONTROL_PORT}", senders=2, receivers=2, options=opts,
                          on_round=report) as ctl:
        routing = await ctl.wait_ready()
        senders, receivers = ctl.membership.participants()
        pieces, _ = build_pieces(senders, receivers, mapping=MAPPING)
        emit("plan", plan_id=routing.plan_id, transfers=routing.transfer_count, nbytes=routing.nbytes,
             classes=sorted({link_class(s, r).name for s in senders for r in receivers}),
             transports=sorted({p.transport.kind for t in routing.senders.values() for p in t.peers}),
             hosts=sorted({p.transport.host for p in [*senders, *receivers]}),
             predicted_s=makespan(routing.senders, senders, receivers, link),
             model_bound_s=lower_bound(pieces, senders, receivers, link))
        await (await lines()).read()  # until the driver closes our stdin


async def sender_child(args, key: bytes) -> None:
    from mn_setup import Steps, full_tensor, model_shapes

    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import SenderOptions, WeightSender

    shapes = {p.name: p.shape for p in model_shapes(args.model)}
    tensors = {name: full_tensor(name, shape, 0, 0, "cpu") for name, shape in shapes.items()}
    steps = Steps()
    opts = SenderOptions(auth_key=key, transport_options=TransportOptions(bind_host=args.addr,
                                                                          tcp_user_timeout_s=3 * args.timeout))
    async with WeightSender(f"tcp://{args.controller}:{CONTROL_PORT}", tensors, rank=args.rank, options=opts) as s:
        emit("joined", rank=args.rank, host=s.transport_info.host)

        async def push(line: list[str]) -> None:
            version = int(line[1])

            def fill() -> None:  # (the trainer's step: in a thread, so this process keeps its heartbeats)
                for name, shape in shapes.items():
                    tensors[name].copy_(steps(name, shape, version, 0, "cpu"))
            await asyncio.to_thread(fill)
            try:
                await (await s.push(version))
                emit("pushed", version=version, ok=True)
            except Exception as exc:  # reported to the driver, which decides
                emit("pushed", version=version, ok=False, error=repr(exc))
        await each_line(push)


async def receiver_child(args, key: bytes) -> None:
    from mn_setup import Steps, mismatches, receiver_layout

    from weightsync.engine.transforms.layouts import allocate
    from weightsync.engine.transport import TransportOptions
    from weightsync.roles import ReceiverOptions, WeightReceiver

    case = case_of(args)
    layout = receiver_layout(case, args.rank)
    tensors, shards = allocate(layout, "cpu")
    opts = ReceiverOptions(auth_key=key, transport_options=TransportOptions(bind_host=args.addr, port=DATA_PORT,
                                                                            tcp_user_timeout_s=3 * args.timeout))

    async def check(version: int) -> None:
        bad = await asyncio.to_thread(mismatches, case, args.rank, tensors, layout, version, "cpu", steps)
        emit("applied", rank=args.rank, version=version, bad=bad)

    checks: set = set()
    steps = Steps()

    async def applied(version: int) -> None:
        if args.check == "inline":  # the commit ack waits for the check: no later round can swap it away
            await check(version)
        else:  # after the ack (outside the timed round): the driver pushes again only once it is reported
            task = asyncio.ensure_future(check(version))
            checks.add(task)
            task.add_done_callback(checks.discard)

    async with WeightReceiver(f"tcp://{args.controller}:{CONTROL_PORT}", tensors, rank=args.rank, shards=shards,
                              options=opts, on_update=applied) as r:
        emit("joined", rank=args.rank, host=r.transport_info.host)
        await (await lines()).read()


def broadcast_child(args) -> None:
    """The baseline: rank 0 (a trainer) broadcasts every full tensor to the inference ranks over gloo,
    tensor by tensor, as verl and slime do with NCCL; rank 0 reports the median round."""
    import os

    import torch.distributed as dist
    from mn_setup import full_tensor, model_shapes

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{args.peer}:{STREAM_PORT + 1}", rank=args.rank, world_size=3)
    shapes = {p.name: p.shape for p in model_shapes(args.model)}
    tensors = {n: full_tensor(n, s, 1, 0, "cpu") if args.rank == 0 else torch_empty(s) for n, s in shapes.items()}
    seconds = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors.values():
            dist.broadcast(t, src=0)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    if args.rank == 0:
        emit("broadcast", seconds=statistics.median(seconds[1:] or seconds))
    dist.destroy_process_group()


def torch_empty(shape):
    import torch

    return torch.empty(tuple(shape), dtype=torch.bfloat16)


def stream_child(args) -> None:
    """A raw TCP stream: the server counts what arrives, the client sends ``--nbytes`` and reports the rate."""
    import socket

    if args.role == "stream-server":
        with socket.create_server((args.addr, STREAM_PORT)) as srv:
            emit("listening")
            conn, _ = srv.accept()
            with conn:
                while conn.recv(1 << 20):
                    pass
        return
    chunk = memoryview(bytearray(1 << 20))
    with socket.create_connection((args.peer, STREAM_PORT)) as s:
        t0 = time.perf_counter()
        for _ in range(args.nbytes >> 20):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # (the server closes once it has read everything)
        emit("stream", seconds=time.perf_counter() - t0, nbytes=args.nbytes)


def child(args) -> None:
    import logging
    import os

    logging.basicConfig(level=os.environ.get("WEIGHTSYNC_LOG", "WARNING"), stream=sys.stderr,
                        format=f"%(relativeCreated)7.0f {args.role}/{args.rank} %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the roles without an event loop (below: with)
    if args.role.startswith("stream"):
        stream_child(args)
        return
    if args.role == "broadcast":
        broadcast_child(args)
        return
    key = pathlib.Path(args.key_file).read_bytes()

    async def with_dump(coro):  # SIGUSR1: every task's stack on stderr (a stuck child says where it waits)
        def dump() -> None:
            faulthandler.dump_traceback(all_threads=True)
            print_tasks()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
        await coro
    run = {"controller": controller_child, "sender": sender_child, "receiver": receiver_child}[args.role]
    asyncio.run(with_dump(run(args, key)))


# --- the driver ---------------------------------------------------------------------------------------


async def stream_rate(cluster, args) -> float:
    """Bytes/s of one raw TCP stream t0 -> i0 through the shaped links (the bound's rate)."""
    fleet = Fleet(SCRIPT, cluster, args, "")
    try:
        await fleet.start("server", "i0", "stream-server")
        await fleet.expect("listening")
        await fleet.start("client", "t0", "stream-client", "--peer", cluster.address("i0"), "--nbytes",
                          str(args.stream_mb << 20))
        (_, ev), = await fleet.expect("stream")
        return ev["nbytes"] / ev["seconds"]
    finally:
        await fleet.close()


async def broadcast(cluster, args) -> float:
    """The baseline's round: t0 broadcasts the full state to i0 and i1 (gloo over the same links)."""
    fleet = Fleet(SCRIPT, cluster, args, "")
    try:
        for rank, host in enumerate(("t0", "i0", "i1")):
            await fleet.start(f"rank/{rank}", host, "broadcast", "--rank", str(rank), "--peer", cluster.address("t0"),
                              "--rounds", str(args.rounds))
        (_, ev), = await fleet.expect("broadcast", timeout=600)
        return ev["seconds"]
    finally:
        await fleet.close()


async def run_case(cluster, args, key_file: str, model: str, fp8: bool, rate: float) -> dict:
    args.model_now = model
    extra = ["--fp8"] if fp8 else []
    fleet = Fleet(SCRIPT, cluster, args, key_file)
    try:
        await fleet.start("controller", "c", "controller", *extra)
        for r, host in enumerate(("t0", "t1")):
            await fleet.start(f"sender/{r}", host, "sender", "--rank", str(r), *extra)
        for r, host in enumerate(("i0", "i1")):
            await fleet.start(f"receiver/{r}", host, "receiver", "--rank", str(r), *extra)
        await fleet.expect("joined", 4)
        (_, plan), = await fleet.expect("plan")
        seconds, bad, links = [], {}, {}
        for version in range(1, args.rounds + 1):
            for r in range(2):
                fleet.say(f"sender/{r}", f"push {version}")
            (_, rnd), = await fleet.expect("round")
            applied = await fleet.expect("applied", 2)
            await fleet.expect("pushed", 2)
            if not rnd["ok"]:
                raise RuntimeError(f"round {version} failed: {rnd['reason']}")
            seconds.append(rnd["seconds"])
            links = rnd["links"]
            bad.update({name: ev["bad"] for name, ev in applied if ev["bad"]})
    finally:
        await fleet.close()
    per_link = {}
    for pair, nbytes in links.items():  # every pair crosses hosts: a sender's link out, a receiver's in
        s, r = pair.split(">")
        per_link[f"t{s}"] = per_link.get(f"t{s}", 0) + nbytes
        per_link[f"i{r}"] = per_link.get(f"i{r}", 0) + nbytes
    bound_s = max(per_link.values()) / rate
    engine_s = statistics.median(seconds[1:] or seconds)
    broadcast_s = await broadcast(cluster, args)
    return {"case": model + (" fp8" if fp8 else ""), "bytes": sum(links.values()), "transfers": plan["transfers"],
            "bound_s": round(bound_s, 4), "predicted_s": round(plan["predicted_s"], 4),
            "engine_s": round(engine_s, 4), "engine_over_bound": round(engine_s / bound_s, 3),
            "engine_over_predicted": round(engine_s / plan["predicted_s"], 3),
            "broadcast_s": round(broadcast_s, 4), "engine_over_broadcast": round(engine_s / broadcast_s, 3),
            "classes": plan["classes"], "transports": plan["transports"], "hosts": len(plan["hosts"]),
            "bit_exact": not bad, "mismatches": bad}


# --- partitions -------------------------------------------------------------------------------------

FAULTS = {  # kind -> (host, who may be blamed for a round it fails; "" is nobody)
    "trainer": ("t1", {"sender/1", ""}),
    "inference": ("i1", {"receiver/1", ""}),
    "controller": ("c", {"controller", ""}),
    "data": ("i1", {"receiver/1", ""}),  # its data port cut, the control plane up
    "slow": ("i0", {""}),  # the link's rate collapses for less than the timeout: no round may fail
    "flap": ("t0", {"sender/0", ""}),  # down and up, a few times, each shorter than the timeout
}


async def fault(cluster, kind: str, host: str, hold: float, rate: str, rng) -> None:
    """Apply one fault to ``host`` for ``hold`` seconds, then heal it (the durations are the experiment)."""
    if kind == "slow":
        cluster.shape(host, "1mbit")
        await asyncio.sleep(hold)
        cluster.shape(host, rate)
    elif kind == "data":
        cluster.drop_port(host, DATA_PORT)
        await asyncio.sleep(hold)
        cluster.undrop(host)
    elif kind == "flap":
        end = time.monotonic() + hold
        while time.monotonic() < end:
            cluster.cut(host)
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            cluster.heal(host)
            await asyncio.sleep(rng.uniform(0.05, 0.3))
    else:
        cluster.cut(host)
        await asyncio.sleep(hold)
        cluster.heal(host)


class Pusher:
    """Both trainers push version after version, each as soon as both reported the last; receivers'
    applied versions and their checks are kept."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.version = 0
        self.applied: dict[str, list[int]] = {"receiver/0": [], "receiver/1": []}
        self.half_applied: list[str] = []
        self.rounds: list[tuple[float, dict]] = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self.version += 1
            for r in range(2):
                self.fleet.say(f"sender/{r}", f"push {self.version}")
            await self.fleet.expect("pushed", 2, timeout=150)  # (the round timeout is 60 s)
            self.collect()

    def collect(self) -> None:
        keep = []
        for name, ev in self.fleet.backlog:
            if ev["event"] == "applied":
                self.applied[name].append(ev["version"])
                if ev["bad"]:
                    self.half_applied.append(f"{name} v{ev['version']}: {ev['bad'][:3]}")
            elif ev["event"] == "round":
                self.rounds.append((time.monotonic(), ev))
            else:
                keep.append((name, ev))
        self.fleet.backlog[:] = keep

    async def applied_after(self, version: int, timeout: float) -> None:
        """Until every receiver has applied a version above ``version``."""
        deadline = time.monotonic() + timeout
        while any(max(v, default=0) <= version for v in self.applied.values()):
            if self.task.done():  # (the pushes stopped: say why, rather than wait out the deadline)
                raise RuntimeError(f"the pusher stopped at v{self.version}") from self.task.exception()
            if time.monotonic() > deadline:
                self.fleet.dump()
                raise asyncio.TimeoutError
            await self.fleet.pump()
            self.collect()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def partition_trials(cluster, args, key_file: str) -> dict:
    """``--trials`` faults, each at a random moment of continuous rounds, for a random 0.2-3x the
    heartbeat timeout (the slow link: 0.2-0.8x), then healed; each checked for half-applied versions,
    rollbacks, blame, and rounds resumed within 2x the timeout plus one round of the heal. The members
    run ``--heartbeat`` and ``--timeout`` as given, data connections TCP_USER_TIMEOUT at 3x the timeout
    (a collapsed link keeps bytes unacknowledged that long without losing them), the control plane
    marked CS6 and scheduled first by the links."""
    import random

    rng = random.Random(args.seed)
    args.model_now = args.model
    fleet = Fleet(SCRIPT, cluster, args, key_file)
    rows = []
    try:
        await fleet.start("controller", "c", "controller")
        for r, host in enumerate(("t0", "t1")):
            await fleet.start(f"sender/{r}", host, "sender", "--rank", str(r))
        for r, host in enumerate(("i0", "i1")):
            await fleet.start(f"receiver/{r}", host, "receiver", "--rank", str(r), "--check", "inline")
        await fleet.expect("joined", 4)
        await fleet.expect("plan")
        pusher = Pusher(fleet)
        await pusher.applied_after(0, 60)
        for trial in range(args.trials):
            kind = rng.choice(args.faults.split(","))
            host, blamable = FAULTS[kind]
            hold = args.timeout * (rng.uniform(0.2, 0.8) if kind == "slow" else rng.uniform(0.2, 3.0))
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # a random moment of the rounds (not synchronisation)
            start = time.monotonic()
            await fault(cluster, kind, host, hold, args.rate, rng)
            healed, at_heal = time.monotonic(), pusher.version
            limit = 2 * args.timeout + args.round_allowance
            try:
                await pusher.applied_after(at_heal, limit + 60)
                resumed_s = time.monotonic() - healed
            except asyncio.TimeoutError:
                resumed_s = None
            failed = [ev for t, ev in pusher.rounds if t >= start and not ev["ok"]]
            wrong = [f"v{ev['version']}: {ev['culprit']} ({ev['reason'][:120]})" for ev in failed
                     if ev["culprit"] not in blamable]
            rows.append({"trial": trial, "fault": kind, "host": host, "hold_s": round(hold, 3),
                         "resumed_s": None if resumed_s is None else round(resumed_s, 3),
                         "in_time": resumed_s is not None and resumed_s <= limit, "aborted": len(failed),
                         "wrong_blame": wrong})
            pusher.rounds.clear()
        await pusher.stop()
        rollbacks = [name for name, vs in pusher.applied.items() if any(b < a for a, b in zip(vs, vs[1:]))]
        half = pusher.half_applied
    finally:
        await fleet.close()
    return {"trials": len(rows), "half_applied": len(half), "rollbacks": len(rollbacks),
            "wrong_blame": sum(len(r["wrong_blame"]) for r in rows), "resumed_in_time": sum(r["in_time"] for r in rows),
            "resume_max_s": max((r["resumed_s"] or float("inf") for r in rows), default=0.0),
            "limit_s": 2 * args.timeout + args.round_allowance, "by_fault": {k: sum(r["fault"] == k for r in rows)
                                                                             for k in FAULTS},
            "problems": [r for r in rows if r["wrong_blame"] or not r["in_time"]][:10] + half[:10]}


async def drive(args) -> dict:
    import netns

    why = netns.available()
    if why is not None:
        raise SystemExit(f"bench/cluster.py: {why}")
    with tempfile.TemporaryDirectory() as tmp, netns.Cluster(HOSTS, rate=args.rate) as cluster:
        key_file = str(pathlib.Path(tmp) / "key")
        pathlib.Path(key_file).write_bytes(__import__("os").urandom(32))
        rate = await stream_rate(cluster, args)
        args.rate_bytes = rate
        if args.partition:
            return {"link": args.rate, "stream_gbit_s": round(rate * 8 / 1e9, 3),
                    **await partition_trials(cluster, args, key_file),
                    "heartbeat_s": args.heartbeat, "timeout_s": args.timeout,
                    "command": "bench/cluster.py " + " ".join(sys.argv[1:])}
        rows = []
        for spec in args.cases.split(","):
            model, _, fp8 = spec.partition(" ")
            rows.append(await run_case(cluster, args, key_file, model, fp8 == "fp8", rate))
    return {"link": args.rate, "stream_gbit_s": round(rate * 8 / 1e9, 3), "rows": rows,
            "bit_exact": all(r["bit_exact"] for r in rows),
            "worst_over_bound": max(r["engine_over_bound"] for r in rows),
            "worst_over_predicted": max(max(r["engine_over_predicted"], 1 / r["engine_over_predicted"]) for r in rows),
            "command": "bench/cluster.py " + " ".join(sys.argv[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("verb", nargs="?", default="drive", choices=["drive", "child"])
    ap.add_argument("role", nargs="?", help="child only: controller, sender, receiver, stream-server, stream-client")
    ap.add_argument("--cases", default="small-dense,small-moe,small-dense fp8",
                    help="comma-separated models, each optionally followed by ' fp8' (FP8 receivers)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", default="1gbit", help="each host link's rate (tc htb; control first)")
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--stream-mb", type=int, default=96)
    ap.add_argument("--partition", action="store_true", help="the partition matrix instead of the M -> N table")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--faults", default=",".join(FAULTS), help="the kinds of fault to draw from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round-allowance", type=float, default=1.0, help="one round and its plan, in the limit (s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="")
    # child options
    ap.add_argument("--addr", default="")
    ap.add_argument("--controller", default="")
    ap.add_argument("--peer", default="")
    ap.add_argument("--key-file", default="")
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--nbytes", type=int, default=0)
    ap.add_argument("--rate-bytes", type=float, default=125e6)
    ap.add_argument("--check", default="after", choices=["after", "inline"],
                    help="receivers check each version after acknowledging its commit (the table: the driver "
                         "waits for the check before the next push), or before (partitions: rounds follow "
                         "each other at once)")
    args = ap.parse_args()
    args.model_now = args.model
    if args.verb == "child":
        child(args)
        return 0
    try:
        result = asyncio.run(until_terminated(drive(args)))
    except asyncio.CancelledError:
        print("bench/cluster.py: terminated (stacks above)", file=sys.stderr)
        return 143
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json or args.partition:
        print(json.dumps(result))
    else:
        for row in result["rows"]:
            print(f"{row['case']:>18}: bound {row['bound_s']:.3f} s, predicted {row['predicted_s']:.3f} s, engine "
                  f"{row['engine_s']:.3f} s ({row['engine_over_bound']}x the bound), broadcast {row['broadcast_s']:.3f} s, "
                  f"bit-exact {row['bit_exact']}")
    if args.partition:
        return 0 if not (result["half_applied"] or result["rollbacks"] or result["wrong_blame"]) \
            and result["resumed_in_time"] == result["trials"] else 1
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
