"""Trust and churn: each test is an attack or a churn race that broke the controller or a worker, driven
deterministically (gates and events, never timing), over real ZeroMQ and TCP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

import pytest
import torch
import zmq
import zmq.asyncio

from children import free_port
from proc_helpers import mismatches, push, receiver_tensors, sender_tensors, update_in_place
from weightsync.engine.errors import ConfigError, ControllerLost, PlanError, RoundAborted, TransportError
from weightsync.engine.logs import Repeats
from weightsync.engine.transport import TransportOptions
from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender
from weightsync.roles import rounds
from weightsync.wire import Envelope, encode
from weightsync.wire import messages as m
from weightsync.wire.auth import sign

KEY = b"k" * 32
FAST = ControllerOptions(heartbeat_s=0.05, timeout_s=1.0, checksum="crc32")
WATCHDOG = 30


async def push_all(senders, version):
    handles = []
    for sender, tensors in senders:
        update_in_place(tensors, version)
        handles.append(sender.push_nowait(version))
    return await asyncio.wait_for(asyncio.gather(*handles), WATCHDOG)


def consistent(ctl, receivers):
    """The controller's committed version is what every receiver serves."""
    return all(r.version == ctl.committed for r in receivers)


class Gate:
    """Holds the controller's planning thread until released, and says when one is held."""

    def __init__(self, ctl) -> None:
        self.entered, self.release, self.held = threading.Event(), threading.Event(), 0
        original = ctl.planning.plan_and_encode

        def gated(*args):
            self.held += 1
            self.entered.set()
            self.release.wait(WATCHDOG)
            return original(*args)

        ctl.planning.plan_and_encode = gated

    async def wait_entered(self) -> None:
        await asyncio.wait_for(asyncio.to_thread(self.entered.wait, WATCHDOG), WATCHDOG)


# --- churn -----------------------------------------------------------------------------------------


async def sigkill(ctl: Controller) -> None:
    """The controller as SIGKILL leaves it: its socket gone, its tasks stopped, nothing said."""
    ctl._chan.close()
    tasks = [t for t in [*ctl._tasks, ctl.rounds.task] if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_plan_made_for_a_session_that_was_replaced_meanwhile_is_void_and_made_again():
    """sender/1 leaves and a new session of it joins while the plan is made for the one before: the
    plan is never installed (begin would reach a session that never got it); it is made again."""
    ts = [sender_tensors(0), sender_tensors(0), sender_tensors(0)]
    recvs = [receiver_tensors(), receiver_tensors()]
    async with Controller(senders=2, receivers=2, options=FAST) as ctl, \
            WeightSender(ctl.address, ts[0], rank=0) as s0, \
            WeightReceiver(ctl.address, recvs[0], rank=0) as r0, WeightReceiver(ctl.address, recvs[1], rank=1) as r1:
        s1 = await WeightSender(ctl.address, ts[1], rank=1).__aenter__()
        first = await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push_all([(s0, ts[0]), (s1, ts[1])], 1)
        gate = Gate(ctl)
        await s1.close()  # leaves: the controller plans for sender/0 alone, held at the gate
        await gate.wait_entered()
        async with WeightSender(ctl.address, ts[2], rank=1) as s1b:  # a new session of sender/1 meanwhile
            gate.release.set()
            plan = await asyncio.wait_for(ctl.wait_plan(first.plan_id + 1), WATCHDOG)
            assert ctl.planning.sessions[(m.Role.SENDER, 1)] == s1b._channel.sock.getsockopt(zmq.ROUTING_ID)
            assert gate.held == 2 and plan.plan_id == first.plan_id + 2  # the void plan was never installed
            await push_all([(s0, ts[0]), (s1b, ts[2])], 2)
            await asyncio.wait_for(asyncio.gather(r0.wait_for(2), r1.wait_for(2)), WATCHDOG)
            await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)  # (every commit_ack reached the controller)
        assert [r.ok for r in ctl.reports] == [True, True] and consistent(ctl, [r0, r1])
        assert mismatches(recvs[0], 2) == [] and mismatches(recvs[1], 2) == []


async def test_a_planned_sender_replaced_before_the_round_starts_never_gets_begin():
    """sender/0 has pushed v2 under an acknowledged plan; sender/1's session is replaced before it
    pushes (its replan held until the new session is in): the push waits for the new session's, and
    v2 commits under the plan made for it."""
    ts = [sender_tensors(0), sender_tensors(0), sender_tensors(0)]
    recv = receiver_tensors()
    async with Controller(senders=2, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, ts[0], rank=0) as s0, WeightReceiver(ctl.address, recv, rank=0) as r0:
        s1 = await WeightSender(ctl.address, ts[1], rank=1).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push_all([(s0, ts[0]), (s1, ts[1])], 1)
        update_in_place(ts[0], 2)
        pending = s0.push_nowait(2)
        await asyncio.wait_for(ctl.waiters.wait(lambda: 2 in ctl.rounds.pushes.pushes), WATCHDOG)  # sender/0's push is in
        gate = Gate(ctl)
        await s1.close()
        await gate.wait_entered()
        async with WeightSender(ctl.address, ts[2], rank=1) as s1b:
            gate.release.set()
            update_in_place(ts[2], 2)
            await asyncio.wait_for(asyncio.gather(pending, s1b.push_nowait(2)), WATCHDOG)
        await asyncio.wait_for(r0.wait_for(2), WATCHDOG)
        assert [r.ok for r in ctl.reports] == [True, True] and consistent(ctl, [r0]) and mismatches(recv, 2) == []
        # sender/0 wrote v2 under its arm before the replan, which kept its table and the receiver: kept too
        assert (await ctl.wait_round(2)).armed == 1


async def test_any_failure_inside_a_round_aborts_it_and_never_records_a_commit(monkeypatch):
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, ts, rank=0) as s0, WeightReceiver(ctl.address, recv, rank=0) as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        real = rounds.RoundState.fence_for
        monkeypatch.setattr(rounds.RoundState, "fence_for", lambda self, r: 1 / 0)  # a bug of the controller's
        with pytest.raises(RoundAborted, match="ZeroDivisionError") as info:
            await push(s0, ts, 2)
        assert info.value.culprit == "controller"
        assert ctl.committed == 1 and r0.version == 1 and mismatches(recv, 1) == []
        monkeypatch.setattr(rounds.RoundState, "fence_for", real)
        await push(s0, ts, 3)  # nothing is left stuck: the next round commits
        await asyncio.wait_for(r0.wait_for(3), WATCHDOG)
        assert consistent(ctl, [r0]) and mismatches(recv, 3) == []


async def test_a_controller_killed_after_its_first_commit_message_is_finished_by_its_successor():
    """The controller dies right after telling receiver/0 to commit v2: receiver/0 serves v2, receiver/1
    is prepared, the sender does not know. The restarted controller learns v2 from receiver/0, its plan
    says so: receiver/1 applies v2 and the sender's handle resolves (not ControllerLost)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    ts, recvs = sender_tensors(0), [receiver_tensors(), receiver_tensors()]
    ctl = Controller(addr, senders=1, receivers=2, options=FAST)
    await ctl.start()
    first_commit, never = asyncio.Event(), asyncio.get_running_loop().create_future()
    send = ctl._send

    async def send_then_die(peer, body, **kw):
        await send(peer, body, **kw)
        if isinstance(body, m.Commit):
            first_commit.set()
            await never  # (the process is gone: nothing more leaves it)

    async with WeightSender(addr, ts, rank=0) as s0, \
            WeightReceiver(addr, recvs[0], rank=0) as r0, WeightReceiver(addr, recvs[1], rank=1) as r1:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        ctl.rounds.send = send_then_die  # (the round part sends the commits)
        update_in_place(ts, 2)
        handle = await asyncio.wait_for(s0.push(2), WATCHDOG)
        await asyncio.wait_for(first_commit.wait(), WATCHDOG)
        await asyncio.wait_for(r0.wait_for(2), WATCHDOG)
        await sigkill(ctl)
        assert r1.version == 1 and r1.prepared == 2
        async with Controller(addr, senders=1, receivers=2, options=FAST) as ctl2:
            assert await asyncio.wait_for(handle, WATCHDOG) == 2  # the outcome, from the new controller's plan
            await asyncio.wait_for(r1.wait_for(2), WATCHDOG)
            assert ctl2.committed == 2 and r0.version == r1.version == 2
            assert mismatches(recvs[0], 2) == [] and mismatches(recvs[1], 2) == []
            await push(s0, ts, 3)
            await asyncio.wait_for(asyncio.gather(r0.wait_for(3), r1.wait_for(3)), WATCHDOG)
            await asyncio.wait_for(ctl2.wait_round(3), WATCHDOG)  # (its commit_acks reached ctl2 too)
            assert consistent(ctl2, [r0, r1]) and mismatches(recvs[1], 3) == []


async def test_a_version_prepared_when_the_controller_died_is_dropped_and_the_next_round_lands():
    """The controller dies once both receivers have verified v2, before any commit leaves it: both are
    prepared for v2, which nobody committed. The restarted controller's plan says v1: each receiver
    drops v2 and opens its landing slot again, so v3's writes land (a slot left shut refuses them, and
    the round would be aborted blaming the sender)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    ts, recvs = sender_tensors(0), [receiver_tensors(), receiver_tensors()]
    ctl = Controller(addr, senders=1, receivers=2, options=FAST)
    await ctl.start()
    verified, never = asyncio.Event(), asyncio.get_running_loop().create_future()
    send = ctl.rounds.send

    async def die_before_commit(peer, body, **kw):
        if isinstance(body, m.Commit):
            verified.set()
            await never  # (the process is gone: nothing more leaves it)
        await send(peer, body, **kw)

    async with WeightSender(addr, ts, rank=0) as s0, \
            WeightReceiver(addr, recvs[0], rank=0) as r0, WeightReceiver(addr, recvs[1], rank=1) as r1:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        ctl.rounds.send = die_before_commit
        update_in_place(ts, 2)
        handle = await asyncio.wait_for(s0.push(2), WATCHDOG)
        await asyncio.wait_for(verified.wait(), WATCHDOG)
        await sigkill(ctl)
        assert (r0.version, r0.prepared, r1.version, r1.prepared) == (1, 2, 1, 2)
        assert r0.transport.guard.open == r1.transport.guard.open == frozenset()  # a verified slot takes no writes
        async with Controller(addr, senders=1, receivers=2, options=FAST) as ctl2:
            with pytest.raises((RoundAborted, ControllerLost)):
                await asyncio.wait_for(handle, WATCHDOG)  # v2 never committed
            await asyncio.wait_for(ctl2.wait_ready(), WATCHDOG)
            assert (r0.prepared, r1.prepared) == (None, None) and mismatches(recvs[0], 1) == []
            assert all(r.landing_slot in r.transport.guard.open for r in (r0, r1))
            await push(s0, ts, 3)
            await asyncio.wait_for(asyncio.gather(r0.wait_for(3), r1.wait_for(3)), WATCHDOG)
            await asyncio.wait_for(ctl2.wait_round(3), WATCHDOG)
            assert [r.ok for r in ctl2.reports] == [True], [r.reason for r in ctl2.reports]
            assert consistent(ctl2, [r0, r1]) and mismatches(recvs[0], 3) == [] and mismatches(recvs[1], 3) == []


async def test_a_push_that_committed_while_its_completions_drained_returns_when_the_session_ends():
    """A round may commit before the sender's last completions drain. If they never do (acks held up by
    a partition, say) and then the controller goes silent, ``push()`` still returns (nothing reads the
    tensors any more) and the handle says the version committed; it waited for ever before."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    ts, recv = sender_tensors(0), receiver_tensors()
    ctl = Controller(addr, senders=1, receivers=1, options=FAST)
    await ctl.start()
    async with WeightSender(addr, ts, rank=0) as s0, WeightReceiver(addr, recv, rank=0) as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        held, run = asyncio.Event(), s0.pipeline.run

        async def undrained(*args, **kw):
            report = await run(*args, **kw)
            if kw.get("epoch") == 2:
                await held.wait()  # (its completions never come)
            return report
        s0.pipeline.run = undrained
        update_in_place(ts, 2)
        pushing = asyncio.ensure_future(s0.push(2))
        assert (await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)).ok
        await asyncio.wait_for(r0.wait_for(2), WATCHDOG)
        assert not pushing.done() and not held.is_set()
        await sigkill(ctl)
        handle = await asyncio.wait_for(pushing, WATCHDOG)  # (the sender noticed the silence: session lost)
        assert await asyncio.wait_for(handle, WATCHDOG) == 2 and mismatches(recv, 2) == []


async def test_a_plan_a_sender_could_not_take_is_made_again_for_the_same_members():
    """The sender cannot reach its receiver when the plan comes (a partition that heals, the membership
    unchanged): it refuses the plan, and the controller plans again a heartbeat timeout later rather
    than wait for a membership change that never comes; the push commits."""
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0) as r0:
        s0 = WeightSender(ctl.address, ts, rank=0)
        refused = []
        real_connect = None

        async def unreachable_once(peer, key):
            if not refused:
                refused.append(peer.rank)
                raise TransportError(f"cannot connect to {peer.transport.address}: no challenge (test)")
            return await real_connect(peer, key)

        def patch(transport):
            nonlocal real_connect
            real_connect = transport.connect
            transport.connect = unreachable_once
        s0._on_transport = patch
        async with s0:
            await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
            assert refused == [0] and ctl.planning.plan.plan_id == 2  # (plan 1 refused, plan 2 taken)
            await push(s0, ts, 1)
            await asyncio.wait_for(r0.wait_for(1), WATCHDOG)
            assert mismatches(recv, 1) == []


async def test_sixteen_receivers_of_a_host_restarting_at_once_all_rejoin_promptly():
    opts = ControllerOptions(heartbeat_s=0.1, timeout_s=1.0)
    ts = sender_tensors(0)
    async with Controller(senders=1, receivers=16, options=opts) as ctl, WeightSender(ctl.address, ts, rank=0) as s0:
        old = [await WeightReceiver(ctl.address, receiver_tensors(), rank=r).__aenter__() for r in range(16)]
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        for r in old:  # the host restarts: every process dies at once, saying nothing
            r._channel.close()
            for task in r._tasks:
                task.cancel()
            await asyncio.gather(*r._tasks, return_exceptions=True)
            await r.transport.close()
        t0 = asyncio.get_running_loop().time()
        new = await asyncio.wait_for(asyncio.gather(*[
            WeightReceiver(ctl.address, receiver_tensors(), rank=r).__aenter__() for r in range(16)]), WATCHDOG)
        joined_s = asyncio.get_running_loop().time() - t0
        await push(s0, ts, 2)
        await asyncio.wait_for(asyncio.gather(*[r.wait_for(2) for r in new]), WATCHDOG)
        took = asyncio.get_running_loop().time() - t0
        assert joined_s < 2 * opts.timeout_s and took < 2 * opts.timeout_s + 1.0, (joined_s, took)
        await asyncio.wait_for(ctl.wait_round(2), WATCHDOG)  # (every commit_ack reached the controller)
        assert consistent(ctl, new) and all(mismatches(r.tensors, 2) == [] for r in new)
        for r in new:
            await r.close()
        for r in old:
            r._channel = None
            await r.close()


# --- the control plane -------------------------------------------------------------------------------


class Tap:
    """A TCP relay between a worker and the controller that records both directions (a passive observer
    on the path)."""

    def __init__(self, target: str) -> None:
        self.host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.port = int(port)
        self.up, self.down = bytearray(), bytearray()  # worker -> controller, controller -> worker
        self.server = None
        self.tasks: list[asyncio.Task] = []
        self.writers = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, self.port)
        self.writers += [writer, up_w]
        self.tasks += [asyncio.ensure_future(self._pump(reader, up_w, self.up)),
                       asyncio.ensure_future(self._pump(up_r, writer, self.down))]

    @staticmethod
    async def _pump(reader, writer, record) -> None:
        while data := await reader.read(65536):
            record += data
            writer.write(data)
            await writer.drain()
        writer.close()

    async def __aexit__(self, *exc) -> None:
        for w in self.writers:
            w.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.server.close()
        await self.server.wait_closed()


async def test_a_passive_observer_learns_no_key_and_its_recording_replays_to_nothing():
    name = "model.layers.0.distinctive_parameter_name"
    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, auth_key=KEY)
    ts = {name: torch.arange(64, dtype=torch.float32)}
    async with Controller(senders=1, receivers=1, options=opts) as ctl:
        stream_port = ctl._chan.streams.listener.port
        tap, stream_tap = Tap(ctl.address), Tap(f"tcp://127.0.0.1:{stream_port}")
        async with tap as tapped, stream_tap as stream_tapped:
            ctl._chan.streams.listener.port = int(stream_tapped.rpartition(":")[2])  # (sessions' streams pass the observer too)
            async with WeightSender(tapped, ts, rank=0, options=SenderOptions(auth_key=KEY)) as s0, \
                    WeightReceiver(ctl.address, {name: torch.zeros(64)}, rank=0,
                                   options=ReceiverOptions(auth_key=KEY)) as r0:
                await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
                handle = await asyncio.wait_for(s0.push(1), WATCHDOG)
                await asyncio.wait_for(handle, WATCHDOG)
                pair_key = s0._conn_keys[0][1]
                for seen in (tap.up, tap.down, stream_tap.up, stream_tap.down):
                    assert pair_key not in seen and name.encode() not in seen  # (the manifest, the plan)
                assert len(tap.up) > 1000 and min(len(stream_tap.up), len(stream_tap.down)) > 1000
                # the recordings, replayed from fresh connections by a party without the key
                identity, peers, refused = s0._channel.sock.getsockopt(zmq.ROUTING_ID), dict(ctl.peers), ctl._chan.refused
                host, _, port = ctl.address.removeprefix("tcp://").rpartition(":")
                for where, recording in ((int(port), tap.up), (stream_port, stream_tap.up)):
                    with socket.create_connection((host, where)) as raw:
                        raw.sendall(bytes(recording))
                        refused += 1
                        await asyncio.wait_for(ctl._chan.wait_refused(refused), WATCHDOG)
                assert ctl.peers == peers and ctl.peers[identity].name == "sender/0"  # no rank held, nobody kicked out
                ts[name].add_(1)
                await asyncio.wait_for(await asyncio.wait_for(s0.push(2), WATCHDOG), WATCHDOG)
                await asyncio.wait_for(r0.wait_for(2), WATCHDOG)
                assert torch.equal(r0.tensors[name], ts[name])


async def test_a_keyless_client_cannot_take_a_live_senders_routing_id():
    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0, auth_key=KEY)
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=opts) as ctl, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(auth_key=KEY)) as s0, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(auth_key=KEY)) as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        identity = s0._channel.sock.getsockopt(zmq.ROUTING_ID)
        ctx = zmq.asyncio.Context()
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.ROUTING_ID, identity)
        try:
            refused = ctl._chan.refused
            thief.connect(ctl.address)
            hello = m.Hello(m.Role.SENDER, 0, "x", "cpu", 1, 2, 0, (), s0._hello_manifest, s0.transport_info)
            await thief.send_multipart(sign(encode(Envelope(hello, 99, "thief")), b"x" * 32))
            await asyncio.wait_for(ctl._chan.wait_refused(refused + 1), WATCHDOG)
            await push(s0, ts, 1)  # the route is still the real sender's: its round goes through
            await asyncio.wait_for(r0.wait_for(1), WATCHDOG)
            assert await thief.poll(0) == 0  # it never received anything (its handshake never completed)
            assert ctl.membership.by_rank[(m.Role.SENDER, 0)] == identity
        finally:
            thief.close()
            ctx.term()


async def test_a_worker_whose_control_pipe_is_gone_closes_at_once_and_a_live_one_rejoins():
    """A DEALER whose connection ended in a failed handshake (a key or mechanism mismatch) has no pipe
    left, and a blocking send on it waits forever. ``disconnect`` leaves the same state, deterministically.
    The worker's leave, hello and heartbeats never wait on it: closing returns, and a worker left
    running notices the silence, fails the push it had in flight, joins again and commits the next.
    (Sessions on ZeroMQ throughout: a session stream's sends never wait, and one that closes ends its
    session at once, tests/roles/test_streams.py.)"""
    ts, recv = sender_tensors(0), receiver_tensors()
    zmq_only = ReceiverOptions(session_stream=False)
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightSender(ctl.address, ts, rank=0, options=SenderOptions(session_stream=False)) as s0, \
            WeightReceiver(ctl.address, recv, rank=0, options=zmq_only) as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        r0._channel.sock.disconnect(ctl.address)
        await asyncio.wait_for(r0.close(), WATCHDOG)  # (its leave finds no pipe)
        async with WeightReceiver(ctl.address, receiver_tensors(), rank=0, options=zmq_only) as r1:
            s0._channel.sock.disconnect(ctl.address)
            with pytest.raises(ControllerLost, match="silent"):
                await push(s0, ts, 2)  # its push message waits on the dead pipe; its heartbeats never do
            await push(s0, ts, 3)  # (a fresh channel and session)
            await asyncio.wait_for(r1.wait_for(3), WATCHDOG)
            assert s0.sessions == 2 and mismatches(r1.tensors, 3) == []


def test_an_auth_key_shorter_than_sixteen_bytes_is_refused_at_construction():
    for make in (lambda: ControllerOptions(auth_key=b"12345678"), lambda: SenderOptions(auth_key=b"12345678"),
                 lambda: ReceiverOptions(auth_key=b"short")):
        with pytest.raises(ConfigError, match="auth_key: needs at least 16 bytes"):
            make()


# --- the data plane's front door ----------------------------------------------------------------------


def _stranger(address: str, header: bytes = b"") -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    if header:
        sock.sendall(header)
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    sock.settimeout(WATCHDOG)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            out += chunk
    return out


async def test_idle_strangers_are_bounded_and_timed_out_and_a_restarted_sender_still_commits():
    door = TransportOptions(handshake_timeout_s=1.0, max_unauthenticated=32, max_unauthenticated_per_address=32)
    ts, ts2, recv = sender_tensors(0), sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=FAST) as ctl, \
            WeightReceiver(ctl.address, recv, rank=0, options=ReceiverOptions(transport_options=door)) as r0:
        s0 = await WeightSender(ctl.address, ts, rank=0).__aenter__()
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        address = r0.transport.address
        strangers = await asyncio.to_thread(  # (off the loop: the receiver accepts them meanwhile)
            lambda: [_stranger(address) for _ in range(200)] + [_stranger(address, b"\x01" * 9) for _ in range(10)])
        try:
            await s0.close()
            async with WeightSender(ctl.address, ts2, rank=0) as s1:  # restarted: connects past the strangers
                await push(s1, ts2, 2)
                await asyncio.wait_for(r0.wait_for(2), WATCHDOG)
                assert mismatches(recv, 2) == []
                await asyncio.gather(*[asyncio.to_thread(_read_to_eof, s) for s in strangers])  # all closed by us
                door = r0.transport.door
                assert not door.waiting and door.most == 32  # the cap was reached and never passed ...
                assert door.evicted + door.timed_out >= 200  # ... and every idle stranger was closed by it or by
                #  the handshake timeout (how many each: how fast the 210 arrived, against the 1 s timeout)
        finally:
            for s in strangers:
                s.close()


async def test_a_write_under_another_round_during_an_open_round_fails_it_and_is_blamed_on_its_sender():
    """A holder of a pair key writes into the live region under round v+1000 once round v has opened it
    (an in-place receiver, checksums off; the round's own writes wait for it): round v's fence sees it
    and aborts, blaming that sender, and the next round repairs the live bytes."""
    ts, recv = sender_tensors(0), receiver_tensors()
    opts = ControllerOptions(heartbeat_s=0.05, timeout_s=2.0)
    rogue_done, rogues = asyncio.Event(), []

    async def rogue(version):
        conn = s0.conns[0]
        await conn.write(torch.full((16,), float("nan")), 0, 0, version + 1000)
        await asyncio.wait_for(conn.fence(), WATCHDOG)
        rogue_done.set()

    class Opened(WeightReceiver):
        def _open_regions(self, round_open: bool) -> None:
            super()._open_regions(round_open)
            if round_open and self._pending == 2:  # round 2 just opened the live region
                rogues.append(asyncio.ensure_future(rogue(2)))

    async with Controller(senders=1, receivers=1, options=opts) as ctl, \
            WeightSender(ctl.address, ts, rank=0) as s0, Opened(ctl.address, recv, rank=0, mode="inplace") as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        run = s0.pipeline.run

        async def after_the_rogue(*args, **kwargs):
            if kwargs.get("epoch") == 2:
                await asyncio.wait_for(rogue_done.wait(), WATCHDOG)
            return await run(*args, **kwargs)

        s0.pipeline.run = after_the_rogue
        with pytest.raises(RoundAborted, match=r"wrote under round\(s\) \[1002\] during round 2") as info:
            await push(s0, ts, 2)
        await asyncio.gather(*rogues)
        assert info.value.culprit == "sender/0" and r0.version == 1 and r0.dirty  # (nothing committed)
        await push(s0, ts, 3)
        await asyncio.wait_for(r0.wait_for(3), WATCHDOG)
        assert mismatches(recv, 3) == [] and not r0.dirty


async def test_a_write_under_a_future_round_before_begin_fails_the_fence_not_the_weights():
    ts, recv = sender_tensors(0), receiver_tensors()
    async with Controller(senders=1, receivers=1, options=ControllerOptions(heartbeat_s=0.05, timeout_s=2.0)) as ctl, \
            WeightSender(ctl.address, ts, rank=0) as s0, WeightReceiver(ctl.address, recv, rank=0) as r0:
        await asyncio.wait_for(ctl.wait_ready(), WATCHDOG)
        await push(s0, ts, 1)
        conn = s0.conns[0]
        await conn.write(torch.full((16,), float("nan")), r0.landing_slot, 0, 1002)  # lands: no round is open
        await asyncio.wait_for(conn.fence(), WATCHDOG)
        with pytest.raises(RoundAborted, match=r"wrote under round\(s\) \[1002\]") as info:
            await push(s0, ts, 2)
        assert info.value.culprit == "sender/0" and r0.version == 1 and mismatches(recv, 1) == []
        await push(s0, ts, 3)
        await asyncio.wait_for(r0.wait_for(3), WATCHDOG)
        assert mismatches(recv, 3) == []


# --- bad input: typed, prompt, naming the culprit ---------------------------------------------------


@pytest.mark.parametrize("receiver_first", [True, False])
async def test_a_receiver_wanting_a_parameter_no_sender_has_fails_promptly(receiver_first):
    ts = {"a": torch.zeros(4)}
    wants = {"a": torch.zeros(4), "nowhere": torch.zeros(4)}
    async with Controller(senders=1, receivers=1, options=FAST) as ctl:
        if not receiver_first:
            async with WeightSender(ctl.address, ts, rank=0):
                with pytest.raises(Exception, match="nowhere"):
                    await WeightReceiver(ctl.address, wants, rank=0).__aenter__()
            return
        async with WeightReceiver(ctl.address, wants, rank=0) as r0, WeightSender(ctl.address, ts, rank=0) as s0:
            with pytest.raises(PlanError, match="nowhere"):
                await asyncio.wait_for(r0.wait_for(1), WATCHDOG)
            with pytest.raises(PlanError, match="nowhere"):
                await asyncio.wait_for(s0.push_nowait(1), WATCHDOG)


async def test_push_on_a_sender_never_started_is_a_typed_error():
    sender = WeightSender("tcp://127.0.0.1:1", {"a": torch.zeros(2)}, rank=0)
    with pytest.raises(ConfigError, match="not started"):
        sender.push_nowait(1)


@pytest.mark.parametrize("name, match", [("", "1..1024 bytes, got 0"), ("bad\ud800name", "valid UTF-8"),
                                         ("x" * (70 << 20), "1..1024 bytes")])
def test_a_parameter_name_that_cannot_travel_is_refused_at_construction(name, match):
    for role in (WeightSender, WeightReceiver):
        with pytest.raises(ConfigError, match=match):
            role("tcp://127.0.0.1:1", {name: torch.zeros(2)}, rank=0)


def test_meta_and_sparse_tensors_are_refused_at_construction_naming_the_parameter():
    with pytest.raises(ConfigError, match=r"params\['w'\].*meta-device"):
        WeightSender("tcp://127.0.0.1:1", {"w": torch.empty(4, device="meta")}, rank=0)
    with pytest.raises(ConfigError, match=r"params\['s'\].*sparse_coo"):
        WeightReceiver("tcp://127.0.0.1:1", {"s": torch.zeros(4).to_sparse()}, rank=0)


def test_repeated_log_lines_are_aggregated_per_key(caplog):
    log = logging.getLogger("weightsync.test")
    repeats = Repeats(log, every_s=10.0)
    with caplog.at_level(logging.WARNING, "weightsync.test"):
        for i in range(20_000):
            repeats.log(("10.0.0.1", "bad"), "refused 10.0.0.1", now=i * 0.001)  # 20 s of a flood
        repeats.log(("10.0.0.2", "bad"), "refused 10.0.0.2", now=20.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "more like it" in lines[1] and repeats.total == 20_001
    assert lines[1].endswith("(and 9999 more like it in the last 10.0 s)")


@pytest.mark.parametrize("make", [
    lambda: Controller("tcp://0.0.0.0:0", senders=1, receivers=1),
    lambda: SenderOptions(transport_options=TransportOptions(bind_host="198.18.0.1")),
    lambda: ReceiverOptions(transport_options=TransportOptions(bind_host="0.0.0.0")),
])
def test_a_bind_other_hosts_can_reach_needs_an_auth_key(make):
    with pytest.raises(ConfigError, match="reachable from other hosts"):
        make()


def test_loopback_and_keyed_binds_are_fine():
    Controller("tcp://127.0.0.1:0", senders=1, receivers=1)
    Controller("tcp://0.0.0.0:0", senders=1, receivers=1, options=ControllerOptions(auth_key=KEY))
    SenderOptions(transport_options=TransportOptions(bind_host="198.18.0.1"), auth_key=KEY)
    ReceiverOptions(transport_options=TransportOptions(bind_host="::1"))


def test_a_silence_that_began_as_nobody_was_heard_is_the_controller_s():
    """``Hearing``: with two or more members, a stretch of ``quiet_s`` in which none was heard is the
    controller's own network; a member that went quiet as it began, or joins again as a new session
    shortly after it, is not blamed (a cut controller host, healed before or after the timeout); one
    that went quiet long before, or while others talked, is."""
    from weightsync.roles.membership import Hearing

    h = Hearing(0.3)
    for t in (0.0, 0.05, 0.1, 0.15):  # two members beating, as ever
        h.heard(t, members=2)
    assert h.explains(0.1, now=1.5, members=2)  # nobody heard since 0.15: an ongoing spell, begun 0.05 after
    assert not h.explains(0.1, now=0.2, members=2)  # (no spell yet)
    h.heard(1.5, members=2)  # healed: the spell was (0.15, 1.5)
    assert h.explains(0.12, now=1.6, members=2) and h.spell == (0.15, 1.5)
    assert not h.explains(-2.0, now=1.6, members=2)  # quiet long before the spell: its own silence
    assert not h.explains(1.5, now=3.0, members=1)  # one member: its silence and ours look alike
    r = Hearing(0.3)
    for t in (0.0, 0.1, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1):  # a spell (0.1, 0.9)
        r.heard(t, members=2)
    assert r.recent(now=1.5, within=1.0, members=2) and not r.recent(now=2.1, within=1.0, members=2)
    solo = Hearing(0.3)
    for t in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5):  # another member talks on: no spell
        solo.heard(t, members=2)
    assert not solo.explains(0.0, now=0.55, members=2)
