"""A complete RL loop: trainer ranks under torchrun push every update through weightsync to inference
processes that generate the next rollouts on it.

    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py                       (CPU, gloo, TCP)
    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py --engine vllm         (vLLM inference)
    torchrun --standalone --nproc-per-node 1 examples/rl_loop.py --transport cuda_ipc  (one GPU: colocated)

The task is verifiable: a prompt is three consecutive digits (mod 10); the policy must continue the
count for four more tokens; the reward is the fraction of generated tokens that are the successor of
the token before them. The policy is a small causal LM
built from a transformers config (random init), trained with GRPO-style advantages (each prompt
sampled ``--group`` times, rewards normalised within the group) and a policy-gradient loss.

How this works. Every trainer rank holds the model under DDP (gloo on CPU, NCCL on GPUs) and is a
weightsync sender (``TorchrunSender``: rank 0 also runs the controller). Rank 0 starts the inference
processes, each a weightsync receiver (transformers ``generate`` behind a ``GenerationGate``, or a
vLLM engine with the worker extension), and hands them rollout requests. Overlap: the request for
step t+1 goes out before step t trains, so inference generates it while the trainers train and push
version t; each rollout is tagged with the version that generated it, and the trainer prints the policy
lag (its version minus the rollout's). After every optimizer step the ranks push the new version and
go on: the push's writes overlap the next step's collection, its release (the weights are no longer
read) is awaited before the next optimizer step, its commit before the next push. A vLLM engine takes
updates while it waits for the version a request needs (``updates="on_wait"``). Rank 0 prints a line per step and a summary and
writes a PNG of reward and update time per step (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from weightsync import ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver  # noqa: E402
from weightsync.roles.integrations.threads import GenerationGate  # noqa: E402
from weightsync.roles.integrations.torchrun import TorchrunSender  # noqa: E402

DIGITS, PROMPT, ANSWER = 10, 3, 4  # digit d is token d + 1; token 0 pads


def policy(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


def prompts(step: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, DIGITS, (count,), generator=g).tolist()
    return [[(a + i) % DIGITS + 1 for i in range(PROMPT)] for a in starts]


def reward(prompt: list[int], completion: list[int]) -> float:
    """The fraction of generated tokens that continue the count from the token before them."""
    previous = [prompt[-1], *completion[:-1]]
    return sum(b == (a % DIGITS) + 1 for a, b in zip(previous, completion)) / ANSWER


# --- inference processes -------------------------------------------------------------------------

def inference_main(engine: str, controller: str, key: bytes, rank: int, transport: str, checkpoint: str,
                   group: int, requests: "mp.Queue", results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)  # sampling
    if engine == "vllm":
        vllm_inference(controller, key, rank, checkpoint, group, requests, results)
    else:
        asyncio.run(hf_inference(controller, key, rank, transport, group, requests, results))


async def hf_inference(controller, key, rank, transport, group, requests, results) -> None:
    """transformers ``generate`` on an in-place receiver: a batch holds the gate, so it sees one version."""
    model = policy().eval()
    device = "cuda" if transport == "cuda_ipc" else "cpu"
    model.to(device)
    gate = GenerationGate()
    options = ReceiverOptions(transport=transport, auth_key=key)
    async with WeightReceiver(controller, model, rank=rank, mode="inplace", options=options,
                              before_update=gate.before_update, after_update=gate.after_update) as receiver:
        while True:
            step, batch, min_version = await asyncio.to_thread(requests.get)
            if min_version:
                await receiver.wait_for(min_version)
            if step is None:  # the final request: every version has landed
                return

            def generate():
                with gate, torch.no_grad():
                    ids = torch.tensor(batch, device=device).repeat_interleave(group, 0)
                    out = model.generate(ids, max_new_tokens=ANSWER, do_sample=True, top_k=0, pad_token_id=0)
                    return receiver.version or 0, out[:, PROMPT:].tolist()

            version, completions = await asyncio.to_thread(generate)
            results.put((step, rank, version, batch, completions))


def vllm_inference(controller, key, rank, checkpoint, group, requests, results) -> None:
    """A vLLM engine whose worker receives through the weightsync worker extension."""
    from vllm import LLM, SamplingParams

    from weightsync.roles.integrations.vllm_worker import EXTENSION

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="float32", max_model_len=64, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, worker_extension_cls=EXTENSION, seed=rank)
    llm.collective_rpc("weightsync_join", args=(controller, rank), kwargs={"auth_key_hex": key.hex(),
                                                                         "updates": "on_wait"})
    params = SamplingParams(n=group, max_tokens=ANSWER, temperature=1.0, top_k=-1, detokenize=False)
    while True:
        step, batch, min_version = requests.get()
        if min_version:  # updates land only while we wait here (on_wait): at least up to min_version
            version = llm.collective_rpc("weightsync_wait", args=(min_version,))[0]
        else:
            version = llm.collective_rpc("weightsync_status")[0]["version"] or 0
        if step is None:  # the final request: every version has landed
            break
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        completions = [list(c.token_ids) + [0] * (ANSWER - len(c.token_ids)) for o in outs for c in o.outputs]
        results.put((step, rank, version, batch, completions))
    llm.collective_rpc("weightsync_leave")
    llm.llm_engine.engine_core.shutdown()  # (its engine process would otherwise outlive this one)


# --- trainer ranks -------------------------------------------------------------------------------

def grpo_loss(model, batch, completions, group: int, device) -> tuple[torch.Tensor, float]:
    prompts_rep = [p for p in batch for _ in range(group)]
    rewards = torch.tensor([reward(p, c) for p, c in zip(prompts_rep, completions)], device=device)
    grouped = rewards.view(-1, group)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    ids = torch.tensor([p + c for p, c in zip(prompts_rep, completions)], device=device)
    logits = model(ids).logits[:, PROMPT - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, PROMPT:, None]).squeeze(-1)
    return -(adv * logp.sum(-1)).mean(), rewards.mean().item()


def train_step(ddp, opt, batch, completions, group: int, device) -> float:
    loss, mean_reward = grpo_loss(ddp, batch, completions, group, device)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return mean_reward


async def train(args) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.transport == "cuda_ipc" else torch.device("cpu")
    model = policy().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    async with TorchrunSender(model, receivers=args.inference, auth=True,
                              controller_options=ControllerOptions(mapping="qwen2" if args.engine == "vllm" else "identity"),
                              sender_options=SenderOptions(transport=args.transport)) as sync:
        procs, requests, results = [], None, None
        if rank == 0:
            procs, requests, results = start_inference(args, sync)
        rows, pending, handle = [], None, None
        if rank == 0:
            ask(requests, 1, args.prompts, 0)
        for step in range(1, args.steps + 1):
            box = [None]
            if rank == 0:
                box = [await asyncio.to_thread(collect, results, step, args.inference)]  # (the controller runs here)
                if step < args.steps:  # the next rollouts are generated while this step trains and pushes
                    ask(requests, step + 1, args.prompts, step - 1)
                else:  # no more rollouts: take the last versions, then leave
                    for q in requests:
                        q.put((None, [], args.steps))
            await asyncio.to_thread(dist.broadcast_object_list, box, 0)
            version, batch, completions = box[0]
            share = len(batch) // world
            mine = slice(rank * share, (rank + 1) * share)
            if handle is not None:  # the previous push no longer reads the weights: the optimizer may step
                await asyncio.shield(handle.released)
            # in a thread: rank 0's event loop also runs the controller, which must keep answering
            mean_reward = await asyncio.to_thread(train_step, ddp, opt, batch[mine],
                                                  completions[mine.start * args.group:mine.stop * args.group],
                                                  args.group, device)
            if pending is not None:  # the previous version is committed before the next push
                rows[-1]["update_ms"] = round(1e3 * await pending, 2)
            started = time.perf_counter()
            handle = sync.push_nowait(step)  # (its writes overlap the next collect and broadcast)
            pending = asyncio.ensure_future(_timed(handle, started))
            rows.append({"step": step, "reward": round(mean_reward, 4), "rollout_version": version,
                         "lag": step - 1 - version})
            if rank == 0:
                print(f"step {step:3d}  reward {mean_reward:.3f}  rollouts from v{version} (lag {step - 1 - version})"
                      + (f"  update v{step - 1} {rows[-2]['update_ms']:.1f} ms" if step > 1 else ""), flush=True)
        rows[-1]["update_ms"] = round(1e3 * await pending, 2)
        if rank == 0:
            for p in procs:
                p.join(300)
    return rows


async def _timed(handle, started: float) -> float:
    await handle
    return time.perf_counter() - started


def start_inference(args, sync):
    ctx = mp.get_context("spawn")
    requests, results = [ctx.Queue() for _ in range(args.inference)], ctx.Queue()
    checkpoint = ""
    if args.engine == "vllm":
        checkpoint = tempfile.mkdtemp(prefix="rl-policy-")
        policy().save_pretrained(checkpoint)
    procs = [ctx.Process(target=inference_main, args=(args.engine, sync.controller_address, sync.auth_key, r,
                                                      args.transport, checkpoint, args.group, requests[r], results),
                         daemon=args.engine != "vllm") for r in range(args.inference)]  # (vLLM starts processes)
    for p in procs:
        p.start()
    return procs, requests, results


def ask(requests, step: int, count: int, min_version: int) -> None:
    """Step ``step``'s prompts, a share to each inference process, generated on version >= ``min_version``."""
    batch = prompts(step, count)
    for i, q in enumerate(requests):
        q.put((step, batch[i::len(requests)], min_version))


def collect(results, step: int, workers: int):
    """One step's rollouts from every inference process; tagged with the oldest version among them."""
    parts = sorted(results.get(timeout=600) for _ in range(workers))
    if any(p[0] != step for p in parts):
        raise RuntimeError(f"rollouts for steps {[p[0] for p in parts]} while step {step} waits")
    batch = [x for p in parts for x in p[3]]
    completions = [x for p in parts for x in p[4]]
    return min(p[2] for p in parts), batch, completions


def summarize(rows: list[dict], args) -> dict:
    first, last = rows[:10], rows[-10:]
    return {"steps": len(rows), "reward_first10": round(statistics.mean(r["reward"] for r in first), 3),
            "reward_last10": round(statistics.mean(r["reward"] for r in last), 3),
            "max_lag": max(r["lag"] for r in rows),
            "update_ms_median": round(statistics.median(r["update_ms"] for r in rows), 2),
            "engine": args.engine, "transport": args.transport, "trainers": dist.get_world_size(),
            "inference": args.inference}


def plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib
    except ImportError:  # (the rl extra has it; a bare GPU image may not)
        print(f"matplotlib is not installed: {out} not drawn (pip install 'weightsync[rl]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot([r["step"] for r in rows], [r["reward"] for r in rows])
    a.set_ylabel("mean reward")
    b.plot([r["step"] for r in rows], [r["update_ms"] for r in rows])
    b.set_ylabel("update ms (push -> commit)")
    b.set_yscale("log")  # (the first round also registers memory and compiles its tables)
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (split over trainer ranks)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--inference", type=int, default=1, help="inference processes (receivers)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--transport", default="tcp", help="tcp (CPU) or cuda_ipc (GPU)")
    ap.add_argument("--out", default="docs/results/rl_loop_cpu", help="writes OUT.png and OUT.json")
    args = ap.parse_args()
    backend = "nccl" if args.transport == "cuda_ipc" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    rows = asyncio.run(train(args))
    if dist.get_rank() == 0:
        summary = summarize(rows, args)
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out + ".json").write_text(json.dumps({"summary": summary, "steps": rows}, indent=1) + "\n")
        plot(rows, args.out + ".png")
        print(json.dumps(summary))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
