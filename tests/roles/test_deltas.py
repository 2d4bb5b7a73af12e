"""Delta rounds end to end: changed bytes only, bit-exact, and whole rows wherever a base is not shared.

The real controller, senders and receivers over ZeroMQ on loopback, the TCP data plane (its abilities
say a delta pays there: ``delta="auto"``). Each version changes a few percent of the bf16 values, most
by one unit in the last place, as an RL step does (``rl_step``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import threading

import pytest
import torch

from weightsync.engine.datapath.deltas import REPROBE, REPROBE_MAX, Bases, window
from weightsync.engine.errors import RoundAborted
from weightsync.roles import Controller, ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver, WeightSender

FAST = dict(heartbeat_s=0.05, timeout_s=2.0)
WATCHDOG = 60
SHAPES = {"embed": (512, 64), "layers.0.w": (256, 256), "layers.0.b": (256,), "layers.1.w": (256, 256),
          "norm": (64,), "head": (64, 512)}
LARGE = 4  # tensors of 16K+ values: their deltas always fit their windows


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in SHAPES.items()}


def rl_step(tensors: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> None:
    """Change ``fraction`` of each tensor's values: most by one unit in the last place, a few far."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        bits = t.view(torch.int16).reshape(-1)
        picked = torch.rand(bits.numel(), generator=g) < fraction
        steps = torch.where(torch.rand(bits.numel(), generator=g) < 0.05,
                            torch.randint(-3000, 3000, (bits.numel(),), generator=g), torch.ones(bits.numel(), dtype=torch.long))
        bits[picked] = (bits[picked].to(torch.int64) + steps[picked]).clamp(-32768, 32767).to(torch.int16)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.int16), b[n].view(torch.int16))]


@contextlib.asynccontextmanager
async def cluster(receivers=("shadow", "inplace"), delta="always", transport="tcp", **ctl):
    send_t = model()
    async with contextlib.AsyncExitStack() as stack:
        c = await stack.enter_async_context(Controller(senders=1, receivers=len(receivers),
                                                       options=ControllerOptions(delta=delta, **FAST, **ctl)))
        sender = await stack.enter_async_context(
            WeightSender(c.address, send_t, rank=0, options=SenderOptions(transport=transport)))
        recvs = []
        for rank, mode in enumerate(receivers):
            recvs.append(await stack.enter_async_context(WeightReceiver(
                c.address, model(seed=100 + rank), rank=rank, mode=mode,
                options=ReceiverOptions(transport=transport))))
        await asyncio.wait_for(c.wait_ready(), WATCHDOG)
        CONTROLLERS[id(sender)] = c
        try:
            yield c, sender, send_t, recvs
        finally:
            CONTROLLERS.pop(id(sender), None)


CONTROLLERS: dict = {}  # id(a cluster's sender) -> its controller, whose rounds ``push`` waits for


async def push(sender, version, controller=None):
    """Push ``version`` and wait for its round to be over: the controller's report. (The sender's push
    completes at its commit; a receiver applies it on its own commit, maybe later: a test that looked at
    the receivers then raced them.)"""
    await asyncio.wait_for(await sender.push(version), WATCHDOG)
    controller = controller if controller is not None else CONTROLLERS[id(sender)]
    return await asyncio.wait_for(controller.wait_round(version), WATCHDOG)


def test_windows_of_rows_never_overlap_and_stay_inside_the_region():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        sizes = torch.randint(1, 5000, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        gaps = torch.randint(0, 64, (len(sizes),), generator=g).tolist()
        offsets, at = [], 0
        for size, gap in zip(sizes, gaps):
            offsets.append(at + gap)
            at += gap + size
        for delta in (16, 1000, at // 8, at):
            spans = [window(o, n, at, delta) for o, n in zip(offsets, sizes)]
            for (s1, c1), (s2, c2) in zip(spans, spans[1:]):
                assert s1 % 16 == 0 and (c1 == 0 or c2 == 0 or s1 + c1 <= s2)
            assert all(s + c <= delta for s, c in spans)


def batched_kernels(monkeypatch) -> None:
    """CPU rows take the batched kernels of GPU rows, run by Triton's interpreter (else: skip)."""
    from weightsync.engine.datapath import delta_rows

    if not (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(delta_rows, "KERNEL_ON_CPU", True)
    monkeypatch.setitem(FAST, "heartbeat_s", 5.0)  # (the interpreter holds the GIL for seconds at a time)
    monkeypatch.setitem(FAST, "timeout_s", 60.0)
    from weightsync.engine.cuda import delta_apply, delta_kernel

    lock = threading.Lock()  # (the interpreter runs one kernel at a time: it patches Triton while it runs)

    def locked(fn):
        def call(*args, **kwargs):
            with lock:
                return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(delta_kernel, "encode_many", locked(delta_kernel.encode_many))
    for name in ("check", "apply"):
        monkeypatch.setattr(delta_apply.Applier, name, locked(getattr(delta_apply.Applier, name)))


@pytest.mark.parametrize("compiled, threads", [(True, False), (True, True), (False, False), ("batched", False)],
                         ids=["compiled", "compiled-on-threads", "torch", "batched"])
async def test_rounds_after_the_first_send_changed_bytes_only_and_land_bit_exact(compiled, threads, monkeypatch):
    from weightsync.engine.datapath import deltas
    from weightsync.engine.transforms import delta_cpu

    if compiled == "batched":  # (the GPU kernels' code path: a few launches per batch of rows)
        batched_kernels(monkeypatch)
    elif not compiled:  # (a host without numba: the torch codec encodes, checks and applies)
        monkeypatch.setattr(delta_cpu, "usable", lambda *tensors: False)
    elif not delta_cpu.usable(torch.zeros(1)):
        pytest.skip("numba is not installed")
    if threads:  # every row encoded on worker threads, two at a time, both lanes sharing each row's base
        monkeypatch.setattr(deltas, "OFF_LOOP_BYTES", 0)
    async with cluster() as (c, sender, send_t, recvs):
        first = await push(sender, 1, c)
        assert sender.last_delta.rows == 0  # no receiver held a base: every row whole
        for version in range(2, 6):
            rl_step(send_t, version)
            report = await push(sender, version, c)
            for r in recvs:
                assert same(send_t, r.state_dict()) == [], (r.mode, version)
            assert sender.last_delta.rows >= LARGE * len(recvs)  # (a tiny row's delta may not fit its window)
            assert report.nbytes * 5 < first.nbytes, (report.nbytes, first.nbytes)
        assert all(r.deltas.rows > 0 and r.deltas.base == 5 for r in recvs)


async def test_batched_kernels_that_fail_leave_their_rows_whole_and_later_rows_one_by_one(monkeypatch):
    from weightsync.engine.datapath import delta_rows

    class Broken:  # (a GPU whose Triton cannot compile: every launch fails)
        def encode_many(self, rows, wait=True):
            raise RuntimeError("the kernel does not compile here")

    monkeypatch.setattr(delta_rows, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(delta_rows, "KERNEL_FAILED", [])
    monkeypatch.setattr(delta_rows, "gpu_kernels", lambda: Broken())
    async with cluster() as (c, sender, send_t, recvs):
        for version in range(1, 5):
            rl_step(send_t, version)
            await push(sender, version)
            for r in recvs:
                assert same(send_t, r.state_dict()) == [], (r.mode, version)
        assert delta_rows.KERNEL_FAILED and "does not compile" in delta_rows.KERNEL_FAILED[0]
        assert sender.last_delta.rows >= LARGE * len(recvs)  # one by one from then on


async def test_off_sends_whole_rows_and_auto_sends_none_over_memory():
    async with cluster(delta="off") as (c, sender, send_t, recvs):
        reports = []
        for version in (1, 2):
            rl_step(send_t, version)
            reports.append(await push(sender, version, c))
        assert sender.last_delta is None and reports[0].nbytes == reports[1].nbytes
    async with cluster(receivers=("shadow",), transport="memory", delta="auto") as (c, sender, send_t, recvs):
        for version in (1, 2):
            rl_step(send_t, version)
            await push(sender, version)
        assert sender.last_delta.lanes == frozenset()  # a memory copy is faster than encoding
        assert same(send_t, recvs[0].state_dict()) == []


async def test_a_restarted_receiver_gets_whole_rows_while_the_others_get_deltas():
    async with cluster(receivers=("shadow", "inplace")) as (c, sender, send_t, recvs):
        for version in (1, 2):
            rl_step(send_t, version)
            await push(sender, version)
        plan_id = c.plan.plan_id
        await recvs[1].close()  # restarted: a fresh process, a new session, weights of its own
        async with WeightReceiver(c.address, model(seed=7), rank=1, mode="inplace",
                                  options=ReceiverOptions(transport="tcp")) as fresh:
            await asyncio.wait_for(c.wait_plan(after=plan_id), WATCHDOG)
            before = recvs[0].deltas.rows
            rl_step(send_t, 3)
            await push(sender, 3)
            assert fresh.deltas.rows == 0 and recvs[0].deltas.rows >= before + LARGE
            rl_step(send_t, 4)
            await push(sender, 4)
            assert fresh.deltas.rows >= LARGE
            for r in (recvs[0], fresh):
                assert same(send_t, r.state_dict()) == []


@pytest.mark.parametrize("threads", [False, True, "batched"], ids=["on-the-loop", "on-threads", "batched"])
async def test_an_aborted_round_leaves_every_base_and_the_next_round_is_still_exact(threads, monkeypatch):
    from weightsync.engine.datapath import deltas

    if threads == "batched":
        batched_kernels(monkeypatch)
    elif threads:
        monkeypatch.setattr(deltas, "OFF_LOOP_BYTES", 0)
    async with cluster(round_timeout_s=60.0 if threads == "batched" else 5.0) as (c, sender, send_t, recvs):
        await push(sender, 1)  # (the interpreter takes seconds a round)
        rl_step(send_t, 2)
        await push(sender, 2)
        rl_step(send_t, 3)
        original = recvs[0]._verdict

        async def refuse(body):  # receiver 0 fails verification of round 3 after its deltas applied
            ack = await original(body)
            return type(ack)(ack.version, False, ack.nbytes, ("embed",), "refused by the test", "")

        recvs[0]._verdict = refuse
        with pytest.raises(RoundAborted):
            await push(sender, 3)
        recvs[0]._verdict = original
        assert all(r.deltas.base is None for r in recvs) and sender.bases.version == 3
        rl_step(send_t, 4)
        await push(sender, 4)  # both receivers whole (they hold no base), bit-exact
        assert sender.last_delta.rows == 0
        for r in recvs:
            assert same(send_t, r.state_dict()) == []
        rl_step(send_t, 5)
        await push(sender, 5)  # deltas again
        assert sender.last_delta.rows >= LARGE * len(recvs)
        for r in recvs:
            assert same(send_t, r.state_dict()) == []


def test_auto_measures_the_link_dense_after_the_first_round_then_sends_deltas_only_where_encoding_outruns_it():
    from types import SimpleNamespace as Lane

    bases = Bases()
    assert not bases.pays(0)  # no link rate yet: a dense round measures it
    bases.observe({0: Lane(nbytes=100 << 20), 1: Lane(nbytes=100 << 20)}, 10.0)
    assert not bases.pays(0) and not bases.pays(1)  # a lane's first round is cold: not its link's rate
    bases.observe({0: Lane(nbytes=100 << 20)}, 1.0)
    bases.observe({1: Lane(nbytes=100 << 20)}, 0.01)
    assert bases.pays(0) and bases.pays(1)  # the encode rate is not known yet: deltas are tried
    bases._took(0.0, 50 << 20, 0.1)  # encoding at ~1 GB/s, on two threads at once
    bases._took(0.05, 50 << 20, 0.1)
    bases.observe({}, 1.0, delta_lanes=frozenset({0, 1}))
    assert bases.encode_rate == (100 << 20) / 0.1  # (the threads' overlapping encodes count once)
    assert bases.pays(0) and not bases.pays(1)  # a 100 MB/s link pays for it, a 10 GB/s one does not
    bases.observe({0: Lane(nbytes=100 << 20)}, 0.5, delta_lanes=frozenset({0}))
    assert bases.link_rates[0] == 100 << 20  # a delta lane's writes never count as the link's rate
    for _ in range(REPROBE - bases.dense_rounds[1]):
        assert not bases.pays(1)
        bases.observe({1: Lane(nbytes=100 << 20)}, 0.01)
    assert bases.pays(1)  # dense REPROBE rounds in a row: the encoder is measured again
    bases._took(0.0, 100 << 20, 0.1)  # the try: still ~1 GB/s, against a 10 GB/s link
    bases.observe({1: Lane(nbytes=1 << 20)}, 1.0, delta_lanes=frozenset({1}))
    assert not bases.pays(1) and bases.reprobe[1] == 2 * REPROBE  # it did not pay: the next try waits twice as long
    for _ in range(2 * REPROBE - 1):
        bases.observe({1: Lane(nbytes=100 << 20)}, 0.01)
        assert not bases.pays(1)
    bases.observe({1: Lane(nbytes=100 << 20)}, 0.01)
    assert bases.pays(1)  # the second try
    bases._took(0.0, 100 << 20, 0.001)  # the steps now change little: ~100 GB/s
    bases.observe({1: Lane(nbytes=1 << 20)}, 1.0, delta_lanes=frozenset({1}))
    assert bases.pays(1) and bases.reprobe[1] == REPROBE  # it paid: back to the first wait
    bases.reprobe[1] = REPROBE_MAX  # (after many tries that did not pay)
    bases.observe({1: Lane(nbytes=100 << 20)}, 0.01)
    bases.dense_rounds[1] = REPROBE_MAX
    assert bases.pays(1)
    bases._took(0.0, 100 << 20, 0.1)
    bases.observe({1: Lane(nbytes=1 << 20)}, 1.0, delta_lanes=frozenset({1}))
    assert not bases.pays(1) and bases.reprobe[1] == REPROBE_MAX  # the wait grows no further


def _corrupting(monkeypatch, name: str, damage):
    """Every delta of ``name`` the sender stages is damaged by ``damage(payload)`` (uint8, in place)."""
    from weightsync.engine.datapath.deltas import DeltaRound

    original = DeltaRound._staged

    def corrupt(self, t, done):
        out = original(self, t, done)
        if out is not None and t.name == name:
            payload = out[0].clone()
            damage(payload)
            out = (payload, *out[1:])
        return out

    monkeypatch.setattr(DeltaRound, "_staged", corrupt)
    return lambda: monkeypatch.setattr(DeltaRound, "_staged", original)


def _first_step(payload):  # a well-formed delta that moves its first value one more unit: only the fingerprint
    changes = int(payload[8:12].view(torch.int32))  # (header: magic, width, changes, ...)
    payload[24 + changes] += 1


def _bad_gap(payload):  # a gap of 0 with no far gap to stand for it: malformed
    payload[24] = 0


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("damage, says", [(_first_step, "fp64 fingerprint"), (_bad_gap, "delta refused")])
async def test_a_damaged_delta_aborts_its_round_naming_the_row_and_nothing_of_it_is_served(monkeypatch, damage, says,
                                                                                           batched):
    if batched:
        batched_kernels(monkeypatch)
    async with cluster(receivers=("shadow", "shadow")) as (c, sender, send_t, recvs):
        for version in (1, 2):
            rl_step(send_t, version)
            await push(sender, version)
        served = {k: v.clone() for k, v in recvs[0].state_dict().items()}
        restore = _corrupting(monkeypatch, "layers.0.w", damage)
        rl_step(send_t, 3)
        with pytest.raises(RoundAborted) as e:
            await push(sender, 3)
        assert says in e.value.text and "layers.0.w" in e.value.text
        if damage is _bad_gap:
            assert e.value.culprit == "sender/0"  # a malformed delta is its sender's
        for r in recvs:
            assert r.version == 2 and same(served, r.state_dict()) == []  # v2 served, untouched
        restore()
        rl_step(send_t, 4)
        await push(sender, 4)  # whole rows to both (they hold no committed version as a base)
        assert sender.last_delta.rows == 0
        rl_step(send_t, 5)
        await push(sender, 5)
        assert sender.last_delta.rows >= LARGE * 2
        for r in recvs:
            assert same(send_t, r.state_dict()) == []


async def test_a_served_byte_flipped_where_no_delta_touches_it_is_caught_by_the_next_full_check():
    async with cluster(receivers=("inplace",), full_check_every=3) as (c, sender, send_t, recvs):
        for version in (1, 2):  # v1: a full check (the first round); v2: deltas
            rl_step(send_t, version)
            await push(sender, version)
        live = recvs[0].state_dict()["layers.1.w"].view(torch.int16).reshape(-1)
        live[7] ^= 0x40  # memory goes bad where the next deltas will not look
        rl_step(send_t, 3)
        await push(sender, 3)  # each delta's fingerprint change only reads what it touches
        rl_step(send_t, 4)
        with pytest.raises(RoundAborted) as e:  # the fourth round is checked end to end
            await push(sender, 4)
        assert "crc32 mismatch" in e.value.text and "layers.1.w" in e.value.text
        rl_step(send_t, 5)
        await push(sender, 5)  # whole rows repair it
        assert same(send_t, recvs[0].state_dict()) == []
        checked = {v: (await c.wait_round(v)).checksum for v in (2, 3, 5)}
        assert checked == {2: "", 3: "", 5: "crc32"}  # (the reports say which rounds were checked: after an abort)


async def test_a_flipped_byte_in_either_slot_of_a_two_slot_receiver_is_caught_by_a_full_check():
    for flip_after in (2, 3):  # the byte goes bad in the slot served after v2, or after v3: the other one
        async with cluster(receivers=("shadow",), full_check_every=2) as (c, sender, send_t, recvs):
            version, caught = 0, None  # (checked: the rounds of v1, v4, v5, v8, v9, ...)
            while caught is None and version < 12:
                version += 1
                rl_step(send_t, version)
                try:
                    await push(sender, version)
                except RoundAborted as exc:
                    caught = (version, exc.text)
                if version == flip_after:
                    recvs[0].state_dict()["layers.1.w"].view(torch.int16).reshape(-1)[7] ^= 0x40
            assert caught is not None and "mismatch" in caught[1] and "layers.1.w" in caught[1], caught
            assert caught[0] <= flip_after + 3  # the first check that lands in that slot
            rl_step(send_t, version + 1)
            await push(sender, version + 1)  # whole rows repair it
            assert same(send_t, recvs[0].state_dict()) == []


async def test_status_and_metrics_tell_wire_bytes_against_whole_and_the_values_changed():
    from weightsync.roles.cli import format_status

    async with cluster(receivers=("shadow",)) as (c, sender, send_t, recvs):
        first = await push(sender, 1, c)
        rl_step(send_t, 2)
        report = await push(sender, 2, c)
        assert first.nbytes == first.whole_bytes and first.delta_rows == 0
        assert report.whole_bytes == first.whole_bytes and report.nbytes * 5 < report.whole_bytes
        assert report.delta_rows == sender.last_delta.rows and report.changed_values == sender.last_delta.changed > 0
        text = format_status(c.status())
        assert f"{report.delta_rows} rows as deltas, {report.changed_values:,} values changed" in text
        assert f"{report.nbytes / report.whole_bytes:.1%}" in text
        # the work inside the stages, as the busiest sender and receiver reported it: the first round checked
        # end to end (checksums), the second encoded and applied deltas (one receiver: one-phase commit)
        assert first.stages["receiver_verify_max"] > 0 and report.stages["receiver_verify_max"] == 0
        assert report.stages["sender_encode_max"] > 0 and report.stages["receiver_apply_max"] > 0
        assert report.stages["sender_encode_max"] <= report.stages["sender_stage_max"]
        assert "encode=" in text and "apply=" in text


GPU_CASES = [("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() >= 2 else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("src, dst", GPU_CASES)
@pytest.mark.parametrize("mode", ["shadow", "inplace"])
async def test_delta_rounds_over_cuda_ipc_are_bit_exact(src, dst, mode):
    """Encoded, checked and applied on the GPUs (torch on the tensors' devices), across GPUs and on one."""
    send_t = {k: v.to(src) for k, v in model().items()}
    options = ControllerOptions(delta="always", full_check_every=3, **FAST)
    async with Controller(senders=1, receivers=1, options=options) as c, \
            WeightSender(c.address, send_t, rank=0, options=SenderOptions(transport="cuda_ipc")) as sender, \
            WeightReceiver(c.address, {k: v.to(dst) for k, v in model(seed=5).items()}, rank=0, mode=mode,
                           options=ReceiverOptions(transport="cuda_ipc")) as receiver:
        await asyncio.wait_for(c.wait_ready(), WATCHDOG)
        for version in range(1, 6):
            cpu = {k: v.cpu() for k, v in send_t.items()}
            rl_step(cpu, version)
            for k, v in cpu.items():
                send_t[k].copy_(v)
            await push(sender, version, c)
            assert same(cpu, {k: v.cpu() for k, v in receiver.state_dict().items()}) == [], version
        assert receiver.deltas.rows >= LARGE * 3  # rounds 2-5 (round 4 checked end to end too)


def test_every_nth_round_the_first_and_the_one_after_an_abort_are_checked_end_to_end():
    from types import SimpleNamespace

    from weightsync.roles.round_inputs import RoundInputs

    inputs = RoundInputs(ControllerOptions(full_check_every=3), lambda key: None)
    assert [inputs.checksum({"cpu"}) for _ in range(7)] == ["crc32", "", "", "crc32", "", "", "crc32"]
    for every in (2, 4, 8):  # an even period: the checks alternate odd and even rounds, so a two-slot
        inputs = RoundInputs(ControllerOptions(full_check_every=every), lambda key: None)  # receiver's
        checked = [i for i in range(8 * every) if inputs.checksum({"cpu"})]                 # slots take turns
        assert len(checked) == 8 and {i % 2 for i in checked} == {0, 1}, checked
        assert all(b - a in (every - 1, every + 1) for a, b in zip(checked, checked[1:]))
    inputs = RoundInputs(ControllerOptions(full_check_every=3), lambda key: None)
    [inputs.checksum({"cpu"}) for _ in range(7)]
    inputs.finished(SimpleNamespace(receivers=set(), applied=set()), ok=False)
    assert inputs.checksum({"cpu", "cuda:1"}) == "fp64"  # after an abort; on a GPU, computed on the device
    assert inputs.checksum({"cpu"}) == ""
    assert RoundInputs(ControllerOptions(checksum="sum64"), lambda key: None).checksum({"cpu"}) == "sum64"
    never = RoundInputs(ControllerOptions(full_check_every=0), lambda key: None)
    assert [never.checksum({"cpu"}) for _ in range(3)] == ["", "", ""]


def test_auto_turns_deltas_off_after_a_delta_round_slower_than_a_whole_one_and_tries_again_later():
    """``delta="auto"``: a round that went mostly as deltas and took longer than the quickest of the last
    whole rounds (whose time includes the receivers' apply, which no sender sees) has the next
    ``AUTO_OFF`` rounds go whole, twice as many after each slower try; a faster try restores the wait.
    Rounds that failed, or went mostly whole, judge nothing; "always" and "off" never change."""
    from weightsync.roles.round_inputs import AUTO_OFF, AUTO_OFF_MAX, RoundInputs
    from weightsync.roles.round_state import RoundReport

    def whole(s, ok=True):
        return RoundReport(1, ok, 100, s, {}, [], whole_bytes=100)

    def deltas(s, ok=True, nbytes=2):
        return RoundReport(1, ok, nbytes, s, {}, [], whole_bytes=100, delta_rows=5)

    def off_for(inputs) -> int:
        n = 0
        while inputs.delta() == "":
            inputs.judge(whole(0.1))
            n += 1
        return n

    inputs = RoundInputs(ControllerOptions(delta="auto"), lambda key: None)
    inputs.judge(deltas(9.0))  # (no whole round yet: nothing to judge against)
    inputs.judge(whole(0.3))
    inputs.judge(whole(0.1))
    inputs.judge(deltas(0.05))
    assert inputs.delta() == "auto"
    inputs.judge(deltas(0.2, ok=False))  # failed: not judged
    inputs.judge(deltas(0.2, nbytes=60))  # mostly whole: not judged
    assert inputs.delta() == "auto"
    inputs.judge(deltas(0.15))  # slower than the quickest whole round (0.1), if not than the slowest
    assert "auto_off=16" in repr(inputs)
    assert off_for(inputs) == AUTO_OFF
    inputs.judge(deltas(0.15))
    assert off_for(inputs) == 2 * AUTO_OFF
    inputs.judge(deltas(0.05))  # paid: the next slower try waits AUTO_OFF again
    inputs.judge(deltas(0.15))
    assert off_for(inputs) == AUTO_OFF
    for _ in range(12):
        inputs.judge(deltas(0.15))
        off_for(inputs)
    assert inputs.auto_wait == AUTO_OFF_MAX
    inputs.judge(RoundReport(1, True, 2, 0.15, {}, [], whole_bytes=100, delta_rows=5, plan_id=7))
    assert inputs.delta() == "auto"  # (another plan: no whole round of its own to judge against yet)
    for mode in ("always", "off"):
        fixed = RoundInputs(ControllerOptions(delta=mode), lambda key: None)
        fixed.judge(whole(0.1))
        fixed.judge(deltas(1.0))
        assert fixed.delta() == ("" if mode == "off" else mode)


async def test_a_cpu_member_loads_the_compiled_delta_kernels_on_a_thread_as_it_joins(monkeypatch):
    """A CPU sender or receiver with deltas starts loading numba's kernels while it joins, so its first
    delta round does not pay the import; joining does not wait for it, and a member without deltas
    (or on GPUs only) does not start it."""
    from weightsync.engine.transforms import delta_cpu
    from weightsync.roles.worker import warm_kernels

    started = []
    monkeypatch.setattr(delta_cpu, "warm_soon", lambda: started.append(threading.current_thread()))
    await warm_kernels({"w": torch.zeros(4)}, "")
    await warm_kernels({"w": torch.zeros(4, device="meta")}, "encode")
    assert started == []
    await warm_kernels({"w": torch.zeros(4)}, "encode")
    assert started == [threading.current_thread()]  # (started from the loop's thread: not awaited)


def test_waiting_for_the_background_load_waits_for_a_started_one_and_starts_none(monkeypatch):
    """``warmed`` (benchmarks of steady rounds call it first): True at once where no load was started
    (and it starts none), False while a started one runs, True once it ended."""
    import functools

    from weightsync.engine.transforms import delta_cpu

    gate = threading.Event()

    @functools.cache
    def warm_soon():
        thread = threading.Thread(target=gate.wait, daemon=True)
        thread.start()
        return thread

    monkeypatch.setattr(delta_cpu, "warm_soon", warm_soon)
    assert delta_cpu.warmed() and not warm_soon.cache_info().currsize
    thread = warm_soon()
    assert not delta_cpu.warmed(0.01)  # (the load waits on the gate: the bounded wait must run out)
    gate.set()
    assert delta_cpu.warmed(60) and not thread.is_alive()


def test_warming_runs_every_compiled_kernel_once_on_a_thread_of_its_own():
    from weightsync.engine.transforms import delta_cpu

    if delta_cpu._kernels() is None:
        pytest.skip("numba is not installed")
    thread = delta_cpu.warm_soon()
    assert thread is delta_cpu.warm_soon() and thread.daemon  # (once a process)
    assert delta_cpu.warmed(60) and not thread.is_alive()
    assert all(k.signatures for k in (delta_cpu._kernels().encode_rows, delta_cpu._kernels().walk_rows,
                                      delta_cpu._kernels().apply_rows))
