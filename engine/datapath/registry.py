"""The registration cache: register whole allocations once, reuse them across rounds, evict explicitly.

How this works (plan/act): ``plan`` is pure. Given the regions a worker wants registered now
(region id -> 1-D byte tensor over a whole allocation), it compares them with what is registered and
returns actions: ``Register`` for new or changed allocations (a region id now backed by another
allocation, as after a shadow swap), ``Deregister`` for what is replaced. Unchanged regions cost
nothing (a hit). ``evict`` plans the removal of named regions. ``apply`` carries actions out against a
transport and records them; nothing else mutates the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

import torch

from weightsync.wire import RegionInfo

from ..transport import Transport


@dataclasses.dataclass(frozen=True)
class Register:
    region_id: int
    buffer: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Deregister:
    region_id: int


Action = Union[Register, Deregister]


def allocation_key(buffer: torch.Tensor) -> tuple:
    return (buffer.device, buffer.data_ptr(), buffer.numel() * buffer.element_size())


class RegistrationCache:
    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}  # region id -> allocation key
        self.infos: dict[int, RegionInfo] = {}
        self.hits = 0
        self.registrations = 0
        self.evictions = 0

    def __repr__(self) -> str:
        return (f"<RegistrationCache regions={len(self.entries)} hits={self.hits} "
                f"registrations={self.registrations} evictions={self.evictions}>")

    def plan(self, wanted: Mapping[int, torch.Tensor]) -> list[Action]:
        actions: list[Action] = []
        for region_id, buffer in sorted(wanted.items()):
            key = allocation_key(buffer)
            current = self.entries.get(region_id)
            if current == key:
                self.hits += 1
                continue
            if current is not None:
                actions.append(Deregister(region_id))
            actions.append(Register(region_id, buffer))
        return actions

    def evict(self, region_ids: Sequence[int]) -> list[Action]:
        return [Deregister(r) for r in sorted(region_ids) if r in self.entries]

    def apply(self, actions: Sequence[Action], transport: Transport) -> dict[int, RegionInfo]:
        """Carry out actions (registration is synchronous bookkeeping for every backend here)."""
        for action in actions:
            if isinstance(action, Register):
                self.infos[action.region_id] = transport.register(action.region_id, action.buffer)
                self.entries[action.region_id] = allocation_key(action.buffer)
                self.registrations += 1
            else:
                transport.deregister(action.region_id)
                self.entries.pop(action.region_id, None)
                self.infos.pop(action.region_id, None)
                self.evictions += 1
        return dict(self.infos)
