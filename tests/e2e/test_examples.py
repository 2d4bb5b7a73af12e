"""The examples run as shipped (in-process, CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_transforms_example_with_an_nn_module_trainer():
    summary = await _load("transforms_cpu").run(steps=2)
    assert summary["tp0/2"]["version"] == summary["tp1/2"]["version"] == summary["fp8"]["version"] == 2
    assert summary["tp0/2"]["bytes"] == summary["tp1/2"]["bytes"]
    assert summary["fp8"]["fp8"] == 8  # qkv, o, gate_up, down in each of 2 layers; norms/embed/lm_head stay bf16
    assert summary[1]["bytes"] == sum(summary[k]["bytes"] for k in ("tp0/2", "tp1/2", "fp8"))  # whole rows
    assert summary[2]["bytes"] <= summary[1]["bytes"]  # rows whose delta is smaller went as deltas


async def test_moe_fp8_example_with_expert_parallel_ranks():
    summary = await _load("moe_fp8_cpu").run(steps=2)
    ranks = [summary["ep0/2"], summary["ep1/2"]]
    assert all(r["version"] == 2 and r["experts_within_fp8_bound"] for r in ranks)
    assert all(r["fp8"] == 12 for r in ranks)  # q, k, v, o and the two expert stacks of each of 2 layers
    assert ranks[0]["expert_stacks"] == [[4, 256, 256], [4, 256, 128]]  # half of the 8 experts each
    assert summary[1]["bytes"] == ranks[0]["bytes"] + ranks[1]["bytes"]  # each rank's own, nothing more
    assert summary[2]["bytes"] <= summary[1]["bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rl_loop_learns_and_tags_rollouts_with_their_version(tmp_path):
    """examples/rl_loop.py under a real torchrun (2 trainer ranks, gloo) and one inference process."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this interpreter")
    out = tmp_path / "rl"
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "rl_loop.py"),
                          "--steps", "60", "--out", str(out)], capture_output=True, text=True, timeout=280,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "rl.json").read_text())
    steps, summary = result["steps"], result["summary"]
    assert [s["step"] for s in steps] == list(range(1, 61))
    assert all(0 <= s["lag"] <= 1 for s in steps) and summary["max_lag"] <= 1  # one step off-policy at most
    versions = [s["rollout_version"] for s in steps]
    assert versions == sorted(versions) and versions[-1] >= 58  # every update reached inference, in order
    assert all(s["update_ms"] > 0 for s in steps)
    assert summary["reward_last10"] > summary["reward_first10"] + 0.2, summary  # it learns
    assert (tmp_path / "rl.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_rl_loop_with_bf16_receivers_moves_changed_bytes_and_serves_every_version_exactly(tmp_path):
    """examples/rl_loop.py --bf16: fp32 master weights under AdamW at lr 1e-6, bf16 served by two inference
    processes, every round as deltas: a step changes a few percent of the bf16 values, the rounds after
    the first move fewer bytes than whole, and every inference process's CRC-32 of what it serves equals
    the trainer's bf16 cast of every version."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this interpreter")
    out = tmp_path / "rl"
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "rl_loop.py"),
                          "--bf16", "--optimizer", "adamw", "--lr", "1e-6", "--delta", "always", "--inference", "2",
                          "--steps", "4", "--prompts", "8", "--group", "4", "--out", str(out)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "rl.json").read_text())
    steps, summary = result["steps"], result["summary"]
    assert summary["bit_exact_steps"] == summary["steps"] == 4, steps
    assert all(s["changed"] < 0.5 for s in steps) and any(s["changed"] > 0 for s in steps), steps
    assert steps[0]["wire_bytes"] == steps[0]["whole_bytes"]  # the first round has no base: whole rows
    assert all(s["wire_bytes"] < s["whole_bytes"] for s in steps[1:]), steps
    assert all(s["encode_ms"] > 0 and s["apply_ms"] > 0 for s in steps[1:]), steps  # (each delta round's own work)
    (tmp_path / "rl.png").unlink()  # --plot draws it again from the JSON alone (for runs on a GPU image without matplotlib)
    subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--plot", str(tmp_path / "rl.json")],
                   check=True, capture_output=True, timeout=60, cwd=ROOT)
    assert (tmp_path / "rl.png").stat().st_size > 10_000
