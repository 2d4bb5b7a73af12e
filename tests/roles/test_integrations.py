"""The pieces integrations share, without the engines they integrate: the gate, the background loop,
and matching a receiver layout against a model's parameters (``vllm_worker.bind``)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from weightsync.engine.errors import ConfigError, RoundAborted
from weightsync.engine.transforms.layouts import LayoutEntry
from weightsync.roles import ReceiverOptions, SenderOptions
from weightsync.roles.integrations.threads import BackgroundLoop, GenerationGate
from weightsync.roles.integrations.vllm_worker import bind, commit_layers


async def test_an_update_waits_for_the_pass_in_progress_and_blocks_the_next():
    gate = GenerationGate()
    inside, leave = threading.Event(), threading.Event()
    order: list[str] = []

    def forward(tag: str) -> None:
        with gate:
            order.append(f"{tag} in")
            inside.set()
            leave.wait(10)
            order.append(f"{tag} out")

    first = asyncio.ensure_future(asyncio.to_thread(forward, "pass1"))
    await asyncio.to_thread(inside.wait, 10)
    update = asyncio.ensure_future(gate.before_update(1))
    done, _ = await asyncio.wait([update], timeout=0.05)  # (a watchdog window)
    assert not done  # the pass holds the gate
    leave.set()
    await asyncio.wait_for(update, 10)
    order.append("update")
    inside.clear()
    second = asyncio.ensure_future(asyncio.to_thread(forward, "pass2"))
    done, _ = await asyncio.wait([second], timeout=0.05)  # (a watchdog window: the pass must not get in)
    assert not done and gate.held
    gate.after_update(1, True)
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert order == ["pass1 in", "pass1 out", "update", "pass2 in", "pass2 out"]
    assert gate.updates == 1 and gate.passes == 2 and not gate.held


async def test_an_aborted_round_keeps_the_gate_closed_until_a_commit():
    gate = GenerationGate()
    await gate.before_update(1)
    gate.after_update(1, False)
    assert gate.held  # half-written parameters: generation stays paused
    await asyncio.wait_for(gate.before_update(2), 5)  # the next round takes over the closed gate
    gate.after_update(2, True)
    assert not gate.held and gate.updates == 1
    with gate:
        pass


async def test_without_hold_on_abort_an_abort_opens_the_gate():
    gate = GenerationGate(hold_on_abort=False)
    await gate.before_update(1)
    gate.after_update(1, False)
    assert not gate.held


async def test_an_update_cancelled_while_waiting_leaves_the_gate_open():
    gate = GenerationGate()
    inside, leave = threading.Event(), threading.Event()

    def forward() -> None:
        with gate:
            inside.set()
            leave.wait(10)

    running = asyncio.ensure_future(asyncio.to_thread(forward))
    await asyncio.to_thread(inside.wait, 10)
    update = asyncio.ensure_future(gate.before_update(1))
    done, _ = await asyncio.wait([update], timeout=0.05)  # (a watchdog window: it waits for the pass)
    assert not done
    update.cancel()
    leave.set()
    with pytest.raises(asyncio.CancelledError):
        await update
    await running
    acquired = await asyncio.to_thread(gate._lock.acquire, True, 10)  # released once the waiter got it
    assert acquired and not gate.held
    gate._lock.release()


def test_the_background_loop_runs_coroutines_and_times_out():
    loop = BackgroundLoop("test")
    try:
        async def add(a, b):
            return a + b

        assert loop.call(add, 2, 3, timeout=10) == 5
        stuck = asyncio.Event()
        with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
            loop.call(stuck.wait, timeout=0.05)
    finally:
        loop.close()
    assert "closed" in repr(loop)


class _Linear(torch.nn.Module):
    def __init__(self, shape, emptied=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(0 if emptied else shape), requires_grad=False)
        if emptied:
            self.cpu_linear = torch.nn.functional.linear  # as vLLM's CPU dispatch leaves a packed layer


def _model(emptied=False):
    m = torch.nn.Module()
    m.proj = _Linear((4, 8), emptied)
    m.norm = torch.nn.Module()
    m.norm.weight = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    return m


def test_bind_uses_parameters_in_place_and_plain_tensors_for_packed_layers():
    layout = [LayoutEntry("proj.weight", "float32", (4, 8), None), LayoutEntry("norm.weight", "float32", (8,), None)]
    plain = bind(_model(), layout, tied=False)
    assert plain.repack == []
    model = _model(emptied=True)
    packed = bind(model, layout, tied=False)
    assert packed.tensors["norm.weight"] is model.norm.weight
    assert packed.tensors["proj.weight"].shape == (4, 8) and packed.repack[0][0] is model.proj


@pytest.mark.parametrize("entry, match", [
    (LayoutEntry("proj.weight", "float32", (4, 9), None), r"proj.weight: the layout says \(4, 9\) float32, the vLLM model holds \(4, 8\) float32"),
    (LayoutEntry("proj.weight", "float8_e4m3fn", (4, 8), None), "proj.weight: the layout says .* float8_e4m3fn"),
    (LayoutEntry("mlp.up.weight", "float32", (4, 8), None), "mlp.up.weight: in the layout but not in the vLLM model"),
])
def test_bind_names_the_parameter_that_does_not_match(entry, match):
    with pytest.raises(ConfigError, match=match):
        bind(_model(), [entry], tied=False)


def test_bind_refuses_a_layer_vllm_quantized_to_fp8_naming_the_parameter():
    """A checkpoint served with vLLM's FP8 quantization holds float8 weights (and scales) the trainer's
    layout does not describe: not bound, refused at join."""
    model = _model()
    model.proj.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ConfigError, match=r"proj.weight: the layout says \(4, 8\) bfloat16, the vLLM model holds "
                                          r"\(4, 8\) float8_e4m3fn"):
        bind(model, [LayoutEntry("proj.weight", "bfloat16", (4, 8), None)], tied=False)


def test_bind_takes_a_parameter_held_in_another_float_dtype_as_it_is():
    """vLLM keeps some tensors in float32 whatever the model's dtype (MoE routers' correction bias): the
    receiver declares the parameter's own dtype, and the senders cast."""
    model = _model()
    binding = bind(model, [LayoutEntry("norm.weight", "bfloat16", (8,), None)], tied=False)
    assert binding.tensors["norm.weight"] is model.norm.weight and model.norm.weight.dtype == torch.float32


class _MLA(torch.nn.Module):
    """What the worker reads of vLLM's MLA attention: a ``kv_b_proj`` it derives matrices from after loading."""

    def __init__(self, kv_b_proj):
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.derived_in: list[torch.dtype] = []

    def process_weights_after_loading(self, act_dtype):
        self.derived_in.append(act_dtype)


def test_the_commit_derives_mla_matrices_again_from_a_bound_kv_b_proj():
    model = _model(emptied=True)
    model.attn = _MLA(model.proj)
    model.other = _MLA(_Linear((4, 8)))  # (its kv_b_proj is not bound: left alone)
    binding = bind(model, [LayoutEntry("proj.weight", "float32", (4, 8), None)], tied=False)
    assert binding.derived == [model.attn]
    calls: list[str] = []
    model.proj.quant_method = type("Q", (), {"process_weights_after_loading": lambda self, layer: calls.append("repack")})()
    model.attn.process_weights_after_loading = lambda dtype: calls.append(f"derive {dtype}")
    commit_layers(binding, torch.bfloat16)
    assert calls == ["repack", "derive torch.bfloat16"]  # (derived from the repacked layer)
    assert model.proj.weight is not None and model.proj.weight.shape == (4, 8)


def test_bind_skips_lm_head_when_embeddings_are_tied():
    binding = bind(_model(), [LayoutEntry("lm_head.weight", "float32", (4, 8), None)], tied=True)
    assert binding.tensors == {}


def test_a_tied_head_packed_from_the_embedding_is_packed_again_at_commit():
    """vLLM CPU packs a copy of the tied head's weight (the embedding's parameter) for its kernel at load:
    the embedding is written in place, and the commit packs the head again from it."""
    model = torch.nn.Module()
    model.embed = _Linear((4, 8))
    model.lm_head = torch.nn.Module()
    model.lm_head.weight = model.embed.weight  # (vLLM's tie_weights)
    calls: list[str] = []
    for name in ("embed", "lm_head"):
        layer = getattr(model, name)
        layer.cpu_linear = torch.nn.functional.linear  # (packed, the weight kept: remove_weight=False)
        layer.quant_method = type("Q", (), {"process_weights_after_loading": lambda self, lay, n=name: calls.append(n)})()
    layout = [LayoutEntry("embed.weight", "float32", (4, 8), None), LayoutEntry("lm_head.weight", "float32", (4, 8), None)]
    binding = bind(model, layout, tied=True)
    assert binding.tensors == {"embed.weight": model.embed.weight}
    assert [(layer, list(plains)) for layer, plains in binding.repack] == [(model.embed, ["weight"]), (model.lm_head, ["weight"])]
    commit_layers(binding, torch.float32)
    assert calls == ["embed", "lm_head"] and model.lm_head.weight is model.embed.weight


async def test_a_slow_pause_keeps_the_session_and_the_round_commits():
    """``before_update`` runs off the receive loop: a serving engine that takes longer to pause than
    the controller's timeout keeps its session (heartbeats flow meanwhile) and the round commits."""
    from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender

    src = {"w": torch.arange(64, dtype=torch.float32)}
    dst = {"w": torch.zeros(64)}
    calls: list[tuple] = []
    heartbeats_in_pause = asyncio.Event()
    counting: list[int] = []

    async def slow_pause(version: int) -> None:  # ends only after 3x the timeout's worth of heartbeats
        calls.append(("pause", version))
        counting.append(0)
        await heartbeats_in_pause.wait()

    options = ControllerOptions(heartbeat_s=0.1, timeout_s=0.5)
    async with Controller(senders=1, receivers=1, options=options) as ctl, \
            WeightSender(ctl.address, src, rank=0, options=SenderOptions(transport="memory")) as sender, \
            WeightReceiver(ctl.address, dst, rank=0, mode="inplace", options=ReceiverOptions(transport="memory"),
                           before_update=slow_pause, after_update=lambda v, ok: calls.append(("resume", v, ok))
                           ) as receiver:
        send = receiver._send

        async def counted(body, **kw):  # the receiver's heartbeats while it pauses (its loop is alive)
            if counting and body.TYPE == "heartbeat":
                counting[0] += 1
                if counting[0] >= 15:
                    heartbeats_in_pause.set()
            return await send(body, **kw)

        receiver._send = counted
        assert await asyncio.wait_for(await sender.push(1), 30) == 1
        assert receiver.sessions == 1 and receiver.version == 1 and dst["w"].equal(src["w"])
    assert calls == [("pause", 1), ("resume", 1, True)]


async def test_an_abort_while_serving_pauses_cancels_the_pause():
    from weightsync.roles import Controller, ControllerOptions, WeightReceiver, WeightSender

    gate = GenerationGate()
    src = {"w": torch.ones(16)}
    dst = {"w": torch.zeros(16)}
    inside, leave = threading.Event(), threading.Event()

    def forward() -> None:
        with gate:
            inside.set()
            leave.wait(30)

    options = ControllerOptions(round_timeout_s=0.5)
    async with Controller(senders=1, receivers=1, options=options) as ctl, \
            WeightSender(ctl.address, src, rank=0, options=SenderOptions(transport="memory")) as sender, \
            WeightReceiver(ctl.address, dst, rank=0, mode="inplace", options=ReceiverOptions(transport="memory"),
                           before_update=gate.before_update, after_update=gate.after_update) as receiver:
        running = asyncio.ensure_future(asyncio.to_thread(forward))
        await asyncio.to_thread(inside.wait, 30)  # a forward pass holds the gate past the round's deadline
        with pytest.raises(RoundAborted):
            await asyncio.wait_for(sender.push(1), 30)
        leave.set()
        await running
        assert receiver.version is None and not receiver.dirty and dst["w"].equal(torch.zeros(16))
        assert not gate.held  # the cancelled pause gave the gate back once it had it


async def test_windows_admit_only_the_versions_generation_waits_for():
    """``windows``: generation holds the gate; ``open_window(v)`` lends it to rounds up to ``v`` only, so
    a round for a later version waits for the next window on every TP rank alike."""
    gate = GenerationGate(windows=True)
    gate.hold()  # generation owns the gate
    first = asyncio.ensure_future(gate.before_update(1))
    done, _ = await asyncio.wait([first], timeout=0.05)  # (watchdog window: no update outside a window)
    assert not done
    await asyncio.to_thread(gate.open_window, 1)
    await asyncio.wait_for(first, 10)
    second = asyncio.ensure_future(gate.before_update(2))
    gate.after_update(1, True)  # version 1 committed: generation would close its window now
    gate.close_window()
    await asyncio.to_thread(gate.hold, 10)
    done, _ = await asyncio.wait([second], timeout=0.05)
    assert not done  # version 2 is beyond the window that was open
    gate.open_window(2)
    await asyncio.wait_for(second, 10)
    gate.after_update(2, True)
    second_cancelled = asyncio.ensure_future(gate.before_update(3))
    done, _ = await asyncio.wait([second_cancelled], timeout=0.05)  # (watchdog window: 3 is beyond the window)
    assert not done
    second_cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second_cancelled
    gate.close_window()
    assert await asyncio.to_thread(gate._lock.acquire, True, 10)  # nobody kept the gate
    gate._lock.release()
