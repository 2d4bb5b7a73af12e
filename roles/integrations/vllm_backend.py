"""vLLM's own weight-transfer API: weightsync as the ``weightsync`` backend, worker side and trainer side.

Switch a vLLM RL loop from NCCL to weightsync by naming the backend on both sides::

    llm = LLM(model=path, enforce_eager=True, weight_transfer_config={"backend": "weightsync"})
    trainer = WeightTransferTrainerFactory.trainer_init(          # client: LLMClient(llm), or vLLM's
        WeightSyncTrainerInitInfo(rank=0, receivers=tp), client=client, source=ModuleSource(model))
    trainer.send_weights()                       # one weightsync round; vLLM then reports weight version "1"

How this works. Worker side: ``register`` (our ``vllm.general_plugins`` entry point, run by vLLM in each
of its processes) adds ``WeightSyncTransferEngine`` to vLLM's lazy registry. At
``init_weight_transfer_engine`` each worker joins the controller named in ``WeightSyncInitInfo`` as an
in-place receiver of its own tensor-parallel shard, with the worker extension's code
(``vllm_worker.join``: the same mapping, fused names, repacking and gate), updates landing ``on_wait``:
only while the worker is inside ``update_weights``, which vLLM runs on every worker between model steps.
``update_weights({"version": v})`` returns once v has committed on this worker and raises the round's
``RoundAborted`` (or the plan's ``PlanError``) otherwise; ``start``/``finish_weight_update`` have nothing
to do (a round is atomic by itself); ``shutdown`` leaves, and a later init joins again. The auth key is
named, never sent: ``auth_key_file`` (a path on the inference host) or ``auth_key_env`` (a variable
holding such a path there).

Trainer side: ``WeightSyncTrainerEngine`` is registered when this module is imported. Every trainer rank
is a ``WeightSender`` of the tensors it holds (FSDP shards stay shards: nothing is gathered, the source
is never iterated); rank 0 alone drives the client (vLLM's convention). Without ``controller``, a
single-rank trainer starts one itself, and a torch.distributed job gets one from rank 0
(``TorchrunSender``). ``send_weights()`` is one round: rank 0 pauses an HTTP server's generation
(``pause``, so no completion mixes two versions), calls ``start_weight_update`` and, while every rank
pushes, ``update_weights``; then ``finish_weight_update(str(version))`` and resume.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, ClassVar, Optional

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from weightsync.engine.errors import ConfigError, JoinRejected, VersionError

from ..controller import Controller, ControllerOptions
from ..keyfile import read_key_file
from ..sender import SenderOptions, WeightSender
from . import vllm_worker
from .threads import BackgroundLoop

BACKEND = "weightsync"
PAUSES = ("wait", "abort", "")


def read_key(path: Optional[str], env: Optional[str], field: str) -> Optional[bytes]:
    """The auth key from a file, or from the file an environment variable names; errors name the field."""
    if env:
        path = os.environ.get(env)
        if not path:
            raise ConfigError(f"{field}_env", f"${env} is not set on this host")
    return read_key_file(path, f"{field}_file") if path else None


# --- worker side ------------------------------------------------------------------------------------


@dataclasses.dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """What rank 0 of the trainer sends through ``init_weight_transfer_engine`` (JSON over HTTP)."""
    controller: str
    rank_offset: int = 0  # receiver rank = rank_offset + the worker's global rank
    mapping: Optional[str] = None  # default: the model type's (engine.plan.mapping.MAPPINGS)
    transport: str = "tcp"
    auth_key_file: Optional[str] = None  # a path on the inference host
    auth_key_env: Optional[str] = None  # or a variable there holding that path
    join_timeout_s: float = 120.0


@dataclasses.dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    timeout_s: float = 600.0


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False  # a draft model is not bound

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.joined: Optional[vllm_worker._Joined] = None

    def __repr__(self) -> str:
        return f"<WeightSyncTransferEngine {self.joined.receiver!r}>" if self.joined else "<WeightSyncTransferEngine idle>"

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightSyncInitInfo:
        if not isinstance(init_dict.get("controller"), str):
            raise ConfigError("init_info.controller", f"the controller's address is required, got {init_dict!r}")
        return super().parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        if self.joined is not None:
            raise ConfigError("init_weight_transfer_engine", "this worker has joined already: shut down first")
        from vllm.distributed.parallel_state import get_world_group

        key = read_key(init_info.auth_key_file, init_info.auth_key_env, "init_info.auth_key")
        self.joined = vllm_worker.join(self.model, self.vllm_config, get_world_group().rank, init_info.controller,
                                       rank_offset=init_info.rank_offset, mapping=init_info.mapping,
                                       transport=init_info.transport, auth_key=key, updates="on_wait",
                                       join_timeout_s=init_info.join_timeout_s, name="backend")

    def start_weight_update(self) -> None:
        self._require()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # (committed: applied and synchronised)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        joined = self._require()
        try:
            vllm_worker.wait(joined, update_info.version, update_info.timeout_s, strict=True)
        except TimeoutError:
            raise VersionError(f"version {update_info.version} was not committed on receiver/{joined.receiver.rank} "
                               f"within {update_info.timeout_s}s (it serves v{joined.receiver.version})") from None

    def finish_weight_update(self) -> None:
        self._require()

    def shutdown(self) -> None:
        joined, self.joined = self.joined, None
        if joined is not None:
            vllm_worker.leave(joined, self.model)

    def _require(self) -> vllm_worker._Joined:
        if self.joined is None:
            raise ConfigError("init_weight_transfer_engine", "the weightsync backend has not joined a controller: "
                                                            "call init_weight_transfer_engine first")
        return self.joined


# --- trainer side -----------------------------------------------------------------------------------


@dataclasses.dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """The trainer's side; ``rank`` (keyword) is this trainer process's rank."""
    backend: ClassVar[str] = BACKEND
    controller: Optional[str] = None  # an external controller's address (default: start one)
    receivers: Optional[int] = None  # vLLM workers (needed to start a controller)
    controller_bind: str = "tcp://127.0.0.1:0"  # where a started controller listens (workers must reach it)
    auth_key_file: Optional[str] = None  # this host's key file (the controller's and the senders' key)
    worker_auth_key_file: Optional[str] = None  # the key's path on the inference hosts
    worker_auth_key_env: Optional[str] = None  # or the variable naming it there
    mapping: Optional[str] = None  # default: the source model's type's, when it has one
    transport: str = "tcp"
    join_timeout_s: float = 120.0
    timeout_s: float = 600.0  # a round's limit, on every side
    pause: str = "wait"  # an HTTP server's generation during a round: wait for in-flight requests, abort, or ""
    sender_options: SenderOptions = SenderOptions()
    controller_options: ControllerOptions = ControllerOptions()

    def __post_init__(self) -> None:
        if self.pause not in PAUSES:
            raise ConfigError("pause", f"must be one of {PAUSES}, got {self.pause!r}")

    def worker_info(self, controller: str) -> dict:
        return {"controller": controller, "mapping": self.mapping, "transport": self.transport,
                "auth_key_file": self.worker_auth_key_file, "auth_key_env": self.worker_auth_key_env,
                "join_timeout_s": self.join_timeout_s}


def source_params(source: Any) -> Any:
    """What a source holds, without iterating it: a module (vLLM's ``ModuleSource``, or any source with a
    ``module``), or a module / dict of tensors given directly."""
    if isinstance(source, (torch.nn.Module, dict)):
        return source
    module = getattr(source, "_module", None) or getattr(source, "module", None)
    if isinstance(module, torch.nn.Module):
        return module
    raise ConfigError("source", f"weightsync sends what each rank holds: pass ModuleSource(model), a module or a "
                                f"dict of tensors, got {type(source).__name__}")


def default_mapping(params: Any) -> Optional[str]:
    """The mapping of a transformers model's type (vLLM's fused names for it), if there is one."""
    from weightsync.engine.plan.mapping import MAPPINGS

    model_type = getattr(getattr(params, "config", None), "model_type", None)
    return model_type if model_type in MAPPINGS else None


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 init_info: WeightSyncTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info
        self.loop = BackgroundLoop(f"weightsync-trainer-{init_info.rank}")
        self.controller: Optional[Controller] = None
        self.sender: Any = None  # a WeightSender, or a TorchrunSender around one
        self.version = 0  # the last version sent (or, at start, committed before we joined)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-client")

    def __repr__(self) -> str:
        return f"<WeightSyncTrainerEngine rank {self.info.rank} v{self.version} {self.sender!r}>"

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "WeightSyncTrainerEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        try:
            address = engine.loop.call(engine._start, source_params(source), timeout=init_info.join_timeout_s + 60)
            if engine.is_sender:
                engine._init_workers(address)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _init_workers(self, address: str) -> None:
        try:
            self.client.init_weight_transfer_engine(self.info.worker_info(address))
        except Exception as exc:  # vLLM answers a worker's error with a bare status: say why from our side
            ctl = self.controller
            if ctl is not None and ctl.last_reject is not None:
                member, code, text = ctl.last_reject
                raise JoinRejected(code, f"{member}: {text}") from exc
            refused = ctl.refused if ctl is not None else 0
            why = (f"; the controller refused {refused} handshake(s): the workers' auth key "
                   f"(worker_auth_key_file / _env) is not the trainer's") if refused else ""
            said = getattr(getattr(exc, "response", None), "text", "")
            raise ConfigError("init_weight_transfer_engine", f"vLLM's workers did not join {address}: {exc} "
                                                             f"{said[:500]}{why}") from exc

    async def _start(self, params: Any) -> str:
        info, key = self.info, read_key(self.info.auth_key_file, None, "auth_key")
        options = dataclasses.replace(info.sender_options, auth_key=key, join_timeout_s=info.join_timeout_s)
        mapping = info.mapping or default_mapping(params)
        ctl_options = dataclasses.replace(info.controller_options, auth_key=key,
                                          round_timeout_s=info.controller_options.round_timeout_s or info.timeout_s,
                                          **({"mapping": mapping} if mapping else {}))
        import torch.distributed as dist

        if info.controller is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from .torchrun import TorchrunSender

            self.sender = TorchrunSender(params, receivers=self._receivers(), controller_bind=info.controller_bind,
                                         controller_options=ctl_options, sender_options=options)
            await self.sender.__aenter__()
            self.version = max(0, self.sender.sender.last_version)
            return self.sender.controller_address
        address = info.controller
        if address is None:
            self.controller = Controller(info.controller_bind, senders=1, receivers=self._receivers(), options=ctl_options)
            await self.controller.start()
            address = self.controller.address
        self.sender = WeightSender(address, params, rank=info.rank, options=options)
        await self.sender.start()
        self.version = max(0, self.sender.last_version)  # (an external controller may have committed some)
        return address

    def _receivers(self) -> int:
        if self.info.receivers is None:
            raise ConfigError("receivers", "to start a controller, say how many vLLM workers receive "
                                           "(tensor-parallel size x data-parallel replicas)")
        return self.info.receivers

    def send_weights(self) -> None:
        """One round: every rank pushes what it holds; rank 0 has vLLM take it (see the module doc)."""
        version = self.version + 1
        waiting: Optional[concurrent.futures.Future] = None
        try:
            if self.is_sender:
                self._pause()
                self.client.start_weight_update()
                waiting = self.pool.submit(self.client.update_weights,
                                           {"version": version, "timeout_s": self.info.timeout_s})
            self._round(version, waiting)
            if self.is_sender:
                self.client.finish_weight_update(str(version))
            self.version = version
        finally:
            if self.is_sender:
                self._resume()

    def _round(self, version: int, waiting: Optional[concurrent.futures.Future]) -> None:
        """Push and, on rank 0, wait for vLLM's ``update_weights``; the push's typed error wins (vLLM's
        HTTP answer to the same failure is a bare status), with vLLM's as a note."""
        try:
            self.loop.call(self._push, version, timeout=self.info.timeout_s + 60)
        except BaseException as exc:
            if waiting is not None:
                try:
                    waiting.result()
                except Exception as theirs:
                    exc.add_note(f"vLLM's update_weights: {theirs}")
            raise
        if waiting is not None:
            waiting.result()

    async def _push(self, version: int) -> None:
        await (await self.sender.push(version))

    def _pause(self) -> None:
        if self.info.pause:
            self._generation("pause", {"mode": self.info.pause})

    def _resume(self) -> None:
        if self.info.pause:
            self._generation("resume", {})

    def _generation(self, route: str, params: dict) -> None:
        """Pause or resume an HTTP server's generation (LLM and Ray callers do not generate meanwhile)."""
        base = getattr(self.client, "base_url", None)
        if base:
            import requests

            requests.post(f"{base}/{route}", params=params, timeout=self.info.timeout_s).raise_for_status()

    def shutdown(self) -> None:
        """Leave: rank 0 has the workers leave first (a later ``trainer_init`` joins again)."""
        try:
            if self.is_sender and self.sender is not None and hasattr(self.client, "shutdown_weight_transfer_engine"):
                self.client.shutdown_weight_transfer_engine()
        finally:
            try:
                self.loop.call(self._close, timeout=60)
            finally:
                self.loop.close()
                self.pool.shutdown(wait=False)

    async def _close(self) -> None:
        sender, self.sender = self.sender, None
        if hasattr(sender, "__aexit__"):
            await sender.__aexit__(None, None, None)
        elif sender is not None:
            await sender.close()
        controller, self.controller = self.controller, None
        if controller is not None:
            await controller.close()


class LLMClient:
    """vLLM's client protocol (``VLLMWeightSyncClient``) over an offline ``vllm.LLM`` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)


def register() -> None:
    """Register both engines as ``weightsync`` (idempotent: vLLM's registries refuse a duplicate name).
    The ``vllm.general_plugins`` entry point; also run when this module is imported."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "WeightSyncTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightSyncTrainerEngine)


register()
