"""The ``weightsync`` command line. The environment is read here and nowhere else.

Subcommands: ``demo`` (the main job), ``controller`` (standalone controller), ``daemon`` (standalone
receiver with a command socket), ``ctl`` (send a command to a daemon), ``status`` (ask a controller or
daemon), ``doctor`` (check this machine). Long-running ones stop gracefully on SIGINT/SIGTERM.
Environment: ``WEIGHTSYNC_AUTH_KEY_FILE`` (default for ``--auth-key-file``), ``UCCL_P2P_TRANSPORT=tcp``
(lets the uccl transport run without an RDMA NIC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional

log = logging.getLogger("weightsync")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"t": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _auth_key(args: argparse.Namespace) -> Optional[bytes]:
    """The shared key from ``--auth-key-file`` (or $WEIGHTSYNC_AUTH_KEY_FILE); a file that cannot be read
    or holds too short a key is a ``ConfigError`` naming the file (one line on the command line)."""
    path = getattr(args, "auth_key_file", None) or os.environ.get("WEIGHTSYNC_AUTH_KEY_FILE")
    if not path:
        return None
    from .keyfile import read_key_file

    return read_key_file(path, "auth-key-file")


async def _until_signalled(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.warning("signal received: shutting down cleanly")


# --- controller -------------------------------------------------------------------------------------


def _dscp(args: argparse.Namespace) -> dict:
    return {} if args.control_dscp is None else {"control_dscp": args.control_dscp}


def _controller(args: argparse.Namespace) -> int:
    from weightsync.engine.plan import LinkModel

    from .controller import Controller, ControllerOptions

    options = ControllerOptions(heartbeat_s=args.heartbeat, timeout_s=args.timeout, checksum=args.checksum,
                                delta=args.delta, full_check_every=args.full_check_every,
                                round_timeout_s=args.round_timeout, auth_key=_auth_key(args),
                                link=LinkModel(net_bw=args.nic_gbit * 1e9 / 8), mapping=args.mapping,
                                session_streams=not args.no_session_streams, stream_port=args.stream_port,
                                **_dscp(args))
    from .progress import RoundProgress

    progress = RoundProgress(total=0, enabled=sys.stderr.isatty())  # a live bar in a terminal, quiet otherwise
    metrics = None
    if args.metrics_port:
        from .metrics import Metrics

        metrics = Metrics(args.metrics_port)

    def on_round(report) -> None:
        log.info("round %s", json.dumps(report.to_json()))
        progress.round_done(report)
        if metrics is not None:
            metrics.observe(report)

    async def main() -> None:
        async with Controller(args.bind, senders=args.senders, receivers=args.receivers, options=options,
                              on_round=on_round) as ctl:
            print(f"weightsync controller listening on {ctl.address}", flush=True)
            await _until_signalled(asyncio.Event())

    asyncio.run(main())
    return 0


# --- daemon -----------------------------------------------------------------------------------------


def daemon_params(args: argparse.Namespace) -> tuple[dict, dict]:
    """The receive buffers (a transformers architecture's state dict, in an inference layout if asked,
    or a JSON spec of shapes) and the tensor-parallel shard specs of the layout."""
    import torch

    if args.arch and (args.mapping != "identity" or args.tp or args.ep or args.fp8 or args.dtype):
        return _layout_params(args)
    if args.arch:
        from transformers import AutoModelForCausalLM

        from weightsync.engine.models.shapes import ARCHITECTURES, gpt2_config

        config = gpt2_config(args.arch.split("-", 1)[1]) if args.arch.startswith("gpt2-") else ARCHITECTURES[args.arch]()
        model = AutoModelForCausalLM.from_config(config).to(args.device)
        return dict(model.state_dict(keep_vars=True)), {}
    with open(args.spec) as f:
        spec = json.load(f)
    return ({name: torch.zeros(entry["shape"], dtype=getattr(torch, entry.get("dtype", "float32")), device=args.device)
             for name, entry in spec.items()}, {})


def _layout_params(args: argparse.Namespace) -> tuple[dict, dict]:
    """``--arch`` in an inference engine's layout: ``--mapping`` names, ``--tp I/W`` and ``--ep I/W`` shards,
    ``--fp8``."""
    from weightsync.engine.transforms.layouts import ExpertParallel, FP8Policy, TensorParallel, allocate, receiver_layout
    from weightsync.engine.models.shapes import state_dict_shapes

    tp = TensorParallel(*_position("tp", args.tp)) if args.tp else None
    ep = ExpertParallel(*_position("ep", args.ep)) if args.ep else None
    dtype = args.dtype or "float32"
    shapes = {p.name: (dtype, p.shape) for p in state_dict_shapes(args.arch, dtype)}
    layout = receiver_layout(shapes, args.mapping, tp=tp, fp8=FP8Policy() if args.fp8 else None, ep=ep)
    return allocate(layout, args.device)


def _position(flag: str, text: str) -> tuple[int, int]:
    """``INDEX/WORLD`` (``--tp``, ``--ep``) as two ints; a ``ConfigError`` naming the flag otherwise."""
    from weightsync.engine.errors import ConfigError

    index, sep, world = text.partition("/")
    if not sep or not index.isdigit() or not world.isdigit():
        raise ConfigError(flag, f"expected INDEX/WORLD such as 0/2, got {text!r}")
    return int(index), int(world)


def _daemon(args: argparse.Namespace) -> int:
    from weightsync.engine.transport import TransportOptions

    from .daemon import Daemon, DaemonOptions, load_hook
    from .receiver import ReceiverOptions

    key = _auth_key(args)
    hook = load_hook(args.hook) if args.hook else None
    uccl_tcp = os.environ.get("UCCL_P2P_TRANSPORT") == "tcp"
    receiver = ReceiverOptions(transport=args.transport, mode=args.mode, auth_key=key, **_dscp(args),
                               transport_options=TransportOptions(bind_host=args.bind_host, port=args.data_port,
                                                                  advertise_host=args.advertise_host,
                                                                  host_id=args.host_id, uccl_tcp=uccl_tcp))
    options = DaemonOptions(command_bind=args.command_bind, receiver=receiver, auth_key=key)

    async def main() -> None:
        params, shards = daemon_params(args)
        async with Daemon(args.controller, params, rank=args.rank, hook=hook, options=options, shards=shards) as d:
            print(f"weightsync daemon {d.receiver.name}: commands on {d.command_address}", flush=True)
            stop = asyncio.Event()
            waiter = asyncio.ensure_future(d.stopped.wait())
            signalled = asyncio.ensure_future(_until_signalled(stop))
            await asyncio.wait([waiter, signalled], return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, signalled):
                task.cancel()

    asyncio.run(main())
    return 0


# --- client commands --------------------------------------------------------------------------------


def _ask(addr: str, body, key: Optional[bytes], timeout: float):
    from .daemon import request

    try:
        return asyncio.run(request(addr, body, timeout_s=timeout, auth_key=key))
    except asyncio.TimeoutError:
        print(f"no answer from {addr} within {timeout} s (not running? wrong address or auth key?)", file=sys.stderr)
        return None


def _ctl(args: argparse.Namespace) -> int:
    from weightsync.wire import messages as m

    cmd_args = {"version": args.version} if args.version is not None else {}
    env = _ask(args.daemon, m.CommandRequest(args.command, cmd_args), _auth_key(args), args.wait)
    if env is None:
        return 2
    body = env.body
    if isinstance(body, m.CommandReply) and not body.ok:
        print(f"error: {body.error}", file=sys.stderr)
        return 1
    print(json.dumps(getattr(body, "result", None), indent=1))
    return 0


def _status(args: argparse.Namespace) -> int:
    from weightsync.wire import messages as m

    env = _ask(args.controller or args.daemon, m.StatusRequest(True), _auth_key(args), args.wait)
    if env is None:
        return 2
    status = env.body.status
    if args.json or args.daemon:
        print(json.dumps(status, indent=1))
        return 0
    print(format_status(status))
    return 0


def format_status(s: dict, width: int = 120) -> str:
    """A controller's status as text: a header, the peers as a table, the last rounds as a table (rich)."""
    import io

    from rich.console import Console
    from rich.table import Table

    from .metrics import WORK

    out = io.StringIO()
    console = Console(file=out, width=width, highlight=False, color_system=None)
    console.print(f"controller {s['address']}: committed version {s['committed_version']}, "
                  f"expected {s['expected']['sender']} senders / {s['expected']['receiver']} receivers")
    if s.get("plan_error"):
        console.print(f"PLAN ERROR: {s['plan_error']}")
    if s.get("plan"):
        p = s["plan"]
        predicted = f", next round predicted {p['predicted_round_ms']:.1f} ms" if p.get("predicted_round_ms") else ""
        console.print(f"plan {p['id']}: {p['transfers']} transfers, {p['bytes'] / 1e9:.3f} GB, "
                      f"{'acknowledged' if p['acknowledged'] else 'pending'}{predicted}")
    if s.get("costs"):
        c = s["costs"]
        console.print(f"learned costs: {c['per_row_us']:.2f} us a row, {c['per_round_ms']:.2f} ms a round "
                      f"({c['rounds']} rounds)")
    peers = Table("role", "rank", "host", "device", "transport", "state", "last seen", title="peers", title_justify="left")
    for p in s["peers"]:
        peers.add_row(p["role"], str(p["rank"]), p["host"], p["device"], p["transport"], p["state"],
                      f"{p['last_seen_s']:.1f}s ago")
    console.print(peers)
    rounds = s.get("rounds", [])[-5:]
    if rounds:
        table = Table("version", "result", "GB", "of whole", "ms", "pred.", "GB/s", "stages / links",
                      title="last rounds", title_justify="left")
        for r in rounds:
            stages = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in r["stages"].items() if k in ("gate", "transfer", "fence", "commit"))
            work = " ".join(f"{name}={r['stages'][key] * 1e3:.1f}ms" for name, key in WORK if r["stages"].get(key))
            links = "\n".join(f"sender/{k['sender']} -> receiver/{k['receiver']}: {k['nbytes'] / 1e6:.1f} MB, "
                              f"{k['gbps']:.2f} GB/s" for k in r["links"])
            deltas = (f"{r['delta_rows']} rows as deltas, {r['changed_values']:,} values changed"
                      if r.get("delta_rows") else "")
            whole = f"{r['nbytes'] / r['whole_bytes']:.1%}" if r.get("whole_bytes") else "-"
            result = ("ok" + (f", checked {r['checksum']}" if r.get("checksum") else "")
                      + (f", {r['armed']} armed" if r.get("armed") else "")) if r["ok"] else "ABORTED " + r["reason"]
            table.add_row(f"v{r['version']}", result, f"{r['nbytes'] / 1e9:.3f}",
                          whole, f"{r['seconds'] * 1e3:.1f}",
                          f"{r['predicted_s'] * 1e3:.1f}" if r.get("predicted_s") else "-", f"{r['gbps']:.2f}",
                          "\n".join(x for x in (stages, work, deltas, links) if x))
        console.print(table)
    return out.getvalue().rstrip("\n")


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import FAIL, report, run_checks

    rows = run_checks(args.controller, _auth_key(args), os.environ.get("UCCL_P2P_TRANSPORT") == "tcp")
    print(report(rows))
    return 1 if any(status == FAIL for status, _, _ in rows) else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, main

    cfg = DemoConfig(trainers=args.trainers, inference=args.inference, size=args.size, rounds=args.rounds,
                     mode=args.mode, checksum="" if args.no_checksum else "crc32", json=args.json, lr=args.lr)
    return main(cfg)


def build_parser() -> argparse.ArgumentParser:
    from weightsync.engine.plan.mapping import MAPPINGS  # pure Python: no torch import

    parser = argparse.ArgumentParser(prog="weightsync", description="Move fresh weights from trainers to inference.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--log-json", action="store_true", help="structured (JSON lines) logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a real multi-process transfer on this machine (no GPU needed)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--trainers", type=int, default=2, help="trainer processes (DDP over gloo), each a sender")
    demo.add_argument("--inference", type=int, default=2, help="inference processes, each a receiver")
    demo.add_argument("--size", default="small", choices=["tiny", "small", "medium", "large"],
                      help="GPT-2 size (small: 124M parameters)")
    demo.add_argument("--rounds", type=int, default=5, help="training steps, each followed by a weight push")
    demo.add_argument("--mode", default="shadow", choices=["shadow", "inplace"],
                      help="receivers land in a second buffer and swap at commit, or write the live tensors")
    demo.add_argument("--no-checksum", action="store_true", help="skip per-transfer CRC-32 verification")
    demo.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of the trainers")
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary as the last line")
    demo.set_defaults(func=_demo)

    dscp_help = "DSCP of control-plane packets (default: roles.channel.CONTROL_DSCP, CS6; 0: unmarked)"
    auth = argparse.ArgumentParser(add_help=False)
    auth.add_argument("--auth-key-file", help="shared HMAC key (>= 16 bytes); default $WEIGHTSYNC_AUTH_KEY_FILE")

    ctl = sub.add_parser("controller", parents=[auth], help="run a standalone controller")
    ctl.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint (loopback unless told)")
    ctl.add_argument("--senders", type=int, required=True)
    ctl.add_argument("--receivers", type=int, required=True)
    ctl.add_argument("--checksum", default="", choices=["", "crc32", "sum64", "fp64"],
                     help="check every row of every round end to end with this algorithm")
    ctl.add_argument("--delta", default="auto", choices=["auto", "always", "off"],
                     help="send changed bytes only (docs/DELTAS.md)")
    ctl.add_argument("--full-check-every", type=int, default=8,
                     help="without --checksum: check every row of every Nth round end to end (0: never)")
    ctl.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    ctl.add_argument("--timeout", type=float, default=5.0, help="seconds of silence before a peer is lost")
    ctl.add_argument("--control-dscp", type=int, default=None, help=dscp_help)
    ctl.add_argument("--stream-port", type=int, default=0,
                     help="TCP port of the sessions' streams, on the --bind host (default: any free one)")
    ctl.add_argument("--no-session-streams", action="store_true",
                     help="keep every session's messages on the ZeroMQ endpoint (docs/PROTOCOL.md, Session streams)")
    ctl.add_argument("--round-timeout", type=float, default=None, help="abort a round stage after this long")
    ctl.add_argument("--nic-gbit", type=float, default=400.0, help="NIC speed per GPU for the planner")
    ctl.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port")
    ctl.add_argument("--mapping", default="identity", choices=sorted(MAPPINGS),
                     help="how receiver names are made from trainer names (fused qkv/gate_up, GPT-2 Conv1D)")
    ctl.set_defaults(func=_controller)

    dmn = sub.add_parser("daemon", parents=[auth], help="run a standalone receiver with a command socket")
    dmn.add_argument("--controller", required=True)
    dmn.add_argument("--rank", type=int, required=True)
    src = dmn.add_mutually_exclusive_group(required=True)
    src.add_argument("--arch", help="receive buffers of this architecture (gpt2-<size> or a benchmark one)")
    src.add_argument("--spec", help="JSON file: {name: {shape: [...], dtype: 'float32'}}")
    dmn.add_argument("--device", default="cpu")
    dmn.add_argument("--mapping", default="identity", choices=sorted(MAPPINGS),
                     help="with --arch: hold the inference engine's names (fused qkv_proj / gate_up_proj, ...)")
    dmn.add_argument("--tp", default="", help="with --arch: this rank's tensor-parallel shard, INDEX/WORLD")
    dmn.add_argument("--ep", default="", help="with --arch: this rank's expert-parallel shard of the fused experts, "
                                             "INDEX/WORLD")
    dmn.add_argument("--fp8", action="store_true",
                     help="with --arch: serve linear weights and fused expert stacks in block FP8 (+ scales)")
    dmn.add_argument("--dtype", default="", help="with --arch: the float dtype of the buffers (default float32)")
    dmn.add_argument("--hook", help="module:function called with (version, [(name, tensor), ...])")
    dmn.add_argument("--mode", default="shadow", choices=["shadow", "inplace"])
    dmn.add_argument("--transport", default="tcp", choices=["tcp", "cuda_ipc", "uccl", "auto"])
    dmn.add_argument("--bind-host", "--data-host", dest="bind_host", default="127.0.0.1",
                     help="address the data plane listens on (not loopback: needs --auth-key-file)")
    dmn.add_argument("--advertise-host", default=None, help="address peers connect to (default: --bind-host)")
    dmn.add_argument("--data-port", type=int, default=0, help="a fixed data-plane port (firewalls; 0: any free one)")
    dmn.add_argument("--host-id", default=None,
                     help="network locality: processes of one id may share host-local transports (default: "
                          "hostname, boot and network namespace)")
    dmn.add_argument("--control-dscp", type=int, default=None, help=dscp_help)
    dmn.add_argument("--command-bind", default="tcp://127.0.0.1:5560")
    dmn.set_defaults(func=_daemon)

    c = sub.add_parser("ctl", parents=[auth], help="send a command to a daemon")
    c.add_argument("--daemon", required=True, help="the daemon's command endpoint")
    c.add_argument("command", choices=["status", "pause", "resume", "apply", "drop", "layout", "shutdown"])
    c.add_argument("--version", type=int, default=None)
    c.add_argument("--wait", type=float, default=10.0)
    c.set_defaults(func=_ctl)

    st = sub.add_parser("status", parents=[auth], help="who is joined, versions, last rounds and GB/s per link")
    who = st.add_mutually_exclusive_group(required=True)
    who.add_argument("--controller")
    who.add_argument("--daemon")
    st.add_argument("--json", action="store_true")
    st.add_argument("--wait", type=float, default=10.0)
    st.set_defaults(func=_status)

    doc = sub.add_parser("doctor", parents=[auth], help="check this machine and say what to fix")
    doc.add_argument("--controller", help="also check that this controller answers")
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if args.log_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    from weightsync.engine.aio import install_uvloop
    from weightsync.engine.errors import WeightSyncError

    install_uvloop()  # the controller and the daemon run on uvloop where it is installed
    try:
        return args.func(args)
    except WeightSyncError as exc:
        print(f"weightsync {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
