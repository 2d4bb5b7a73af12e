"""The fault matrix (bench/faults.py) at small N: real processes, SIGKILL, restarts; replicated and
expert-parallel senders."""

from __future__ import annotations

import pytest

from children import bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_ten_sigkills_no_half_applied_version_no_rollback_every_trial_resumed():
    code, figures = await bench_json("faults.py", "--trials", "10", "--seed", "1")
    assert figures["trials"] == 10
    assert figures["half_applied"] == 0 and figures["rollbacks"] == 0, figures["problems"]
    assert figures["resumed_within_limit"] == 10, figures
    assert code == 0


@pytest.mark.timeout(300)
async def test_expert_parallel_senders_any_start_order_and_a_sender_and_receiver_killed_together():
    """Each sender alone holds some experts' rows: the processes start in a random order, and a receiver
    killed with a sender joins again while that sender is down (bench/faults.py --experts)."""
    code, figures = await bench_json("faults.py", "--trials", "6", "--seed", "1", "--experts")
    assert figures["trials"] == 6 and not figures["stuck"], figures["stuck"]
    assert figures["half_applied"] == 0 and figures["rollbacks"] == 0, figures["problems"]
    assert figures["resumed_within_limit"] == 6, figures
    assert sum(n for victim, n in figures["victims"].items() if "+" in victim) >= 2  # (seed 1: three pairs)
    assert code == 0
