"""The fault matrix (bench/faults.py) at small N: real processes, SIGKILL, restarts."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
async def test_ten_sigkills_no_half_applied_version_no_rollback_every_trial_resumed():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "faults.py"), "--trials", "10", "--seed", "1", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), 280)
    figures = json.loads(out.decode().strip().splitlines()[-1])
    assert figures["trials"] == 10
    assert figures["half_applied"] == 0 and figures["rollbacks"] == 0, figures["problems"]
    assert figures["resumed_within_limit"] == 10, figures
    assert proc.returncode == 0
