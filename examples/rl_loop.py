"""A complete RL loop: trainer ranks under torchrun push every update through weightsync to inference
processes that generate the next rollouts on it.

    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py                       (CPU, gloo, TCP)
    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py --engine vllm         (vLLM inference)
    torchrun --standalone --nproc-per-node 1 examples/rl_loop.py --transport cuda_ipc  (one GPU: colocated)
    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py --bf16 --size 125m --optimizer adamw \
        --lr 1e-6 --inference 2 --steps 8                                  (changed bytes on real steps)

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

Changed bytes (``--bf16``): the trainers keep fp32 master weights and push a bf16 cast of them (what
inference serves), so a step changes only the bf16 values a step moves across a rounding boundary;
rounds go as deltas where the link pays for it (``--delta``). Per step rank 0 records the fraction of
bf16 values that changed, the round's wire bytes against its whole bytes, and each inference process
reports a CRC-32 of the bytes it serves after every version, which rank 0 compares with the trainer's
bf16 cast of that version (``bit_exact_steps``).
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
import zlib
from typing import Optional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from weightsync import ControllerOptions, ReceiverOptions, SenderOptions, WeightReceiver  # noqa: E402
from weightsync.roles.integrations.threads import GenerationGate  # noqa: E402
from weightsync.roles.integrations.torchrun import TorchrunSender  # noqa: E402

DIGITS, PROMPT, ANSWER = 10, 3, 4  # digit d is token d + 1; token 0 pads


SIZES = {  # hidden, intermediate, layers, attention heads, key-value heads
    "tiny": (128, 256, 2, 2, 2),
    "125m": (768, 3072, 14, 12, 12),  # 132 M parameters
    "0.5b": (896, 4864, 24, 14, 2),  # Qwen2.5-0.5B's layers with this task's 64 tokens: 358 M parameters
}


def policy(seed: int = 0, size: str = "tiny") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv_heads = SIZES[size]
    cfg = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


def served_crc(model: torch.nn.Module) -> int:
    """CRC-32 of every parameter's bytes, in ``named_parameters`` order (an oracle independent of weightsync)."""
    crc = 0
    for _, p in sorted(model.named_parameters()):
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


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
                   group: int, requests: "mp.Queue", results: "mp.Queue", size: str = "tiny",
                   checks: "Optional[mp.Queue]" = None) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)  # sampling
    if engine == "vllm":
        vllm_inference(controller, key, rank, checkpoint, group, requests, results)
    else:
        asyncio.run(hf_inference(controller, key, rank, transport, group, requests, results, size, checks))


async def hf_inference(controller, key, rank, transport, group, requests, results, size="tiny", checks=None) -> None:
    """transformers ``generate`` on an in-place receiver: a batch holds the gate, so it sees one version.
    ``checks``: served in bf16, and (rank, version, CRC-32 of the served bytes) put there after each update."""
    model = policy(size=size).eval()
    device = "cuda" if transport == "cuda_ipc" else "cpu"
    model.to(device, torch.bfloat16 if checks is not None else torch.float32)
    gate = GenerationGate()
    options = ReceiverOptions(transport=transport, auth_key=key)
    on_update = (lambda version: checks.put((rank, version, served_crc(model)))) if checks is not None else None
    async with WeightReceiver(controller, model, rank=rank, mode="inplace", options=options, on_update=on_update,
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


def train_step(ddp, opt, batch, completions, group: int, device,
               served: Optional[torch.nn.Module] = None) -> tuple[float, Optional[float]]:
    """One optimizer step; with ``served`` (a bf16 copy of the model, what is pushed) the master weights
    are cast into it afterwards: (the mean reward, the fraction of its values that changed)."""
    loss, mean_reward = grpo_loss(ddp, batch, completions, group, device)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return mean_reward, (cast_into(served, ddp.module) if served is not None else None)


@torch.no_grad()
def cast_into(served: torch.nn.Module, master: torch.nn.Module) -> float:
    """Cast the fp32 master weights into the bf16 ``served`` copy; the fraction of its values that changed."""
    changed = total = 0
    for s, p in zip(served.parameters(), master.parameters()):
        new = p.to(torch.bfloat16)
        changed += int((new.view(torch.int16) != s.view(torch.int16)).sum())
        total += s.numel()
        s.copy_(new)
    return changed / total


async def train(args) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.transport == "cuda_ipc" else torch.device("cpu")
    model = policy(size=args.size).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = (torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam)(model.parameters(), lr=args.lr)
    served = policy(size=args.size).to(device, torch.bfloat16) if args.bf16 else None  # what is pushed
    if served is not None:
        cast_into(served, model)
    expected: dict[int, int] = {}  # version -> CRC-32 of the bf16 bytes pushed (rank 0)
    options = ControllerOptions(mapping="qwen2" if args.engine == "vllm" else "identity", delta=args.delta)
    async with TorchrunSender(served if served is not None else model, receivers=args.inference, auth=True,
                              controller_options=options, sender_options=SenderOptions(transport=args.transport)) as sync:
        procs, requests, results, checks = [], None, None, None
        if rank == 0:
            procs, requests, results, checks = start_inference(args, sync)
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
            mean_reward, changed = await asyncio.to_thread(
                train_step, ddp, opt, batch[mine], completions[mine.start * args.group:mine.stop * args.group],
                args.group, device, served)
            if pending is not None:  # the previous version is committed before the next push
                await _finish(rows[-1], pending, sync)
            if served is not None and rank == 0:
                expected[step] = await asyncio.to_thread(served_crc, served)
            started = time.perf_counter()
            handle = sync.push_nowait(step)  # (its writes overlap the next collect and broadcast)
            pending = asyncio.ensure_future(_timed(handle, started))
            rows.append({"step": step, "reward": round(mean_reward, 4), "rollout_version": version,
                         "lag": step - 1 - version, **({"changed": round(changed, 6)} if changed is not None else {})})
            if rank == 0:
                print(f"step {step:3d}  reward {mean_reward:.3f}  rollouts from v{version} (lag {step - 1 - version})"
                      + (f"  update v{step - 1} {rows[-2]['update_ms']:.1f} ms" if step > 1 else ""), flush=True)
        await _finish(rows[-1], pending, sync)
        if rank == 0:
            if checks is not None:  # (drained before the joins: a process exits once its queue is read)
                _check_served(rows, expected, checks, args.inference)
            for p in procs:
                p.join(300)
    return rows


async def _timed(handle, started: float) -> float:
    await handle
    return time.perf_counter() - started


async def _finish(row: dict, pending: asyncio.Future, sync) -> None:
    """A step's push has committed: its time, and (rank 0, which runs the controller) its round's bytes."""
    row["update_ms"] = round(1e3 * await pending, 2)
    if sync.controller is not None:
        report = await sync.controller.wait_round(row["step"])
        row.update(wire_bytes=report.nbytes, whole_bytes=report.whole_bytes, delta_rows=report.delta_rows,
                   round_ms=round(1e3 * report.seconds, 2),  # (begin to every commit_ack; without the wait
                   transfer_ms=round(1e3 * report.stages.get("transfer", 0.0), 2),  # for generation: gate)
                   **{f"{name}_ms": round(1e3 * report.stages.get(stage, 0.0), 2)  # (the busiest member's)
                      for name, stage in (("encode", "sender_encode_max"), ("apply", "receiver_apply_max"),
                                          ("verify", "receiver_verify_max"))})


def _check_served(rows: list[dict], expected: dict[int, int], checks: "mp.Queue", inference: int) -> None:
    """Each step's ``bit_exact``: every inference process served that version's bytes exactly (its CRC-32
    of what it serves after the update equals the trainer's of the bf16 cast it pushed)."""
    got: dict[int, list[int]] = {}
    while len(sum(got.values(), [])) < inference * len(expected):
        rank, version, crc = checks.get(timeout=60)
        got.setdefault(version, []).append(crc)
    for row in rows:
        crcs = got.get(row["step"], [])
        row["bit_exact"] = len(crcs) == inference and all(c == expected[row["step"]] for c in crcs)


def start_inference(args, sync):
    ctx = mp.get_context("spawn")
    requests, results = [ctx.Queue() for _ in range(args.inference)], ctx.Queue()
    checks = ctx.Queue() if args.bf16 else None
    checkpoint = ""
    if args.engine == "vllm":
        checkpoint = tempfile.mkdtemp(prefix="rl-policy-")
        policy(size=args.size).save_pretrained(checkpoint)
    procs = [ctx.Process(target=inference_main, args=(args.engine, sync.controller_address, sync.auth_key, r,
                                                      args.transport, checkpoint, args.group, requests[r], results,
                                                      args.size, checks),
                         daemon=args.engine != "vllm") for r in range(args.inference)]  # (vLLM starts processes)
    for p in procs:
        p.start()
    return procs, requests, results, checks


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
            "inference": args.inference, **(_changed_bytes(rows, args) if args.bf16 else {})}


def _changed_bytes(rows: list[dict], args) -> dict:
    """What ``--bf16`` runs add to the summary (the first step, which registers and sends whole, apart)."""
    later = rows[1:] or rows
    return {"size": args.size, "optimizer": args.optimizer, "lr": args.lr, "delta": args.delta,
            "changed_median": statistics.median(r["changed"] for r in later),
            "bytes_ratio_median": round(statistics.median(r["whole_bytes"] / r["wire_bytes"] for r in later), 2),
            "update_ms_median_after_first": round(statistics.median(r["update_ms"] for r in later), 2),
            **{f"{k}_ms_median_after_first": round(statistics.median(r[f"{k}_ms"] for r in later), 2)
               for k in ("transfer", "encode", "apply", "verify")},
            "bit_exact_steps": sum(r["bit_exact"] for r in rows)}  # (of the summary's "steps")


def plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib
    except ImportError:  # (the rl extra has it; a bare GPU image may not)
        print(f"matplotlib is not installed: {out} not drawn (pip install 'weightsync[rl]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = "changed" in rows[0]
    fig, axes = plt.subplots(3 if bf16 else 2, 1, figsize=(7, 7 if bf16 else 5), sharex=True)
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["reward"] for r in rows])
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r["update_ms"] for r in rows])
    axes[1].set_ylabel("update ms (push -> commit)")
    axes[1].set_yscale("log")  # (the first round also registers memory and compiles its tables)
    if bf16:  # changed bytes: the fraction of bf16 values a step changed, and whole / wire bytes
        axes[2].plot(steps, [100 * r["changed"] for r in rows], label="% of bf16 values changed")
        axes[2].plot(steps, [r["whole_bytes"] / r["wire_bytes"] for r in rows], label="whole / wire bytes")
        axes[2].set_yscale("log")
        axes[2].legend()
    axes[-1].set_xlabel("step")
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
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the policy's shape (125m: 132 M parameters; 0.5b: Qwen2.5-0.5B's layers, 358 M)")
    ap.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    ap.add_argument("--bf16", action="store_true",
                    help="fp32 master weights, bf16 served: push a bf16 cast, record changed bytes and check every version")
    ap.add_argument("--delta", choices=("auto", "always", "off"), default="auto", help="ControllerOptions.delta")
    ap.add_argument("--plot", default="", metavar="FILE.json",
                    help="only draw FILE.png from a run's FILE.json (a GPU image without matplotlib wrote it)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(pathlib.Path(args.plot).read_text())["steps"], str(pathlib.Path(args.plot).with_suffix(".png")))
        return 0
    if args.bf16 and args.engine != "hf":
        ap.error("--bf16 runs the transformers inference processes (--engine hf)")
    backend = "nccl" if args.transport == "cuda_ipc" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    rows = asyncio.run(train(args))
    if dist.get_rank() == 0:
        summary = {**summarize(rows, args), "command": "examples/rl_loop.py " + " ".join(sys.argv[1:])}
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out + ".json").write_text(json.dumps({"summary": summary, "steps": rows}, indent=1) + "\n")
        plot(rows, args.out + ".png")
        print(json.dumps(summary))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
