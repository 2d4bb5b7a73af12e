"""Membership churn (bench/churn.py) at small N: 4 senders x 8 receivers, one sender and one receiver
replaced by new sessions every cycle at a random moment; no false commit, no stall, no wrong blame."""

from __future__ import annotations

import json
import sys

import pytest

from children import bench_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_thirty_churn_cycles_commit_only_what_receivers_serve():
    code, figures = await bench_json("churn.py", "--cycles", "30", "--seed", "1")
    assert figures["cycles"] == 30 and figures["committed"] > 0, figures
    for key in ("false_commits", "stalls", "wrong_blame", "rollbacks", "mismatches", "untyped"):
        if figures[key]:  # (the whole of each note: pytest shortens long assertion messages)
            print(json.dumps(figures["problems"], indent=1), file=sys.stderr)
        assert figures[key] == 0, (key, figures["problems"])
    assert code == 0
