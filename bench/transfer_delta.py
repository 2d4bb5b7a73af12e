"""Delta rounds against dense rounds, side by side: the same model, the same steps, over loopback TCP.

    .venv/bin/python bench/transfer_delta.py --out docs/results/transfer_delta_cpu.json   # 512 MB, ~5 min

How this works: four clusters run at once, each a controller (here), one sender process and one
two-slot receiver process over TCP: ``dense`` (``delta="off"``, the default checks: every 8th round
checked end to end), ``dense-unchecked`` (``delta="off"``, ``full_check_every=0``), ``auto`` and
``always`` (the defaults but for ``delta``). Every round, each sender applies the same seeded synthetic
step to its bf16 model (``--mb`` of tensors shaped like a transformer's: large matrices and small
vectors): a fraction of the values, spread uniformly, move by one or two units in the last place. Then
the four push the version one after another (one cluster moves bytes at a time, in an order drawn
afresh each round, seeded by the version, so that none always follows the same one), and the round's
seconds (begin -> commit acknowledged, as the controller times it) and wire bytes are recorded. After
every round each receiver's CRC-32 over its served tensors (on GPUs: the ``fp64`` fingerprint of each
tensor) must equal its sender's (``bit_exact``).
Fractions 0.1, 1, 3, 10, 30 and 100%, ``--rounds`` rounds each, after one whole round per cluster and
``--warmup`` rounds at 1% (reported apart: there ``auto`` measures the link, with a dense round, and
then the encoder, with delta rounds, before it settles). ``--rate 1gbit`` runs it all on a link of that
rate (a network namespace whose loopback is shaped: tests/netns.py; root).

``--real-steps N``: instead of synthetic fractions, every round follows one AdamW step (lr 1e-6, fp32
master weights, random tokens) of a ~125M-parameter Qwen2 in each sender (bench/delta_codec.py's model),
whose bf16 casts are what the senders push; per step the served values changed, wire against whole bytes
and each cluster's time, and ``bit_exact_steps`` (with ``--out``, a PNG of them beside the JSON).

``--trace DIR``: the ``always`` and ``dense`` clusters' sender and receiver run under torch.profiler,
each round marked ``round vN``; their Chrome traces in DIR (``bench/diagnostics/trace_rounds.py`` lists
a round's GPU work by stream). ``--profile DIR``: the same four processes under cProfile instead while
their rounds after the first run, their hottest functions in DIR (the host's work per round, on each
event loop's thread: CPU rows are encoded and applied on worker threads, timed in the round's stages).

Figures (the last line with ``--json``): ``bytes_per_changed_value`` (wire bytes over changed values,
``always`` at 1%), ``bytes_ratio_1pct`` (whole over wire bytes at 1%), ``time_ratio_tcp_1pct`` (dense
round over ``auto`` round at 1%), ``auto_worst_slowdown`` / ``always_worst_slowdown`` (the worst
fraction's median of ``auto`` / dense and ``always`` / dense round seconds; beside them
``same_work_worst_spread``, the worst fraction's median ratio of the two dense clusters on rounds both
ran unchecked, identical work: how far apart this machine puts two identical rounds, an A/A check, and
per case ``auto_whole_rounds`` of ``rounds``, those in which ``auto`` sent every byte), ``verify_overhead_ratio``
(the dense round with the default checks over the unchecked one, weighed over a check period:
``verify_overhead``; ``checked_round_over_unchecked`` beside it) and ``bit_exact``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import multiprocessing as mp
import pathlib
import random
import statistics
import sys
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MiB = 1 << 20
FRACTIONS = (0.001, 0.01, 0.03, 0.1, 0.3, 1.0)
CLUSTERS = {"dense": dict(delta="off"), "dense-unchecked": dict(delta="off", full_check_every=0),
            "auto": dict(delta="auto"), "always": dict(delta="always")}


def layout(size: tuple[int, int]) -> dict[str, tuple[int, ...]]:
    """``model``'s names and shapes, without making it: ``size`` is (MiB, experts)."""
    mb, experts = size
    out, layer, nbytes = {}, 0, 0
    while nbytes < mb * MiB:
        if experts:  # an MoE layer: each expert's gate, up and down projections, 512 x 128 each
            for e in range(experts):
                for w in ("gate", "up", "down"):
                    out[f"layers.{layer}.experts.{e}.{w}"] = (512, 128) if w != "down" else (128, 512)
            nbytes += 2 * experts * 3 * 512 * 128
        else:
            for i in range(4):
                out[f"layers.{layer}.w{i}"] = (1024, 4096)
            nbytes += 2 * 4 * 1024 * 4096
        for i in range(2):
            out[f"layers.{layer}.norm{i}"] = (4096,)
        nbytes += 2 * 2 * 4096
        layer += 1
    return out


def model(size: tuple[int, int], device: str = "cpu") -> dict[str, torch.Tensor]:
    """``size`` (MiB, experts) of bf16: per layer four 1024 x 4096 matrices (or each expert's three
    512 x 128 projections) and two 4096 vectors, as many layers as fit
    (drawn on ``device``, seeded: the same bytes in every process that draws them there)."""
    g = torch.Generator(device=device).manual_seed(0)
    return {name: (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16) if len(shape) > 1
            else torch.ones(shape, dtype=torch.bfloat16, device=device) for name, shape in layout(size).items()}


def step(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Move about ``fraction`` of every tensor's values by +-1 or +-2 units in the last place (seeded,
    drawn on the tensors' device, so every cluster's sender, on the same kind of device, makes the same
    step; on a GPU a full step of gigabytes takes milliseconds, not the CPU's seconds):
    ``fraction * numel`` positions drawn with replacement (one drawn twice moves twice), all at 1."""
    generators: dict[torch.device, torch.Generator] = {}
    for t in tensors.values():
        g = generators.setdefault(t.device, torch.Generator(device=t.device).manual_seed(seed))
        bits = t.view(torch.int16).reshape(-1)
        count = int(bits.numel() * fraction)
        picked = (torch.arange(count, device=t.device) if fraction >= 1 else
                  torch.randint(0, bits.numel(), (count,), generator=g, device=t.device))
        moves = torch.randint(1, 3, (count,), generator=g, dtype=torch.int16, device=t.device)
        signs = torch.randint(0, 2, (count,), generator=g, dtype=torch.int16, device=t.device) * 2 - 1
        bits.index_add_(0, picked, moves * signs)


class Trainer:
    """``--real-steps``: a Qwen2 of ~125M parameters (bench/delta_codec.py's) with fp32 master weights and
    AdamW at lr 1e-6 on random tokens; ``served`` holds the bf16 casts that inference serves."""

    def __init__(self, lr: float = 1e-6) -> None:
        from delta_codec import model

        self.net = model(768, 12, 32000)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr)
        self.served = {n: p.detach().to(torch.bfloat16) for n, p in self.net.named_parameters()}

    @staticmethod
    def shapes() -> dict[str, tuple]:
        from delta_codec import model

        with torch.device("meta"):
            return {n: tuple(p.shape) for n, p in model(768, 12, 32000).named_parameters()}

    def step(self, seed: int) -> int:
        """One optimizer step on seeded random tokens; the served values it changed."""
        ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(seed))
        self.net(ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        changed = 0
        for n, p in self.net.named_parameters():
            new = p.detach().to(torch.bfloat16)
            changed += int((new.view(torch.int16) != self.served[n].view(torch.int16)).sum())
            self.served[n].copy_(new)
        return changed


def crc(tensors: dict[str, torch.Tensor]):
    """What both ends compare after a round: CRC-32 of every tensor's bytes on CPUs; on GPUs the ``fp64``
    fingerprint of each (one launch: a CRC of gigabytes on the host would take seconds a round)."""
    names = sorted(tensors)
    if any(tensors[n].is_cuda for n in names):
        from weightsync.engine.datapath.checksums import fp64_many

        return fp64_many([tensors[n].reshape(-1) for n in names])
    value = 0
    for name in names:
        value = zlib.crc32(tensors[name].view(torch.uint8).reshape(-1).cpu().numpy(), value)
    return value


def _run(main, trace: str) -> None:
    """``main()`` on a new loop; with ``trace``, under torch.profiler, its Chrome trace written there
    (bench/transfer_gpu.py's; rounds are marked ``round vN`` for bench/diagnostics/trace_rounds.py)."""
    if trace.endswith(".txt"):  # (--profile: cProfile while rounds run, ``_round``)
        from transfer_gpu import write_profile

        global PROFILE
        PROFILE = cProfile.Profile()
        asyncio.run(main())
        write_profile(PROFILE, trace)
    elif trace:
        from transfer_gpu import _profiled

        _profiled(main, "", trace=trace)
    else:
        asyncio.run(main())


PROFILE: "cProfile.Profile | None" = None  # (--profile: this process's, on while its rounds after the first run)


@contextlib.contextmanager
def _round(version: int):
    """A round of this process: marked for torch.profiler (no cost unless traced); under ``PROFILE``."""
    on = PROFILE is not None and version > 1
    with torch.profiler.record_function(f"round v{version}"):
        if on:
            PROFILE.enable()
        try:
            yield
        finally:
            if on:
                PROFILE.disable()


def _sender(addr: str, size: tuple[int, int], orders, done, where: tuple[str, str], real: bool = False, trace: str = "") -> None:
    from weightsync.engine.aio import install_uvloop
    from weightsync.roles import SenderOptions, WeightSender

    install_uvloop()

    async def main():
        transport, device = where
        trainer = Trainer() if real else None
        tensors = trainer.served if real else model(size, device)
        loop = asyncio.get_running_loop()
        async with WeightSender(addr, tensors, rank=0, options=SenderOptions(transport=transport)) as sender:
            while (order := await loop.run_in_executor(None, orders.recv)) is not None:
                version, fraction, seed = order
                stepped = trainer.step(seed) if real and fraction else 0
                if fraction and not real:
                    step(tensors, fraction, seed)
                    if device.startswith("cuda"):  # (the step's kernels done: the round times the transfer alone)
                        torch.cuda.synchronize(device)
                with _round(version):
                    await (await sender.push(version))
                d = sender.last_delta
                done.send({"crc": crc(tensors), "rows": d.rows if d else 0, "changed": d.changed if d else 0,
                           "whole_bytes": d.whole_bytes if d else 0, "stepped": stepped,
                           "values": sum(t.numel() for t in tensors.values())})

    _run(main, trace)


def _receiver(addr: str, size: tuple[int, int], orders, done, where: tuple[str, str], real: bool = False, trace: str = "") -> None:
    from weightsync.engine.aio import install_uvloop
    from weightsync.roles import ReceiverOptions, WeightReceiver

    install_uvloop()

    async def main():
        transport, device = where
        shapes = Trainer.shapes() if real else layout(size)
        tensors = {k: torch.zeros(shape, dtype=torch.bfloat16, device=device) for k, shape in shapes.items()}
        loop = asyncio.get_running_loop()
        async with WeightReceiver(addr, tensors, rank=0, options=ReceiverOptions(transport=transport)) as receiver:
            while (version := await loop.run_in_executor(None, orders.recv)) is not None:
                with _round(version):
                    await receiver.wait_for(version)
                done.send(crc(receiver.state_dict()))

    _run(main, trace)


class Cluster:
    """One controller here, a sender and a receiver process."""

    def __init__(self, name: str, size: tuple[int, int], gpus: str = "", real: bool = False, trace: str = "",
                 suffix: str = "json") -> None:
        self.name, self.size, self.real, self.trace, self.suffix = name, size, real, trace, suffix
        self.ends = ((("tcp", "cpu"), ("tcp", "cpu")) if not gpus else
                     (("cuda_ipc", "cuda:0"), ("cuda_ipc", "cuda:1" if gpus == "across" else "cuda:0")))

    async def __aenter__(self) -> "Cluster":
        from weightsync.roles import Controller, ControllerOptions

        self.ctl = await Controller(senders=1, receivers=1,
                                    options=ControllerOptions(timeout_s=60.0, **CLUSTERS[self.name])).__aenter__()
        ctx = mp.get_context("spawn")
        self.pipes = [ctx.Pipe() for _ in range(4)]
        (s_in, s_out), (s_done_r, s_done_w), (r_in, r_out), (r_done_r, r_done_w) = self.pipes
        self.to_sender, self.from_sender, self.to_receiver, self.from_receiver = s_out, s_done_r, r_out, r_done_r
        traces = [f"{self.trace}/{end}_{self.name}.{self.suffix}" if self.trace else "" for end in ("sender", "receiver")]
        self.procs = [ctx.Process(target=_sender, args=(self.ctl.address, self.size, s_in, s_done_w, self.ends[0], self.real,
                                                        traces[0])),
                      ctx.Process(target=_receiver, args=(self.ctl.address, self.size, r_in, r_done_w, self.ends[1], self.real,
                                                          traces[1]))]
        for p in self.procs:
            p.start()
        return self

    async def round(self, version: int, fraction: float, seed: int) -> dict:
        loop = asyncio.get_running_loop()
        self.to_sender.send((version, fraction, seed))
        self.to_receiver.send(version)
        report = await asyncio.wait_for(self.ctl.wait_round(version), 600)
        sent = await loop.run_in_executor(None, self.from_sender.recv)
        served = await loop.run_in_executor(None, self.from_receiver.recv)
        return {"seconds": report.seconds, "bytes": report.nbytes, "bit_exact": sent["crc"] == served,
                "checked": bool(report.checksum),
                "stages": {k: round(v, 5) for k, v in report.stages.items()},
                **{k: sent[k] for k in ("rows", "changed", "whole_bytes", "stepped", "values")}}

    async def __aexit__(self, *exc) -> None:
        self.to_sender.send(None)
        self.to_receiver.send(None)
        for p in self.procs:
            p.join(120)
        await self.ctl.__aexit__(*exc)


def verify_overhead(rows: list) -> dict:
    """``verify_overhead_ratio``: the dense round with the product's checks over the unchecked one, over a
    whole check period (``ControllerOptions.full_check_every`` rounds, one of them checked end to end):
    ((N - 1) x the dense cluster's unchecked rounds + its checked ones) / N over the unchecked cluster's
    rounds, means. A plain mean over a few counted rounds holds one checked round or none, by chance;
    this weighs them as the period does. Without a checked round counted: the plain means."""
    from weightsync.roles import ControllerOptions

    every = ControllerOptions().full_check_every
    checked = [r["dense"]["seconds"] for r in rows if r["dense"]["checked"]]
    plain = [r["dense"]["seconds"] for r in rows if not r["dense"]["checked"]]
    unchecked = statistics.mean(r["dense-unchecked"]["seconds"] for r in rows)
    if not checked or not plain or not every:
        return {"verify_overhead_ratio": statistics.mean(r["dense"]["seconds"] for r in rows) / unchecked,
                "checked_rounds": len(checked)}
    period = ((every - 1) * statistics.mean(plain) + statistics.mean(checked)) / every
    return {"verify_overhead_ratio": period / unchecked, "checked_rounds": len(checked),
            "checked_round_over_unchecked": statistics.mean(checked) / unchecked}


def drawn_order(names: list[str], version: int) -> list[str]:
    """The clusters' order in round ``version``: a permutation drawn from the version (seeded), so each
    takes every place and follows every other about equally often (a cluster that follows the ``always``
    one, which loads the CPU for up to a second, is not always the same one; a rotation would keep each
    cluster's predecessor fixed)."""
    order = list(names)
    random.Random(version).shuffle(order)
    return order


async def run(size: tuple[int, int], rounds: int, fractions: tuple[float, ...], warmup: int, gpus: str = "", trace: str = "",
              profile: bool = False) -> dict:
    if trace:
        pathlib.Path(trace).mkdir(parents=True, exist_ok=True)
    clusters = {name: Cluster(name, size, gpus, trace=trace if name in ("always", "dense") else "",
                              suffix="txt" if profile else "json") for name in CLUSTERS}
    rows, warmups = [], []
    for c in clusters.values():
        await c.__aenter__()
    try:
        await asyncio.gather(*(c.ctl.wait_ready() for c in clusters.values()))
        whole = {name: await c.round(1, 0.0, 0) for name, c in clusters.items()}
        version = 1
        for _ in range(warmup):  # (auto measures the link, then the encoder: excluded from the cases)
            version += 1
            warm = {name: await c.round(version, 0.01, seed=version) for name, c in clusters.items()}
            warmups.append({"version": version, **{n: round(w["seconds"], 4) for n, w in warm.items()},
                            "bit_exact": all(w["bit_exact"] for w in warm.values())})
        for fraction in fractions:
            for r in range(rounds):
                version += 1
                row = {"fraction": fraction, "version": version}
                for name in drawn_order(list(clusters), version):
                    row[name] = await clusters[name].round(version, fraction, seed=version)
                rows.append(row)
                print(json.dumps({"fraction": fraction, **{n: round(row[n]["seconds"], 4) for n in clusters},
                                  "auto_bytes": row["auto"]["bytes"], "always_stages": row["always"]["stages"],
                                  "dense_stages": row["dense"]["stages"], "auto_stages": row["auto"]["stages"]}), flush=True)
    finally:
        for c in clusters.values():
            await c.__aexit__(None, None, None)
    result = summarize(rows, whole, size)
    result["warmup_rounds"] = warmups
    result["bit_exact"] = result["bit_exact"] and all(w["bit_exact"] for w in warmups)
    return result


async def run_real(steps: int, warmup: int) -> dict:
    """``--real-steps``: every round follows one optimizer step of ``Trainer`` (the first ``warmup``
    not counted); per step the served values it changed, wire against whole bytes, each cluster's time."""
    clusters = {name: Cluster(name, 0, real=True) for name in CLUSTERS}
    rows = []
    for c in clusters.values():
        await c.__aenter__()
    try:
        await asyncio.gather(*(c.ctl.wait_ready() for c in clusters.values()))
        whole = {name: await c.round(1, 0.0, 0) for name, c in clusters.items()}
        for version in range(2, 2 + warmup + steps):
            row = {"version": version, "counted": version >= 2 + warmup}
            for name, c in clusters.items():
                row[name] = await c.round(version, 1.0, seed=version)
            rows.append(row)
            print(json.dumps({"version": version, **{n: round(row[n]["seconds"], 4) for n in clusters},
                              "changed": row["always"]["stepped"] / row["always"]["values"],
                              "always_bytes": row["always"]["bytes"]}), flush=True)
    finally:
        for c in clusters.values():
            await c.__aexit__(None, None, None)
    total = whole["dense"]["bytes"]
    per_step = [{"version": r["version"], "counted": r["counted"],
                 "changed_fraction": round(r["always"]["stepped"] / r["always"]["values"], 5),
                 "whole_over_wire": round(total / r["always"]["bytes"], 2),
                 "bytes_per_changed_value": round((r["always"]["bytes"] - (total - r["always"]["whole_bytes"]))
                                                  / max(1, r["always"]["changed"]), 3),
                 **{f"{n}_s": round(r[n]["seconds"], 4) for n in CLUSTERS},
                 "bit_exact": all(r[n]["bit_exact"] for n in CLUSTERS)} for r in rows]
    counted = [x for x in per_step if x["counted"]]
    return {"model": "Qwen2 125M (bench/delta_codec.py), fp32 master weights, AdamW lr 1e-6, bf16 served",
            "model_bytes": total, "steps": per_step,
            "bit_exact_steps": sum(x["bit_exact"] for x in per_step), "total_steps": len(per_step),
            "whole_over_wire_median": statistics.median(x["whole_over_wire"] for x in counted),
            "dense_over_auto_median": statistics.median(x["dense_s"] / x["auto_s"] for x in counted),
            "dense_over_always_median": statistics.median(x["dense_s"] / x["always_s"] for x in counted),
            "bit_exact": all(x["bit_exact"] for x in per_step) and all(w["bit_exact"] for w in whole.values())}


def summarize(rows: list[dict], whole: dict, size: tuple[int, int]) -> dict:
    def med(fraction, name, key="seconds"):
        return statistics.median(r[name][key] for r in rows if r["fraction"] == fraction)

    def ratio(fraction, a, b):
        return statistics.median(r[a]["seconds"] / r[b]["seconds"] for r in rows if r["fraction"] == fraction)

    def same_work(fraction):  # (A/A: the two dense clusters on rounds both ran unchecked, identical work)
        pairs = [r["dense-unchecked"]["seconds"] / r["dense"]["seconds"] for r in rows
                 if r["fraction"] == fraction and not r["dense"]["checked"]]
        return statistics.median(pairs) if pairs else None

    fractions = sorted({r["fraction"] for r in rows})
    total = whole["dense"]["bytes"]
    at1 = [r for r in rows if r["fraction"] == 0.01]
    cases = [{"fraction": f, "dense_s": med(f, "dense"), "dense_unchecked_s": med(f, "dense-unchecked"),
              "auto_s": med(f, "auto"), "always_s": med(f, "always"), "auto_bytes": med(f, "auto", "bytes"),
              "always_bytes": med(f, "always", "bytes"), "auto_over_dense": ratio(f, "auto", "dense"),
              "always_over_dense": ratio(f, "always", "dense"), "whole_over_always_bytes": total / med(f, "always", "bytes"),
              "same_work_ratio": same_work(f),
              "auto_whole_rounds": sum(r["auto"]["bytes"] >= total for r in rows if r["fraction"] == f),
              "rounds": sum(r["fraction"] == f for r in rows)}
             for f in fractions]
    spreads = [max(c["same_work_ratio"], 1 / c["same_work_ratio"]) for c in cases if c["same_work_ratio"]]
    return {
        "model_bytes": total, "tensors": len(layout(size)), "cases": cases,
        "bytes_per_changed_value": (statistics.median((r["always"]["bytes"] - (total - r["always"]["whole_bytes"]))
                                                      / max(1, r["always"]["changed"]) for r in at1) if at1 else None),
        "bytes_ratio_1pct": total / statistics.median(r["auto"]["bytes"] for r in at1) if at1 else None,
        "time_ratio_tcp_1pct": statistics.median(r["dense"]["seconds"] / r["auto"]["seconds"] for r in at1) if at1 else None,
        "auto_worst_slowdown": max(c["auto_over_dense"] for c in cases),
        "always_worst_slowdown": max(c["always_over_dense"] for c in cases),
        "same_work_worst_spread": max(spreads) if spreads else None,
        **verify_overhead(rows),
        "bit_exact": all(r[n]["bit_exact"] for r in rows for n in CLUSTERS) and all(w["bit_exact"] for w in whole.values()),
    }


def plot_steps(result: dict, path: pathlib.Path) -> None:
    """``--real-steps``' PNG: per step the served values changed and whole over wire bytes, and every
    cluster's round time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    x = [s["version"] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(x, [100 * s["changed_fraction"] for s in steps], "o-", label="values changed (%)")
    top.set_ylabel("% of served values changed")
    twin = top.twinx()
    twin.plot(x, [s["whole_over_wire"] for s in steps], "s--", color="tab:green", label="whole / wire bytes")
    twin.set_ylabel("whole / wire bytes")
    top.set_title(f"AdamW steps of a 125M Qwen2, bf16 served, over {result.get('link', 'loopback')}: "
                  f"{result['bit_exact_steps']}/{result['total_steps']} bit-exact", fontsize=10)
    for name in CLUSTERS:
        bottom.plot(x, [s[f"{name}_s"] for s in steps], "o-", label=name)
    bottom.set_ylabel("round (s)")
    bottom.set_xlabel("version (one AdamW step each; the first are warm-up)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shaped(args, argv: list[str]) -> int:
    """Run this bench inside a network namespace whose loopback is shaped at ``args.rate`` (tests/netns.py:
    htb, the control plane's class first), so every round crosses a link of that rate."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import netns

    why = netns.available()
    if why is not None:
        raise SystemExit(f"--rate needs network namespaces: {why}")
    inner = _without(argv, "--rate")
    with netns.Cluster(["bench"], rate=args.rate, prefix="wsd") as cluster:
        cluster.shape_loopback("bench", args.rate)
        return cluster.popen("bench", [sys.executable, __file__, *inner, "--link", args.rate]).wait()


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` and the value after it."""
    return [a for i, a in enumerate(argv) if a != flag and (i == 0 or argv[i - 1] != flag)]


def command(argv: list[str], link: str) -> str:
    """The command that reproduces a run: a shaped link's inner run (``--link RATE``) is shown as the
    ``--rate RATE`` it was started with."""
    return " ".join(["bench/transfer_delta.py", *(["--rate", link] if "--link" in argv else []),
                     *_without(argv, "--link")])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="delta rounds against dense rounds over loopback TCP")
    ap.add_argument("--mb", type=int, default=512, help="MiB of bf16 weights")
    ap.add_argument("--experts", type=int, default=0,
                    help="an MoE model: this many experts a layer, three 512 x 128 projections each (thousands of rows)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per changed fraction")
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--warmup", type=int, default=3, help="rounds at 1%% first, not counted (auto measures there)")
    ap.add_argument("--real-steps", type=int, default=0,
                    help="instead of synthetic fractions: this many AdamW steps of a 125M Qwen2 (after --warmup)")
    ap.add_argument("--rate", default="", help="run on a link of this rate (\"1gbit\": a shaped loopback; root)")
    ap.add_argument("--link", default="loopback", help=argparse.SUPPRESS)  # (set by --rate's inner run)
    ap.add_argument("--gpus", default="", choices=["", "across", "colocated"],
                    help="CUDA IPC between GPU 0 and 1 (across) or on GPU 0 (colocated), instead of TCP on the CPU")
    ap.add_argument("--json", action="store_true", help="the figures as one JSON object on the last line")
    ap.add_argument("--trace", default="", help="a folder: the always and dense clusters' sender and receiver under "
                                                "torch.profiler there (Chrome traces; diagnostics)")
    ap.add_argument("--profile", default="", help="a folder: the always and dense clusters' sender and receiver under "
                                                  "cProfile there (their hottest functions; diagnostics)")
    ap.add_argument("--out", default="", help="write the figures (with the command) to this file")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.rate:
        return shaped(args, argv)
    from weightsync.engine.aio import install_uvloop

    install_uvloop()  # the controllers on uvloop, as `weightsync controller` runs them
    if args.real_steps:
        result = asyncio.run(run_real(args.real_steps, args.warmup))
    else:
        result = asyncio.run(run((args.mb, args.experts), args.rounds, tuple(float(f) for f in args.fractions.split(",")),
                                 args.warmup, args.gpus, args.trace or args.profile, bool(args.profile)))
    result["link"] = f"cuda_ipc {args.gpus}" if args.gpus else args.link
    if args.gpus:
        result[f"time_ratio_gpu_{args.gpus}_1pct"] = next(c["always_over_dense"] for c in result["cases"]
                                                          if c["fraction"] == 0.01)
    result["command"] = command(argv, args.link)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if args.real_steps:
            plot_steps(result, pathlib.Path(args.out).with_suffix(".png"))
    if args.json:
        print(json.dumps(result))
    else:
        for case in result.get("cases", result.get("steps", [])):
            print(case)
        print({k: v for k, v in result.items() if k not in ("cases", "steps")})
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
