"""Actor classes for tests/integrations/test_ray.py (a module Ray's workers can import)."""

from __future__ import annotations

import torch

from weightsync.roles.integrations.ray_actors import RayReceiver, RaySender

SHAPES = {"embed.weight": (128, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head.weight": (64, 32)}


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(t.double().sum()) + float(t.double().abs().max()) for name, t in sorted(state.items())}


class Trainer(RaySender):
    def __init__(self) -> None:
        self.model = weights(0)

    def step(self, version: int) -> None:
        """Stands in for an optimizer step: the weights every data-parallel rank holds after ``version``."""
        for name, t in weights(version).items():
            self.model[name].copy_(t)


class Inference(RayReceiver):
    def __init__(self) -> None:
        self.model = {name: torch.zeros(shape) for name, shape in SHAPES.items()}

    def fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model)
