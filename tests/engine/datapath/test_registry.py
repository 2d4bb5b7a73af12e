"""The registration cache's plan/act split (engine/datapath/registry.py)."""

from __future__ import annotations


import torch

from weightsync.engine.datapath.registry import Deregister, Register, RegistrationCache
from weightsync.engine.transport import create_transport


def test_registration_cache_plans_then_acts():
    cache = RegistrationCache()
    a, b = torch.zeros(128, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)
    actions = cache.plan({0: a})
    assert [type(x) for x in actions] == [Register]
    transport = create_transport("memory")
    cache.apply(actions, transport)
    assert cache.plan({0: a}) == [] and cache.hits == 1  # reused across rounds
    swap = cache.plan({0: b})  # the region now lives in another allocation (a shadow swap)
    assert [type(x) for x in swap] == [Deregister, Register]
    cache.apply(swap, transport)
    assert transport.regions[0].data_ptr() == b.data_ptr()  # the region is now b's memory
    cache.apply(cache.evict([0, 5]), transport)
    assert 0 not in transport.regions and "evictions=2" in repr(cache)
