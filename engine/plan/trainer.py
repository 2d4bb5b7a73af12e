"""Trainer layouts: which part of each parameter a trainer rank holds under FSDP, EP and PP (pure).

How this works: ``TrainerLayout`` names the parallelism of a training job: ``pp`` pipeline stages
(layers split over stages as evenly as they go, the embedding with the first stage, the final norm and
the LM head with the last), and within each stage its ranks shard dense parameters FSDP-style (dim-0
shards a group can gather) and, with ``ep > 1``, split routed experts over ``ep`` ranks (dim 0 of a
fused expert tensor, or whole per-expert tensors), replicated across the stage's ``ranks / ep`` expert
groups. Every split is ``balanced``: counts that do not divide (384 experts over 256 ranks, 61 layers
over 4 stages, 160 experts over 64 ranks) give the first ranks one more, never drop any. An expert
is held by exactly the ranks of its EP slot, so only those can send it (the planner's forced pieces).
``holdings`` returns, for one rank, each parameter it holds with its shard: what its manifest says.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Sequence

from weightsync.wire import ShardSpec

from ..errors import ConfigError

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAST_STAGE = re.compile(r"(^|\.)(norm\.weight|lm_head\.weight)$")


def balanced(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``n`` items are split into ``parts`` as evenly as they go."""
    if parts < 1 or not 0 <= index < parts:
        raise ConfigError("parts", f"part {index} of {parts} does not exist")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """``world`` trainer ranks in ``pp`` stages; inside a stage FSDP (``fsdp``) and ``ep``-way experts."""

    world: int
    pp: int = 1
    ep: int = 1
    fsdp: bool = True

    def __post_init__(self) -> None:
        if self.world < 1 or self.pp < 1 or self.world % self.pp:
            raise ConfigError("pp", f"{self.world} ranks do not split into {self.pp} equal stages")
        if self.ep < 1 or (self.world // self.pp) % self.ep:
            raise ConfigError("ep", f"{self.world // self.pp} ranks per stage do not split into EP groups of {self.ep}")

    @property
    def per_stage(self) -> int:
        return self.world // self.pp

    def describe(self) -> str:
        parts = [f"{self.world} ranks"]
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        parts.append("fsdp" if self.fsdp else "dp")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "+".join(parts)


def stage_of(name: str, n_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter ``name``."""
    m = _LAYER.search(name)
    if m is not None:
        layer = int(m.group(1))
        return next(s for s in range(pp) if layer < balanced(n_layers, pp, s)[1])
    return pp - 1 if _LAST_STAGE.search(name) else 0


def holdings(params: Sequence, rank: int, layout: TrainerLayout) -> list[tuple[object, Optional[ShardSpec], bool]]:
    """(param, shard or None, gatherable) for each parameter rank ``rank`` holds (``params``: objects with
    ``name`` and ``shape``, e.g. ``weightsync.engine.models.shapes.ParamShape``)."""
    n_layers = 1 + max((int(m.group(1)) for p in params if (m := _LAYER.search(p.name))), default=-1)
    stage, local = divmod(rank, layout.per_stage)
    ep_slot = local % layout.ep
    experts = _expert_counts(params)
    out = []
    for p in params:
        if stage_of(p.name, max(n_layers, 1), layout.pp) != stage:
            continue
        one = _ONE_EXPERT.search(p.name)
        if layout.ep > 1 and one is not None:  # a per-expert tensor: its owners hold it whole
            first, stop = balanced(experts[p.name[: one.start()]], layout.ep, ep_slot)
            if not first <= int(one.group(1)) < stop:
                continue
            out.append((p, None, False))
        elif layout.ep > 1 and _FUSED_EXPERTS.search(p.name) and len(p.shape) == 3:
            a, b = balanced(p.shape[0], layout.ep, ep_slot)
            out.append((p, ShardSpec(tuple(p.shape), 0, a, b), False))
        elif layout.fsdp and p.shape and layout.per_stage > 1:
            a, b = balanced(p.shape[0], layout.per_stage, local)
            out.append((p, ShardSpec(tuple(p.shape), 0, a, b), True))
        else:
            out.append((p, None, False))
    return out


def _expert_counts(params: Iterable) -> dict[str, int]:
    """Per MoE block (the name before ``.experts.N.``): how many experts it has."""
    out: dict[str, int] = {}
    for p in params:
        m = _ONE_EXPERT.search(p.name)
        if m is not None:
            prefix = p.name[: m.start()]
            out[prefix] = max(out.get(prefix, 0), int(m.group(1)) + 1)
    return out
