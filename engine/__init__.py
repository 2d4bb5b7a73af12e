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

The public names below are importable from here (``from weightsync.engine import Pipeline``); each is imported
on first use, so ``import weightsync.engine`` stays light.
"""

from __future__ import annotations

from .lazy import lazy_getattr

_PUBLIC = {
    "Pipeline": "weightsync.engine.datapath.pipeline", "PipelineOptions": "weightsync.engine.datapath.pipeline",
    "PushReport": "weightsync.engine.datapath.pipeline", "RoundCompiler": "weightsync.engine.datapath.compiled",
    "SourceSet": "weightsync.engine.datapath.staging", "StagingPool": "weightsync.engine.datapath.staging",
    "RegistrationCache": "weightsync.engine.datapath.registry",
    "Transport": "weightsync.engine.transport", "Connection": "weightsync.engine.transport", "TransportOptions": "weightsync.engine.transport",
    "create_transport": "weightsync.engine.transport", "register_backend": "weightsync.engine.transport",
    "TransformSet": "weightsync.engine.transforms", "Quantizer": "weightsync.engine.transforms",
    "FP8Policy": "weightsync.engine.transforms.layouts", "TensorParallel": "weightsync.engine.transforms.layouts",
    "receiver_layout": "weightsync.engine.transforms.layouts", "Gatherer": "weightsync.engine.transforms.gather",
    "PlanOptions": "weightsync.engine.plan", "get_mapping": "weightsync.engine.plan.mapping",
    "TrainerLayout": "weightsync.engine.plan.trainer", "state_dict_shapes": "weightsync.engine.models.shapes",
    "WeightSyncError": "weightsync.engine.errors",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_getattr("weightsync.engine", _PUBLIC, globals())
