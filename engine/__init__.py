"""weightsync's engine: the data plane, under ``roles`` (sockets, processes) and over ``wire`` (the protocol).

Where things are:

| folder / module | concern |
| --- | --- |
| ``datapath/`` | a round's bytes: compiled tables and their replay, the stage -> write pipeline, staging, registrations, checksums |
| ``transports/`` | the backends (tcp, cuda_ipc, uccl, memory, auto); ``transport`` is their contract and lazy registry |
| ``transforms/`` | what a row goes through on the sender: casts, TP slices, fused names, block FP8 (and its Triton kernel), FSDP gathers |
| ``cuda/`` | direct CUDA: the runtime binding, allocator blocks, the same-GPU copy kernel |
| ``plan/`` | pure planning: name mappings, trainer layouts, the routing planner, its cost model |
| ``models/`` | the model shape catalogue (transformers configs, TP/EP slicing) |
| ``errors``, ``dataauth`` | typed errors that name their culprit; the data plane's pair keys and proofs |

The public names below are importable from here (``from engine import Pipeline``); each is imported
on first use, so ``import engine`` stays light.
"""

from __future__ import annotations

from .lazy import lazy_getattr

_PUBLIC = {
    "Pipeline": "engine.datapath.pipeline", "PipelineOptions": "engine.datapath.pipeline",
    "PushReport": "engine.datapath.pipeline", "RoundCompiler": "engine.datapath.compiled",
    "SourceSet": "engine.datapath.staging", "StagingPool": "engine.datapath.staging",
    "RegistrationCache": "engine.datapath.registry",
    "Transport": "engine.transport", "Connection": "engine.transport", "TransportOptions": "engine.transport",
    "create_transport": "engine.transport", "register_backend": "engine.transport",
    "TransformSet": "engine.transforms", "Quantizer": "engine.transforms",
    "FP8Policy": "engine.transforms.layouts", "TensorParallel": "engine.transforms.layouts",
    "receiver_layout": "engine.transforms.layouts", "Gatherer": "engine.transforms.gather",
    "PlanOptions": "engine.plan", "get_mapping": "engine.plan.mapping",
    "TrainerLayout": "engine.plan.trainer", "state_dict_shapes": "engine.models.shapes",
    "WeightSyncError": "engine.errors",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_getattr("engine", _PUBLIC, globals())
