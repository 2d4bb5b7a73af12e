"""A worker's heartbeats from its own thread (roles.pulse): a session lives while the caller holds the event
loop (a training step longer than the controller's timeout), and a pulse keeps alive only the session
it names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest
import zmq

from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender
from weightsync.roles.channel import ControlChannel
from weightsync.roles.pulse import SUFFIX
from weightsync.wire import messages as m
from proc_helpers import mismatches, receiver_tensors, sender_tensors, update_in_place

WATCHDOG = 30
KEY = b"k" * 32
OPTS = ControllerOptions(heartbeat_s=0.05, timeout_s=0.5)


def trainer(address: str, ts: dict, pulse: bool, held: threading.Event, go: threading.Event, key=None):
    """A sender in a thread of its own (its own event loop): round 1, then a step that holds the loop
    until ``go``, then round 2. -> (its sessions, v2's outcome)."""
    async def main():
        async with WeightSender(address, ts, rank=0, options=SenderOptions(pulse=pulse, auth_key=key)) as s:
            update_in_place(ts, 1)
            await asyncio.wait_for(await s.push(1), WATCHDOG)
            held.set()
            assert go.wait(WATCHDOG)  # (the training step: synchronous compute, the loop runs nothing)
            update_in_place(ts, 2)
            try:
                await asyncio.wait_for(await s.push(2), WATCHDOG)
                outcome = "committed"
            except Exception as exc:  # (what the push raised, by type)
                outcome = type(exc).__name__
            return s.sessions, outcome
    return asyncio.run(main())


@pytest.mark.parametrize("pulse,key", [(True, None), (True, KEY), (False, None)])
async def test_a_step_that_holds_the_senders_loop_past_the_timeout_keeps_its_session_with_a_pulse(pulse, key):
    """(With a key the pulse passes CURVE, its messages' signatures and the replay guard.)"""
    ts, recv = sender_tensors(0), receiver_tensors()
    held, go = threading.Event(), threading.Event()
    async with Controller(senders=1, receivers=1, options=dataclasses.replace(OPTS, auth_key=key)) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(auth_key=key)) as receiver:
        beats, beat = 0, ctl._beat

        async def counted(seq, now):  # (the step lasts 40 of the controller's silence checks: 4 timeouts)
            nonlocal beats
            await beat(seq, now)
            beats += held.is_set()
            if beats * OPTS.heartbeat_s >= 4 * OPTS.timeout_s:
                go.set()
        ctl._beat = counted
        work = asyncio.ensure_future(asyncio.to_thread(trainer, ctl.address, ts, pulse, held, go, key))
        try:
            await asyncio.wait_for(asyncio.to_thread(go.wait, WATCHDOG), WATCHDOG)
        finally:
            go.set()
        sessions, outcome = await asyncio.wait_for(work, WATCHDOG)
        if pulse:  # one session throughout (never dropped, never joined again), and v2 lands
            assert (sessions, outcome) == (1, "committed")
            assert (await ctl.wait_round(2)).ok and receiver.version == 2 and mismatches(recv, 2) == []
        else:  # (the claim's other side: without it the controller drops the sender, and its push fails)
            assert outcome != "committed" and all(r.version != 2 for r in ctl.reports)


async def test_a_pulse_counts_only_for_the_session_it_extends_and_the_worker_it_names_and_is_never_answered():
    """A pulse whose routing id extends no session, or that names another worker than the session's, is
    dropped unanswered; the session it claims is dropped for its silence all the same."""
    ts = sender_tensors(0)
    async with Controller(senders=1, receivers=1, options=OPTS) as ctl:
        quiet = dataclasses.replace(SenderOptions(), pulse=False)
        sender = await WeightSender(ctl.address, ts, rank=0, options=quiet).__aenter__()
        try:
            (peer,) = ctl.peers.values()
            with contextlib.ExitStack() as stack:
                forged = []
                for identity in (b"nobody" + SUFFIX, peer.identity + SUFFIX):
                    chan = ControlChannel(zmq.DEALER, "receiver/0", identity=identity)
                    stack.callback(chan.close)
                    chan.connect(ctl.address)
                    forged.append(chan)
                for task in sender._tasks:  # (the sender falls silent, as if frozen)
                    task.cancel()
                dropped = asyncio.ensure_future(ctl.waiters.wait(lambda: ctl.membership.get(peer.identity) is None))
                for _ in range(int(WATCHDOG / OPTS.heartbeat_s)):  # (forged pulses all the while it goes quiet)
                    for chan in forged:
                        await chan.send(m.Heartbeat(1))
                    if (await asyncio.wait([dropped], timeout=OPTS.heartbeat_s))[0]:
                        break
                assert dropped.done()
                for chan in forged:  # ordered after the pulses: the first answer is the status reply
                    await chan.send(m.StatusRequest(False))
                    _, env = await asyncio.wait_for(chan.recv(), WATCHDOG)
                    assert isinstance(env.body, m.StatusReply)
        finally:
            await sender.close()
