"""The daemon and CLI in real processes; control-plane authentication; limits; doctor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from weightsync.roles.channel import curve_keys

from children import Children, free_port
from weightsync.engine.errors import ControllerLost, RoundAborted
from proc_helpers import SPEC, receiver_main, sender_main, sender_tensors, update_in_place
from weightsync.roles import Controller, ControllerOptions, SenderOptions, WeightSender
from weightsync.roles.daemon import request
from weightsync.roles.limits import JoinLimiter, PeerLimits, RateLimiter
from weightsync.wire import Envelope, encode
from weightsync.wire import messages as m
from weightsync.wire.auth import Unauthenticated, sign, verify

ROOT = pathlib.Path(__file__).resolve().parents[2]
WATCHDOG = 60.0
KEY = b"k" * 32
pytestmark = pytest.mark.slow


def _spec_file(tmp_path) -> str:
    spec = {name: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
            for name, (shape, dtype, how) in SPEC.items()}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


@contextlib.contextmanager
def daemon_process(tmp_path, controller: str, command: str, *extra: str, source: tuple = ()):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
           "WEIGHTSYNC_TEST_HOOK_LOG": str(tmp_path / "hook.jsonl")}
    source = source or ("--spec", _spec_file(tmp_path), "--hook", "daemon_hook:record")
    cmd = [sys.executable, "-m", "weightsync.roles.cli", "daemon", "--controller", controller, "--rank", "0",
           *source, "--command-bind", command, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _hook_log(tmp_path) -> list[dict]:
    path = tmp_path / "hook.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _command(addr: str, name: str, key=None):
    env = await request(addr, m.CommandRequest(name, {}), timeout_s=WATCHDOG, auth_key=key)
    assert env.body.ok, env.body.error
    return env.body.result


async def test_daemon_receives_hands_over_and_obeys_commands(tmp_path):
    command = f"tcp://127.0.0.1:{free_port()}"
    opts = ControllerOptions(heartbeat_s=0.2, timeout_s=20.0, checksum="crc32")
    tensors = sender_tensors(0)
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        with daemon_process(tmp_path, ctl.address, command):
            async with WeightSender(ctl.address, tensors, rank=0) as sender:

                async def push(v):
                    update_in_place(tensors, v)
                    await asyncio.wait_for(await sender.push(v), WATCHDOG)
                    await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)

                await push(1)
                status = await _command(command, "status")
                assert (status["received_version"], status["applied_version"]) == (1, 1)
                assert _hook_log(tmp_path) == [{"version": 1, "names": len(SPEC), "mismatches": []}]
                await _command(command, "pause")
                await push(2)
                await push(3)
                status = await _command(command, "status")
                assert status["paused"] and status["received_version"] == 3 and status["applied_version"] == 1
                assert status["pending_version"] == 3
                applied = await _command(command, "apply")
                assert applied["applied_version"] == 3 and applied["pending_version"] is None
                assert _hook_log(tmp_path)[-1] == {"version": 3, "names": len(SPEC), "mismatches": []}
                bad = await request(command, m.CommandRequest("drop", {}), timeout_s=WATCHDOG)
                assert not bad.body.ok and "no pending version" in bad.body.error
                await push(4)
                dropped = await _command(command, "drop")
                assert dropped["pending_version"] is None and dropped["applied_version"] == 3
                await _command(command, "resume")
                await push(5)
                assert [h["version"] for h in _hook_log(tmp_path)] == [1, 3, 5]
                unknown = await request(command, m.CommandRequest("teleport", {}), timeout_s=WATCHDOG)
                assert not unknown.body.ok and "unknown command" in unknown.body.error
                layout = await _command(command, "layout")
                assert {t["name"] for t in layout["tensors"]} == set(SPEC)
                await _command(command, "shutdown")


async def test_daemon_in_an_inference_layout(tmp_path):
    """--arch with --mapping/--tp/--dtype: vLLM-style names, a TP half, fp16 buffers, from an fp32 trainer."""
    from weightsync.engine.models.shapes import gpt2_config
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    trainer = GPT2LMHeadModel(gpt2_config("tiny"))
    command = f"tcp://127.0.0.1:{free_port()}"
    opts = ControllerOptions(heartbeat_s=0.2, timeout_s=20.0, checksum="crc32", mapping="gpt2")
    source = ("--arch", "gpt2-tiny", "--mapping", "gpt2", "--tp", "1/2", "--dtype", "float16")
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        with daemon_process(tmp_path, ctl.address, command, source=source):
            async with WeightSender(ctl.address, trainer, rank=0) as sender:
                await asyncio.wait_for(await sender.push(1), WATCHDOG)
                report = await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
                status = await _command(command, "status")
                assert status["received_version"] == 1
                layout = {t["name"]: t for t in (await _command(command, "layout"))["tensors"]}
                c_attn = layout["transformer.h.0.attn.c_attn.weight"]  # Conv1D [128, 384] -> Linear half [192, 128]
                assert c_attn["shape"] == [192, 128] and c_attn["dtype"] == "float16"
                assert c_attn["shard"] == {"dim": 0, "start": 192, "stop": 384, "full_shape": [384, 128]}
                assert layout["transformer.h.0.attn.c_proj.weight"]["shard"]["dim"] == 1  # row-parallel
                assert report.nbytes == sum(2 * math.prod(t["shape"]) for t in layout.values())
            await _command(command, "shutdown")


async def test_sigterm_during_a_round_leaves_no_half_applied_version(tmp_path):
    kids = Children()
    command = f"tcp://127.0.0.1:{free_port()}"
    opts = ControllerOptions(heartbeat_s=0.2, timeout_s=20.0, checksum="crc32")
    try:
        async with Controller(senders=1, receivers=2, options=opts) as ctl:
            with daemon_process(tmp_path, ctl.address, command) as proc:
                kids.start("receiver", 1, receiver_main, ctl.address, 1, [1, 3])  # stays joined
                kids.start("sender", 0, sender_main, ctl.address, 0, [1, 2], 2)  # hangs mid-round 2
                await kids.expect("joined", 2)
                await asyncio.wait_for(ctl.wait_round(1), WATCHDOG)
                await kids.expect("blocked")
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(RoundAborted) as e:
                    await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
                assert e.value.culprit == "receiver/0"
                assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, WATCHDOG) == 0
                assert "shutting down cleanly" in proc.stderr.read()
                assert [h["version"] for h in _hook_log(tmp_path)] == [1]  # never a half-applied 2
                aborted = {role: data for _, role, _, data in await kids.expect("aborted", 2)}  # both children
                assert aborted["receiver"] == (2, 1, True)  # the other receiver kept v1 intact
                assert aborted["sender"][0] == 2 and "RoundAborted" in aborted["sender"][1]
    finally:
        kids.close()


async def test_a_hello_that_cannot_even_be_queued_is_reported_with_its_likely_cause(monkeypatch):
    """A worker whose connection failed its handshake (a keyless one meeting a keyed controller) may be
    left with no pipe, so its hello cannot be queued: it says so with the likely cause, as it does for a
    hello left unanswered, not as a bare "resource temporarily unavailable"."""
    from weightsync.roles.channel import ControlChannel
    from weightsync.wire import messages as m

    real = ControlChannel.send

    async def no_pipe(self, body, **kw):
        if isinstance(body, m.Hello):
            raise zmq.Again()
        return await real(self, body, **kw)

    monkeypatch.setattr(ControlChannel, "send", no_pipe)
    async with Controller(senders=1, receivers=1, options=ControllerOptions(heartbeat_s=0.1, timeout_s=5.0)) as ctl:
        with pytest.raises(ControllerLost, match="could not be sent.*same auth key"):
            async with WeightSender(ctl.address, {"w": torch.zeros(4)}, rank=0,
                                    options=SenderOptions(join_timeout_s=0.5)):
                pass


async def test_authentication_accepts_holders_and_drops_the_rest():
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=5.0, auth_key=KEY)
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        async with WeightSender(ctl.address, {"w": __import__("torch").zeros(4)}, rank=0,
                                options=SenderOptions(auth_key=KEY)):
            assert len(ctl.peers) == 1
        with pytest.raises(ControllerLost, match="auth key"):
            async with WeightSender(ctl.address, {"w": __import__("torch").zeros(4)}, rank=0,
                                    options=SenderOptions(join_timeout_s=1.0)):
                pass
        # one CURVE connection of a key holder, in order: a forged message, a good one, a replay of the
        # good one, a newer one (the HMAC layer and the replay guard inside an authenticated connection)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys = curve_keys(KEY)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            keys["server_public"], keys["client_public"], keys["client_secret"])
        sock.connect(ctl.address)
        try:
            dropped = ctl.dropped
            good = sign(encode(Envelope(m.StatusRequest(False), 1, "cli")), KEY)
            await sock.send_multipart(sign(encode(Envelope(m.StatusRequest(False), 1, "cli")), b"x" * 32))
            await sock.send_multipart(good)
            await sock.send_multipart(good)
            await sock.send_multipart(sign(encode(Envelope(m.StatusRequest(False), 2, "cli")), KEY))
            replies = [await asyncio.wait_for(sock.recv_multipart(), WATCHDOG) for _ in range(2)]
            assert [msgpack.unpackb(verify(r, KEY)[0])["parent_id"] for r in replies] == [1, 2]
            assert ctl.dropped - dropped == 2  # the forgery and the replay
        finally:
            sock.close()
            ctx.term()


def test_sign_and_verify():
    frames = [b"header", b"body"]
    assert verify(sign(frames, KEY), KEY) == frames
    with pytest.raises(Unauthenticated):
        verify(sign(frames, KEY)[:2] + [b"0" * 32], KEY)
    with pytest.raises(Unauthenticated):
        verify(frames, KEY)


def test_rate_and_join_limits():
    rates = RateLimiter(PeerLimits(messages_per_s=10, burst=5, max_strikes=3))
    assert all(rates.allow(b"a", 0.0) for _ in range(5))
    assert not rates.allow(b"a", 0.0) and rates.allow(b"b", 0.0)  # one peer over; the other unaffected
    assert rates.allow(b"a", 0.2)  # refilled
    for _ in range(3):
        rates.allow(b"a", 0.2)
    assert rates.abusive(b"a") and not rates.abusive(b"b")
    joins = JoinLimiter(PeerLimits(joins_per_minute=2))
    assert joins.allow("h", 0) and joins.allow("h", 1) and not joins.allow("h", 2) and joins.allow("h", 61.5)


def test_doctor_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "weightsync.roles.cli", "doctor"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    for check in ("python", "torch", "gpus", "rdma devices", "uccl", "auto transport", "loopback port"):
        assert check in out.stdout
    assert "tcp" in out.stdout.splitlines()[-2] or "tcp" in out.stdout


def test_prometheus_metrics_endpoint():
    pytest.importorskip("prometheus_client")
    import urllib.request

    from weightsync.roles.metrics import Metrics
    from weightsync.roles.round_state import LinkStat, RoundReport

    port = free_port()
    metrics = Metrics(port)
    metrics.observe(RoundReport(7, True, 10**9, 0.5, {"transfer": 0.4, "fence": 0.05, "commit": 0.05,
                                                      "sender_encode_max": 0.3, "receiver_apply_max": 0.02,
                                                      "receiver_verify_max": 0.0},
                                [LinkStat(0, 1, 10**9, 3, 2.5)], whole_bytes=4 * 10**10, delta_rows=12,
                                changed_values=5 * 10**8, predicted_s=0.45, armed=2))
    metrics.observe(RoundReport(8, False, 0, 0.1, {}, [], reason="PEER_LOST: gone"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WATCHDOG).read().decode()
    assert 'weightsync_rounds_total{outcome="committed"} 1.0' in text
    assert 'weightsync_rounds_total{outcome="aborted"} 1.0' in text
    assert "weightsync_committed_version 7.0" in text
    assert 'weightsync_link_gbps{receiver="1",sender="0"} 2.5' in text
    assert "weightsync_round_predicted_seconds 0.45" in text
    assert "weightsync_bytes_total 1e+09" in text and "weightsync_whole_bytes_total 4e+10" in text
    assert "weightsync_delta_rows_total 12.0" in text and "weightsync_changed_values_total 5e+08" in text
    assert "weightsync_armed_rounds_total 1.0" in text  # (a committed round two senders wrote under an arm)
    assert 'weightsync_stage_seconds_sum{stage="encode"} 0.3' in text
    assert 'weightsync_stage_seconds_sum{stage="apply"} 0.02' in text
    assert 'stage="verify"' not in text  # (no checksums that round)


def test_demo_main_job_verifies_bit_exact():
    """`make demo`'s job, small: real DDP trainer and inference processes; exit 0 only if verified."""
    out = subprocess.run([sys.executable, "-m", "weightsync.roles.cli", "demo", "--size", "tiny", "--rounds", "2", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] and [r["verified"] for r in summary["rounds"]] == [True, True]
    assert all(r["bytes"] > 0 for r in summary["rounds"])


@pytest.mark.parametrize("key", [None, b"short"])
def test_a_bad_auth_key_file_is_one_clear_line(tmp_path, key):
    path = tmp_path / "key"
    if key is not None:
        path.write_bytes(key)
    out = subprocess.run([sys.executable, "-m", "weightsync.roles.cli", "controller", "--senders", "1", "--receivers", "1",
                          "--auth-key-file", str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "auth-key-file" in lines[0]


def test_the_command_line_starts_without_importing_torch():
    """``weightsync --help`` answers at once: the CLI and the roles package import torch only when a
    command needs it."""
    code = "import sys, roles.cli; roles.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_status_renders_peers_and_rounds_as_tables():
    from weightsync.roles.cli import format_status

    status = {"address": "tcp://127.0.0.1:5555", "committed_version": 3, "expected": {"sender": 1, "receiver": 1},
              "plan": {"id": 2, "transfers": 10, "bytes": 2e9, "acknowledged": True},
              "peers": [{"role": "sender", "rank": 0, "host": "trainer-0", "device": "cuda:0", "transport": "cuda_ipc",
                         "state": "READY", "last_seen_s": 0.2}],
              "rounds": [{"version": 3, "ok": False, "reason": "TIMEOUT", "nbytes": 2e9, "seconds": 0.5, "gbps": 4.0,
                          "stages": {"transfer": 0.4, "sender_stage_max": 0.1},
                          "links": [{"sender": 0, "receiver": 0, "nbytes": 2e9, "gbps": 4.0}]}]}
    text = format_status(status)
    assert "committed version 3" in text and "plan 2: 10 transfers, 2.000 GB, acknowledged" in text
    assert "trainer-0" in text and "cuda_ipc" in text and "0.2s ago" in text
    assert "ABORTED TIMEOUT" in text and "transfer=400.0ms" in text and "sender_stage_max" not in text
    assert "sender/0 -> receiver/0: 2000.0 MB, 4.00 GB/s" in text
    assert "predicted" not in text and "learned costs" not in text  # (nothing learned yet)
    status["plan"]["predicted_round_ms"] = 412.5
    status["costs"] = {"per_row_us": 5.25, "per_round_ms": 1.5, "rounds": 4}
    status["rounds"][0].update(ok=True, predicted_s=0.4125, checksum="fp64", armed=1)
    text = format_status(status, width=160)
    assert "next round predicted 412.5 ms" in text and "learned costs: 5.25 us a row, 1.50 ms a round (4 rounds)" in text
    assert "ok, checked fp64, 1 armed" in text  # (a round checked end to end, its sender armed, says so)
    assert "│ 500.0 │ 412.5 │" in text  # (the round's seconds beside its prediction)


def test_daemon_layout_of_an_moe_rank_with_expert_parallel_fp8():
    """--arch of an MoE with --ep/--fp8 (buffers on the meta device: only the layout is asked for): each
    fused expert stack holds this rank's quarter of the experts in block FP8, matrix by matrix, and a
    malformed --ep is refused naming the flag."""
    from roles.cli import build_parser, daemon_params
    from weightsync.engine.errors import ConfigError

    args = build_parser().parse_args(["daemon", "--controller", "tcp://127.0.0.1:1", "--rank", "0",
                                      "--arch", "qwen3-30b-a3b", "--ep", "1/4", "--fp8", "--device", "meta"])
    tensors, shards = daemon_params(args)
    gate_up, scales = (tensors["model.layers.0.mlp.experts.gate_up_proj" + s] for s in ("", "_scale_inv"))
    assert gate_up.dtype == torch.float8_e4m3fn and gate_up.shape[0] == 128 // 4
    assert tuple(scales.shape) == (32, gate_up.shape[1] // 128, -(-gate_up.shape[2] // 128))
    shard = shards["model.layers.0.mlp.experts.gate_up_proj"]
    assert (shard.dim, shard.start, shard.stop) == (0, 32, 64)
    assert "model.layers.0.mlp.gate.weight" not in shards  # the router is whole on every rank
    args.ep = "1of4"
    with pytest.raises(ConfigError, match="ep"):
        daemon_params(args)
