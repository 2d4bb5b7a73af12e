"""weightsync.roles: the processes and the public async API (controller, sender, receiver, daemon, CLI).

The public names are imported on first use (``from weightsync.roles import WeightSender``), so the command line
(``weightsync.roles.cli``) starts without importing torch: ``weightsync --help`` answers at once.
"""

from __future__ import annotations

from weightsync.engine.lazy import lazy_getattr

_PUBLIC = {
    "Controller": "weightsync.roles.controller", "ControllerOptions": "weightsync.roles.controller",
    "ReceiverOptions": "weightsync.roles.receiver", "WeightReceiver": "weightsync.roles.receiver",
    "RoundReport": "weightsync.roles.rounds",
    "PushHandle": "weightsync.roles.sender", "SenderOptions": "weightsync.roles.sender", "WeightSender": "weightsync.roles.sender",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_getattr("weightsync.roles", _PUBLIC, globals())
