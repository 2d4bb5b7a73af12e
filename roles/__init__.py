"""weightsync.roles: the processes and the public async API (controller, sender, receiver, daemon, CLI)."""

from .controller import Controller, ControllerOptions
from .receiver import ReceiverOptions, WeightReceiver
from .rounds import RoundReport
from .sender import PushHandle, SenderOptions, WeightSender

__all__ = [
    "Controller", "ControllerOptions", "ReceiverOptions", "WeightReceiver", "RoundReport", "PushHandle",
    "SenderOptions", "WeightSender",
]
