"""End to end across processes over TCP: bit-exact delivery, and a sender killed mid-round."""

from __future__ import annotations

import asyncio

import pytest

from children import Children
from weightsync.engine.errors import RoundAborted
from proc_helpers import receiver_main, sender_main
from weightsync.roles import Controller, ControllerOptions

pytestmark = pytest.mark.slow
WATCHDOG = 40.0  # per report


@pytest.mark.parametrize("n_send,n_recv", [(1, 1), (2, 3), (4, 2)])
async def test_bit_exact_across_processes(n_send, n_recv):
    versions = [1, 2]
    kids = Children()
    opts = ControllerOptions(heartbeat_s=0.2, timeout_s=20.0, checksum="crc32")
    try:
        async with Controller(senders=n_send, receivers=n_recv, options=opts) as ctl:
            for r in range(n_send):
                kids.start("sender", r, sender_main, ctl.address, r, versions)
            for r in range(n_recv):  # the last receiver keeps embed/lm_head untied: both names move
                kids.start("receiver", r, receiver_main, ctl.address, r, versions, "shadow", r != n_recv - 1)
            await kids.expect("joined", n_send + n_recv)
            for v in versions:
                reports = await kids.expect("committed", n_send + n_recv)
                for _, role, rank, data in reports:
                    if role == "receiver":
                        got_v, version, bad = data
                        assert (got_v, version, bad) == (v, v, []), f"receiver {rank}"
                report = await asyncio.wait_for(ctl.wait_round(v), WATCHDOG)
                assert report.ok
                assert len({l.sender for l in report.links}) == min(n_send, n_recv)  # tiny model: one chunk each
    finally:
        kids.close()


async def test_sender_killed_mid_round_aborts_and_rejoin_recovers():
    kids = Children()
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=1.0, checksum="crc32")
    try:
        async with Controller(senders=1, receivers=2, options=opts) as ctl:
            kids.start("sender", 0, sender_main, ctl.address, 0, [1, 2], 2)
            for r in range(2):
                kids.start("receiver", r, receiver_main, ctl.address, r, [1, 3])
            await kids.expect("joined", 3)
            await kids.expect("committed", 3)  # version 1 everywhere
            first_plan = ctl.plan.plan_id
            await kids.expect("blocked")  # the sender is mid-round 2: some bytes landed, then it hangs
            kids.kill("sender", 0)
            with pytest.raises(RoundAborted) as e:
                await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)
            assert e.value.culprit == "sender/0" and "PEER_LOST" in str(e.value.reason)
            for _, _, rank, (version, current, intact) in await kids.expect("aborted", 2):
                assert (version, current, intact) == (2, 1, True), f"receiver {rank}"
            kids.start("sender", 0, sender_main, ctl.address, 0, [3])  # restarted, rejoins
            await kids.expect("joined")
            await asyncio.wait_for(ctl.wait_plan(after=first_plan), WATCHDOG)
            for _, role, rank, data in await kids.expect("committed", 3):
                if role == "receiver":
                    assert data == (3, 3, []), f"receiver {rank}"
            assert (await ctl.wait_round(3)).ok
    finally:
        kids.close()
