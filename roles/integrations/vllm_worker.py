"""vLLM: a worker extension that makes each vLLM worker a weightsync receiver of its own parameters.

Use it by name when building the engine, then drive it through ``collective_rpc``::

    llm = LLM(model=path, enforce_eager=True, worker_extension_cls=EXTENSION)
    llm.collective_rpc("weightsync_join", args=(controller_address,), kwargs={"rank_offset": 0})
    llm.collective_rpc("weightsync_wait", args=(version,))      # -> [version, ...] once committed
    llm.collective_rpc("weightsync_status")                     # -> [dict, ...]
    llm.collective_rpc("weightsync_leave")

How this works (``join``, ``wait``, ``status`` and ``leave`` are module functions: the ``weightsync``
backend of vLLM's weight-transfer API, ``vllm_backend``, runs the same ones). ``weightsync_join`` runs
in every worker process. It derives the receiver layout from
the model's Hugging Face config (``receiver_layout``: vLLM's fused ``qkv_proj`` / ``gate_up_proj`` names
through the mapping of the config's ``model_type``, this worker's tensor-parallel shard), checks it
against the worker's parameters (a missing or differently shaped one is a ``ConfigError`` naming it),
and starts an in-place ``WeightReceiver`` over those parameters on a ``BackgroundLoop``. Senders write
straight into the parameters, and a ``GenerationGate`` keeps them apart from generation, so no step
sees a half-applied version; after an abort the gate stays closed (``dirty``) until a later round
commits, or until ``weightsync_leave``. When updates may land (``updates``):

- ``anytime`` (the default with one worker): the gate wraps the model's ``forward`` and
  ``compute_logits``; from a round's ``begin`` to its commit no forward pass runs (generation pauses at
  the next step and resumes after the commit), while ``generate`` calls go on.
- ``on_wait`` (the default with tensor parallelism): updates land only while the driver is inside
  ``weightsync_wait(v)``, i.e. between ``generate`` calls, and only versions up to ``v``. TP workers run
  each step together, so a gate closing on one rank mid-generation would leave the others waiting
  inside the step for it; a round that begins during a ``generate`` call, or for a version beyond the
  one awaited, waits for the next ``weightsync_wait`` on every rank alike.

Where vLLM keeps a layer's weights in a kernel-specific form (on CPU, linear layers are packed for
oneDNN and their ``weight`` parameter emptied), the receiver holds a plain tensor for that weight and
the commit re-runs the layer's ``process_weights_after_loading`` from it while the gate is still
closed: what vLLM itself does after loading weights. Fused-MoE layers (``w13_weight`` / ``w2_weight``
stacks; Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5 and DeepSeek-V3 through their mappings) are always held
so, since the CPU kernel prepacks them in tensors of the same shape: the commit makes the layer's MoE
kernel again from the plain stacks. With ``enable_expert_parallel`` each worker holds and receives its
share of the experts (``expert_parallel``); without it, its share of every expert (its rows of each
expert's gate and up in w13, its columns of w2). A head tied to the embedding shares its parameter, but
vLLM CPU packs a copy of it for the head's kernel: the commit packs the head again. Multi-head latent
attention (DeepSeek-V3, Kimi-K2) keeps matrices derived from ``kv_b_proj`` after loading (``W_UK_T``,
``W_UV``); the commit derives them again from the pushed ``kv_b_proj`` (``mla_layers``), after the layers
are repacked. A parameter vLLM keeps in another float dtype than the model's (the router's
``e_score_correction_bias``, float32) is received in its own dtype: the senders cast.

vLLM must run eagerly (``enforce_eager=True``): joining re-homes the parameters into one registered
buffer, which moves them, and captured CUDA graphs or compiled code would keep reading the old memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import torch

from weightsync.engine.dtypes import dtype_name
from weightsync.engine.errors import ConfigError
from weightsync.engine.models.shapes import config_shapes
from weightsync.engine.plan.mapping import MAPPINGS
from weightsync.engine.transforms.layouts import ExpertParallel, LayoutEntry, TensorParallel, receiver_layout

from ..receiver import ReceiverOptions, WeightReceiver
from .threads import BackgroundLoop, GenerationGate

log = logging.getLogger("weightsync")

EXTENSION = "weightsync.roles.integrations.vllm_worker.WeightSyncWorkerExtension"
UPDATES = ("auto", "anytime", "on_wait")
GATED = ("forward", "compute_logits")


def hf_sources(hf_config: Any, dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The trainer-side names and shapes of a transformers config."""
    return {p.name: (dtype, p.shape) for p in config_shapes(hf_config, dtype)}


@dataclasses.dataclass
class Binding:
    """What one worker's receiver holds: tensor per name, shard specs, the layers to re-process at
    commit, each with the plain tensors it is rebuilt from (attribute -> tensor), and the attention
    layers whose weights vLLM derives from a bound layer after loading (``derived``: MLA)."""
    tensors: dict[str, torch.Tensor]
    shards: dict[str, Any]
    repack: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]
    derived: list[torch.nn.Module] = dataclasses.field(default_factory=list)


FLOATS = ("float16", "bfloat16", "float32", "float64")


def _held(have: str, want: str) -> bool:
    """Whether a parameter of dtype ``have`` can hold what the layout says is ``want``: the same dtype,
    or another float one (vLLM keeps some tensors in float32 whatever the model's dtype, MoE routers'
    correction bias: the receiver declares what it holds and the senders cast)."""
    return have == want or (have in FLOATS and want in FLOATS)


def mla_layers(model: torch.nn.Module, bound: set[int]) -> list[torch.nn.Module]:
    """vLLM's MLA attention layers whose ``kv_b_proj`` is bound: after loading, vLLM derives their
    absorbed matrices (``W_UK_T``, ``W_UV``) from it, so a commit must derive them again."""
    return [m for m in model.modules()
            if id(getattr(m, "kv_b_proj", None)) in bound and callable(getattr(m, "process_weights_after_loading", None))]


def fused_experts(layer: torch.nn.Module) -> bool:
    """A vLLM fused-MoE experts layer: ``w13_weight`` / ``w2_weight`` stacks whose kernel may keep them in
    its own form (on CPU, prepacked in tensors of the same shape, or padded)."""
    return hasattr(layer, "w13_weight") and hasattr(getattr(layer, "quant_method", None), "moe_kernel")


def bind(model: torch.nn.Module, layout: list[LayoutEntry], tied: bool) -> Binding:
    """Match a receiver layout against a vLLM model's parameters (pure apart from allocating the plain
    tensors of packed layers)."""
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    repack: dict[int, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}
    bound: set[int] = set()  # the layers of bound parameters
    for entry in layout:
        param = params.get(entry.name)
        if param is None:
            if tied and entry.name == "lm_head.weight":
                continue  # vLLM shares the embedding: the sender's copy of it is not needed here
            raise ConfigError("parameter", f"{entry.name}: in the layout but not in the vLLM model "
                                           f"(it has e.g. {sorted(params)[:4]})")
        want = (entry.shape, entry.dtype)
        have = (tuple(param.shape), dtype_name(param.dtype))
        path, _, attr = entry.name.rpartition(".")
        layer = model.get_submodule(path)
        bound.add(id(layer))
        packed = hasattr(layer, "cpu_linear") and attr == "weight"  # the kernel reads a copy packed from it
        if fused_experts(layer):  # always rebuilt from plain stacks: a packed one looks like a plain one
            if (not _held(have[1], want[1]) or len(have[0]) != 3 or have[0][0] != want[0][0]
                    or any(h < w for h, w in zip(have[0], want[0]))):  # (a kernel may pad, never cut)
                raise ConfigError("parameter", f"{entry.name}: the layout says {want[0]} {want[1]}, "
                                               f"the vLLM model holds {have[0]} {have[1]}")
            plain = torch.empty(entry.shape, dtype=param.dtype, device=param.device)
        elif packed and param.numel() == 0:
            plain = torch.empty(entry.shape, dtype=param.dtype, device=param.device)  # emptied after packing
        elif have[0] == want[0] and _held(have[1], want[1]):
            plain = param
            if not packed:
                tensors[entry.name] = param
                continue
        else:
            raise ConfigError("parameter", f"{entry.name}: the layout says {want[0]} {want[1]}, "
                                           f"the vLLM model holds {have[0]} {have[1]}")
        tensors[entry.name] = plain
        repack.setdefault(id(layer), (layer, {}))[1][attr] = plain  # the kernel's form is made from it
    head = getattr(model, "lm_head", None)
    if tied and hasattr(head, "cpu_linear") and any(t is head.weight for t in tensors.values()):
        # the head shares the embedding's parameter, but its kernel reads a copy packed from it at load
        repack.setdefault(id(head), (head, {}))[1]["weight"] = head.weight
    return Binding(tensors, {e.name: e.shard for e in layout if e.shard is not None and e.name in tensors},
                   list(repack.values()), mla_layers(model, bound))


def commit_layers(binding: Binding, dtype: torch.dtype) -> None:
    """What vLLM does after loading weights, for the layers a round wrote: each packed layer's kernel
    form rebuilt from its plain weights (a fused-MoE layer's kernel made again, as at load: processing
    it as a weight update would copy the plain stacks into the packed ones), then the weights attention
    layers derive from them (MLA's absorbed matrices, computed in ``dtype``, vLLM's activation dtype)."""
    for layer, plains in binding.repack:
        for attr, plain in plains.items():
            if getattr(layer, attr) is not plain:
                setattr(layer, attr, torch.nn.Parameter(plain, requires_grad=False))
        if fused_experts(layer):
            layer.quant_method.moe_kernel = None
        layer.quant_method.process_weights_after_loading(layer)
    for layer in binding.derived:
        layer.process_weights_after_loading(dtype)


def expert_parallel(parallel_config: Any, tp: Optional[TensorParallel]) -> Optional[ExpertParallel]:
    """This worker's expert shard: with ``enable_expert_parallel`` vLLM spreads the experts over the
    tensor-parallel ranks (one data-parallel rank: its expert-parallel group is its TP group)."""
    if not getattr(parallel_config, "enable_expert_parallel", False) or tp is None:
        return None
    if getattr(parallel_config, "data_parallel_size", 1) > 1:
        raise ConfigError("data_parallel_size", "expert parallelism across data-parallel ranks is not bound: "
                                                "serve one data-parallel rank per engine")
    return ExpertParallel(tp.index, tp.world)


class _Joined:
    def __init__(self, receiver: WeightReceiver, loop: BackgroundLoop, gate: GenerationGate,
                 binding: Binding, tp: Optional[TensorParallel], ep: Optional[ExpertParallel],
                 dtype: torch.dtype) -> None:
        self.receiver, self.loop, self.gate, self.binding, self.tp, self.ep = receiver, loop, gate, binding, tp, ep
        self.dtype = dtype  # vLLM's activation dtype (derived weights are computed in it)
        self.repack_s = 0.0
        self.updates = "anytime"
        self.generation_holds = False  # on_wait: the worker's thread holds the gate outside weightsync_wait

    async def after_update(self, version: int, ok: bool) -> None:
        if ok:
            started = time.perf_counter()
            commit_layers(self.binding, self.dtype)
            self.repack_s = time.perf_counter() - started
        self.gate.after_update(version, ok)  # an abort keeps it closed: parameters are half written


def join(model: torch.nn.Module, vllm_config: Any, worker_rank: int, controller: str, *, rank: Optional[int] = None,
         rank_offset: int = 0, mapping: Optional[str] = None, transport: str = "tcp",
         auth_key: Optional[bytes] = None, updates: str = "auto", join_timeout_s: float = 120.0,
         name: str = "worker") -> _Joined:
    """Make this vLLM worker's ``model`` an in-place receiver of its own shard and join ``controller``
    (the worker extension's ``weightsync_join`` and the ``weightsync`` backend's init share it)."""
    if updates not in UPDATES:
        raise ConfigError("updates", f"must be one of {UPDATES}, got {updates!r}")
    model_config = vllm_config.model_config
    if not model_config.enforce_eager:
        raise ConfigError("enforce_eager", "weightsync's vLLM receiver needs LLM(..., enforce_eager=True): "
                                           "joining moves the parameters, which captured graphs would not see")
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    world = get_tensor_model_parallel_world_size()
    tp = TensorParallel(get_tensor_model_parallel_rank(), world) if world > 1 else None
    ep = expert_parallel(vllm_config.parallel_config, tp)
    hf_config = model_config.hf_config
    mapping = mapping or (hf_config.model_type if hf_config.model_type in MAPPINGS else "identity")
    dtype = dtype_name(model_config.dtype)
    layout = receiver_layout(hf_sources(hf_config, dtype), mapping, tp=tp, ep=ep)
    binding = bind(model, layout, bool(getattr(hf_config, "tie_word_embeddings", False)))
    updates = ("anytime" if tp is None else "on_wait") if updates == "auto" else updates
    gate = GenerationGate(windows=updates == "on_wait")
    loop = BackgroundLoop(f"weightsync-{name}-{worker_rank}")
    joined = _Joined(None, loop, gate, binding, tp, ep, model_config.dtype)  # type: ignore[arg-type]
    rank = rank_offset + worker_rank if rank is None else rank
    options = ReceiverOptions(transport=transport, join_timeout_s=join_timeout_s, auth_key=auth_key)
    receiver = WeightReceiver(controller, binding.tensors, rank=rank, options=options, mode="inplace",
                              shards=binding.shards, before_update=gate.before_update,
                              after_update=joined.after_update)
    joined.receiver = receiver
    joined.updates = updates
    try:
        loop.call(receiver.start, timeout=join_timeout_s + 30)
    except BaseException:
        loop.close()
        raise
    if joined.updates == "anytime":
        for fn in GATED:
            if hasattr(model, fn):
                setattr(model, fn, gate.wrap(getattr(model, fn)))
    else:
        gate.hold()  # generation owns the gate; waiting lends it to updates
        joined.generation_holds = True
    log.info("weightsync: vLLM worker %s joined %s as receiver/%d (%d tensors, %d repacked, %d derived, "
             "tp=%s, ep=%s)", worker_rank, controller, rank, len(binding.tensors), len(binding.repack),
             len(binding.derived), tp, ep)
    return joined


def wait(joined: _Joined, version: int, timeout_s: float, *, strict: bool = False) -> int:
    """Block until a version >= ``version`` is committed here; returns the committed version. With
    ``on_wait`` updates land only meanwhile. ``strict``: a round for ``version`` (or newer) aborted here
    raises its ``RoundAborted`` rather than waiting for a later version."""
    receiver = joined.receiver
    until = receiver.wait_committed if strict else receiver.wait_for
    if joined.updates == "anytime":
        return joined.loop.call(until, version, timeout=timeout_s)
    joined.gate.open_window(version, release=joined.generation_holds)  # rounds up to version may land
    joined.generation_holds = False
    try:
        return joined.loop.call(until, version, timeout=timeout_s)
    finally:
        joined.gate.close_window()
        joined.gate.hold(timeout_s)  # waits for a round of this window still finishing
        joined.generation_holds = True


def status(joined: _Joined) -> dict:
    r, gate = joined.receiver, joined.gate
    return {"rank": r.rank, "version": r.version, "state": r.session.state.value, "dirty": r.dirty,
            "committed": r.rounds_committed, "aborted": r.rounds_aborted, "tensors": len(r.tensors),
            "tp": None if joined.tp is None else [joined.tp.index, joined.tp.world],
            "ep": None if joined.ep is None else [joined.ep.index, joined.ep.world],
            "expert_bytes": sum(t.nbytes for layer, plains in joined.binding.repack if fused_experts(layer)
                                for t in plains.values()),
            "updates": joined.updates, "paused": gate.held, "pauses": gate.updates, "paused_s": round(gate.paused_s, 6),
            "repacked_layers": len(joined.binding.repack), "derived_layers": len(joined.binding.derived),
            "repack_s": round(joined.repack_s, 6)}


def leave(joined: _Joined, model: torch.nn.Module) -> None:
    """Leave the controller, unwrap the model and open the gate (generation continues on what it has)."""
    try:
        joined.loop.call(joined.receiver.close, timeout=30)
    finally:
        joined.loop.close()
        for fn in GATED:
            wrapped = getattr(model, fn, None)
            if hasattr(wrapped, "__wrapped__"):
                setattr(model, fn, wrapped.__wrapped__)
        joined.gate.open()
        if joined.generation_holds:
            joined.gate.release()


class WeightSyncWorkerExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls=EXTENSION``); see the module doc."""

    def weightsync_join(self, controller: str, rank: Optional[int] = None, *, rank_offset: int = 0,
                        mapping: Optional[str] = None, transport: str = "tcp", auth_key_hex: Optional[str] = None,
                        updates: str = "auto", join_timeout_s: float = 120.0) -> dict:
        """Join ``controller`` as an in-place receiver of this worker's parameters; returns its status.
        ``rank``: this receiver's rank (default ``rank_offset`` + the worker's global rank). ``updates``:
        ``anytime``, ``on_wait`` or ``auto`` (``anytime`` with one TP rank, else ``on_wait``)."""
        if getattr(self, "_weightsync", None) is not None:
            raise ConfigError("weightsync_join", "this worker has joined already (weightsync_leave first)")
        self._weightsync = join(self.model_runner.model, self.vllm_config, self.rank, controller, rank=rank,
                                rank_offset=rank_offset, mapping=mapping, transport=transport,
                                auth_key=bytes.fromhex(auth_key_hex) if auth_key_hex else None, updates=updates,
                                join_timeout_s=join_timeout_s)
        return self.weightsync_status()

    def weightsync_wait(self, version: int, timeout_s: float = 600.0) -> int:
        """Block until a version >= ``version`` is committed here; returns the committed version."""
        return wait(self._weightsync_joined(), version, timeout_s)

    def weightsync_status(self) -> dict:
        return status(self._weightsync_joined())

    def weightsync_leave(self) -> None:
        """Leave the controller, unwrap the model and open the gate (generation continues on what it has)."""
        joined = getattr(self, "_weightsync", None)
        if joined is None:
            return
        self._weightsync = None
        leave(joined, self.model_runner.model)

    def _weightsync_joined(self) -> _Joined:
        joined = getattr(self, "_weightsync", None)
        if joined is None:
            raise ConfigError("weightsync_join", "this worker has not joined a controller yet")
        return joined
