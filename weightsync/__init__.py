"""weightsync: moves freshly trained weights from trainer GPUs to inference GPUs.

One import name; three layers under it, arrows pointing one way:

| subpackage | concern |
| --- | --- |
| ``weightsync.roles`` | processes and sockets: controller, sender, receiver, daemon, CLI, launchers, integrations |
| ``weightsync.engine`` | the data plane: transports, compiled rounds, staging, transforms, planning |
| ``weightsync.wire`` | the sans-IO control protocol (no zmq, no asyncio) |

The common names are importable from here (``from weightsync import Controller, WeightSender,
WeightReceiver``) and are imported on first use, so ``import weightsync`` does not import torch.

In a wheel the three folders are installed under this package (setuptools ``package_dir``). In a
source checkout they stay at the repository's top, beside this folder, and this package's search path
reaches them there.
"""

from __future__ import annotations

import pathlib as _pathlib

_HERE = _pathlib.Path(__file__).resolve().parent
if not (_HERE / "engine").is_dir() and (_HERE.parent / "engine" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # source checkout: weightsync.engine is ../engine

from .engine.lazy import lazy_getattr as _lazy_getattr  # noqa: E402

_PUBLIC = {
    "Controller": "weightsync.roles.controller", "ControllerOptions": "weightsync.roles.controller",
    "WeightSender": "weightsync.roles.sender", "SenderOptions": "weightsync.roles.sender",
    "PushHandle": "weightsync.roles.sender",
    "WeightReceiver": "weightsync.roles.receiver", "ReceiverOptions": "weightsync.roles.receiver",
    "RoundReport": "weightsync.roles.rounds",
    "WeightSyncError": "weightsync.engine.errors",
    "TransportOptions": "weightsync.engine.transport", "PipelineOptions": "weightsync.engine.datapath.pipeline",
    "PlanOptions": "weightsync.engine.plan", "TrainerLayout": "weightsync.engine.plan.trainer",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"

__getattr__ = _lazy_getattr("weightsync", _PUBLIC, globals())
