"""Membership churn (bench/churn.py) at small N: 4 senders x 8 receivers, one sender and one receiver
replaced by new sessions every cycle at a random moment; no false commit, no stall, no wrong blame."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
async def test_thirty_churn_cycles_commit_only_what_receivers_serve():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "churn.py"), "--cycles", "30", "--seed", "1", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), 280)
    figures = json.loads(out.decode().strip().splitlines()[-1])
    assert figures["cycles"] == 30 and figures["committed"] > 0, figures
    for key in ("false_commits", "stalls", "wrong_blame", "rollbacks", "mismatches", "untyped"):
        assert figures[key] == 0, (key, figures["problems"])
    assert proc.returncode == 0
