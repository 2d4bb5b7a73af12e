"""bench/transfer_delta.py's profile, bench/diagnostics/catch_up.py and round_in_process.py's timeline on the CPU, as shipped."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> list[str]:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         timeout=170, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout.strip().splitlines()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_delta_bench_profiles_the_rounds_of_both_ends(tmp_path):
    """``--profile``: each of the always and dense clusters' two processes writes its hottest functions,
    taken on its event loop's thread while its rounds after the first ran (the always sender's include
    handing its delta rows to the encoder, which runs on worker threads)."""
    out = json.loads(_run("transfer_delta.py", "--mb", "8", "--fractions", "0.01", "--rounds", "1", "--warmup", "1",
                          "--profile", str(tmp_path), "--json")[-1])
    assert out["bit_exact"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["receiver_always.txt", "receiver_dense.txt", "sender_always.txt", "sender_dense.txt"]
    sender = (tmp_path / "sender_always.txt").read_text()
    assert "function calls" in sender and "as_deltas" in sender  # (its delta rows, encoded in the rounds)
    assert "as_deltas" not in (tmp_path / "sender_dense.txt").read_text()


@pytest.mark.timeout(120)
def test_the_catch_up_diagnostic_checks_each_way_bit_for_bit():
    rows = [json.loads(line) for line in _run("diagnostics/catch_up.py", "--mb", "2", "--rounds", "1", "--json")]
    assert [r["fraction"] for r in rows] == [0.001, 0.01, 0.03, 0.1]
    for r in rows:
        assert r["copy_equal"] and r["scatter_equal"] and r["reapply_equal"]
        assert r["changes"] == int(r["mb"] * (1 << 20) // 2 * r["fraction"])
        assert min(r["copy_ms"], r["scatter_ms"]) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("arm", [True, False], ids=["armed", "no-arm"])
def test_the_in_process_round_prints_each_message_of_the_round_in_protocol_order(arm):
    """``round_in_process.py --timeline``: every message of a one-phase round at its median time, in the
    order the protocol sends them, each at or after the one before; armed (the default), the sender's
    ``armed_push`` stands for its ``begin`` and the next round's arm comes in the commit."""
    lines = _run("diagnostics/round_in_process.py", "--rounds", "20", "--timeline", *([] if arm else ["--no-arm"]))
    rows = [re.fullmatch(r"\s*(-?[\d.]+) ms\s+(?:\+[\d.]+)?\s+(\S.*)", line).groups() for line in lines[:-1]]
    times = [float(ms) for ms, _ in rows]
    events = [event for _, event in rows]
    assert times == sorted(times) and lines[-1].startswith("empty round in one process")
    assert lines[-1].startswith(f"empty round in one process (full_check_every=0, arms {'on' if arm else 'off'})")
    if arm:
        order = ["sender send:armed_push", "controller round:start",
                 "controller send:begin>receiver/0", "controller send:fence_commit>receiver/0",
                 "receiver send:commit_ack", "controller send:commit>sender/0", "sender recv:commit"]
        assert not any(e in events for e in ("controller send:begin>sender/0", "sender recv:begin", "sender send:push",
                                             "controller send:arm>sender/0", "sender recv:arm"))  # (the arm: in the commit)
    else:
        order = ["sender send:push", "controller round:start", "controller send:begin>sender/0", "sender recv:begin",
                 "sender send:writes_done", "controller send:fence_commit>receiver/0", "receiver recv:fence_commit",
                 "receiver send:commit_ack", "controller send:commit>sender/0", "sender recv:commit"]
    assert [e for e in events if e in order] == order, events


def test_a_shaped_runs_command_says_the_rate_it_ran_at():
    """The command a result file records reproduces it: a shaped link's inner run (``--link 1gbit``) is
    recorded as the ``--rate 1gbit`` it was started with, a loopback run as it was given."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("transfer_delta", ROOT / "bench" / "transfer_delta.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    inner = ["--real-steps", "6", "--out", "x.json", "--link", "1gbit"]
    assert bench.command(inner, "1gbit") == "bench/transfer_delta.py --rate 1gbit --real-steps 6 --out x.json"
    assert bench.command(["--mb", "8"], "loopback") == "bench/transfer_delta.py --mb 8"
