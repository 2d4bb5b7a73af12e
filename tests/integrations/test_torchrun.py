"""A real ``torchrun`` job of two trainer ranks pushes to a receiver in this process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import sys

import pytest

from weightsync.roles import ReceiverOptions, WeightReceiver
from weightsync.roles.integrations.torchrun import Placement

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import torchrun_child  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this interpreter")
async def test_torchrun_ranks_find_the_controller_and_split_the_push():
    steps = 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "torchrun_child.py"), str(steps), "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT)
    try:
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        options = ReceiverOptions(auth_key=bytes.fromhex(first["key"]))
        async with contextlib.AsyncExitStack() as stack:
            receivers = [await stack.enter_async_context(WeightReceiver(
                first["controller"], {k: v.clone().zero_() for k, v in torchrun_child.expected(0).items()},
                rank=rank, options=options)) for rank in (0, 1)]
            for receiver in receivers:
                assert await asyncio.wait_for(receiver.wait_for(steps), 120) == steps
                for name, want in torchrun_child.expected(steps).items():
                    assert receiver.state_dict()[name].equal(want), name
            lines = [json.loads(line) for line in (await asyncio.wait_for(proc.stdout.read(), 120)).splitlines()]
        assert await asyncio.wait_for(proc.wait(), 120) == 0, (await proc.stderr.read()).decode()[-3000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    sent = {(d["rank"], d["version"]): d["sent"] for d in lines}
    assert set(sent) == {(r, v) for r in (0, 1) for v in (1, 2)}
    total = sum(4 * a * b for a, b in torchrun_child.SHAPES.values())
    for v in (1, 2):
        assert sent[0, v] > 0 and sent[1, v] > 0 and sent[0, v] + sent[1, v] == 2 * total  # both ranks send a part


def test_placement_reads_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    p = Placement.current()
    assert (p.rank, p.world, p.local_rank) == (3, 4, 1)


def test_placement_outside_torchrun_names_what_is_missing(monkeypatch):
    from weightsync.engine.errors import ConfigError

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"\$RANK is not set"):
        Placement.current()
