"""weightsync.roles: the processes and the public async API (controller, sender, receiver, daemon, CLI).

The public names are imported on first use (``from roles import WeightSender``), so the command line
(``roles.cli``) starts without importing torch: ``weightsync --help`` answers at once.
"""

from __future__ import annotations

from engine.lazy import lazy_getattr

_PUBLIC = {
    "Controller": "roles.controller", "ControllerOptions": "roles.controller",
    "ReceiverOptions": "roles.receiver", "WeightReceiver": "roles.receiver",
    "RoundReport": "roles.rounds",
    "PushHandle": "roles.sender", "SenderOptions": "roles.sender", "WeightSender": "roles.sender",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_getattr("roles", _PUBLIC, globals())
