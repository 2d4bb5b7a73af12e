"""bench/transfer_mn.py on the CPU: FSDP2 trainer processes -> TP inference processes over TCP, as shipped."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench(*args: str) -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer_mn.py"), "--device", "cpu", "--json", *args],
                         capture_output=True, text=True, timeout=170, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_fsdp_trainers_to_two_tp_ranks_colocated_beside_the_broadcast_baseline():
    """Colocated: trainer i and receiver i pair up (on a CPU only the broadcast's shape changes: its rank 0
    also keeps receiver 0's slice, as a colocated framework's trainer process does)."""
    r = _bench("--senders", "2", "--receivers", "2", "--model", "tiny-dense", "--rounds", "4", "--colocated")
    assert r["case"] == "2 -> 2 colocated" and r["transport"] == "tcp"
    assert r["bit_exact"] and r["mismatches"] == {}  # every TP slice equals the trainer's, after the last round
    assert r["broadcast_bit_exact"]  # the baseline delivers the same slices
    assert r["rounds_measured"] == 2 and len(r["engine_ms_all"]) == 2  # (not each landing slot's first round)
    assert len(r["first_rounds_ms"]) == 2 and r["full_check_every"] == 8  # (the product's checks by default)
    assert r["engine_mean_ms"] == pytest.approx(sum(r["engine_ms_all"]) / 2, rel=1e-2)
    assert 0 < r["bound_ms"] <= r["predicted_ms"]  # the planner's own bound under-runs its own prediction
    assert r["engine_over_bound_ratio"] == pytest.approx(r["engine_ms"] / r["bound_ms"], rel=1e-2)
    assert r["broadcast_with_gather_ms"] > r["broadcast_ms"] > 0
    assert set(r["senders"]) == {"sender 0", "sender 1"}
    # per receiver and landing slot, and whether the round checks crc32 (its lanes stage every row), not per round
    assert all(s["compiles"] <= 8 for s in r["senders"].values())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_four_fsdp_trainers_to_two_fp8_tp_ranks_on_a_moe_shape():
    """Every round verified end to end (``--full-check-every 1``: what the product checks every 8th round)
    and committed: the bench measures rounds as users run them when asked to."""
    r = _bench("--senders", "4", "--receivers", "2", "--model", "tiny-moe", "--fp8", "--rounds", "4",
               "--no-broadcast", "--full-check-every", "1")  # (make bench-mn runs this case beside the broadcast)
    assert r["case"] == "4 -> 2 disaggregated" and r["fp8"]
    assert r["full_check_every"] == 1 and r["checked_rounds"] == 4 and r["rounds_measured"] == 2
    assert len(r["checked_ms_all"]) == 2 and r["first_checks_ms"] == []  # (each slot's first check: uncounted)
    assert r["bit_exact"]  # FP8 weights within the block-FP8 bound, everything else equal
    assert r["transfers"] > 200  # per-expert tensors: hundreds of writes a round
    assert "broadcast_ms" not in r
    assert len(r["senders"]) == 4


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_fp8_broadcast_baselines_quantize_at_their_receivers_and_are_checked():
    """With ``--fp8`` the broadcast baselines do the receivers' work too: each inference rank quantizes
    the bf16 it was sent into block FP8 inside the timed round, checked within the FP8 bound."""
    r = _bench("--senders", "2", "--receivers", "2", "--model", "tiny-dense", "--fp8", "--rounds", "3")
    assert r["fp8"] and r["bit_exact"]
    assert r["broadcast_bit_exact"] and r["broadcast_bucketed_bit_exact"], r.get("broadcast_mismatches")
    assert r["broadcast_ms"] > 0 and r["broadcast_bucketed_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_gather_bench_checks_every_full_tensor_in_each_arm():
    """bench/gather_fsdp.py on the CPU (gloo): three ranks, the MoE shape; every full tensor of its
    first rounds, in each arm, equals what the ranks filled in."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gather_fsdp.py"), "--device", "cpu", "--world", "3",
                          "--model", "tiny-moe", "--rounds", "2", "--json"],
                         capture_output=True, text=True, timeout=170, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["right"] and r["wrong"] == [] and r["world"] == 3 and r["tensors"] == 117
    assert r["windows_per_round"] >= 1 and r["peak_GB"] <= r["budget_GB"]
    assert r["windows_over_bound"] == pytest.approx(r["windows_s"] / r["bound_s"], rel=0.1)  # (both rounded)
    for arm in ("windows_s", "one_at_a_time_s", "full_tensor_s"):
        assert r[arm] > 0


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.skipif(not (__import__("torch").cuda.is_available() and __import__("torch").cuda.device_count() >= 2),
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("model, fp8", [("tiny-dense", False), ("tiny-moe", False), ("tiny-dense", True)],
                         ids=["dense", "moe", "fp8"])
def test_two_fsdp_trainers_to_two_tp_ranks_colocated_on_gpus(model, fp8):
    """2 -> 2 colocated over CUDA IPC with the compiled launches (copy kernels and batches, pitched rows
    in one table, FP8 rows written in place by one launch per group): every TP slice bit-exact (FP8
    within its bound), every round after the link timings counted."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer_mn.py"), "--device", "cuda", "--json",
                          "--senders", "2", "--receivers", "2", "--colocated", "--model", model, "--rounds", "10",
                          "--no-broadcast", *(["--fp8"] if fp8 else [])],
                         capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["case"] == "2 -> 2 colocated" and r["transport"] == "cuda_ipc" and r["fp8"] == fp8
    assert r["bit_exact"] and r["mismatches"] == {}
    assert r["rounds_measured"] >= 1 and all(s["compiles"] <= 4 for s in r["senders"].values())
    assert ("quantize_bound_ms" in r) == fp8 and r.get("quantize_bound_ms", 1) > 0  # (reading bf16 counts too)


def test_one_gpu_runs_the_empty_colocated_case_alone_and_says_so_otherwise():
    """``--one-gpu`` (every rank on GPU 0) is for the empty model's control path: anything else is refused
    by name, before a process starts."""
    sys.path.insert(0, str(ROOT / "bench"))
    from mn_setup import Case

    with pytest.raises(SystemExit, match="--one-gpu runs the empty model, colocated, on CUDA"):
        Case("qwen2.5-7b", 2, 2, "cuda", colocated=True, one_gpu=True).check()
    with pytest.raises(SystemExit, match="--one-gpu"):
        Case("empty", 2, 2, "cuda", colocated=False, one_gpu=True).check()
    case = Case("empty", 2, 2, "cuda", colocated=True, one_gpu=True)
    assert {case.sender_device(r) for r in (0, 1)} == {case.receiver_device(r) for r in (0, 1)} == {"cuda:0"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer_mn.py"), "--one-gpu", "--model", "empty",
                          "--colocated"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode != 0 and "--one-gpu needs --no-broadcast" in run.stderr
