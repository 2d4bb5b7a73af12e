"""Exchanging two storages' memory: torch's binding and the probed-layout path agree."""

from __future__ import annotations

import gc

import pytest
import torch

from weightsync.engine.datapath import exchange


@pytest.mark.parametrize("native", [True, False], ids=["torch-binding", "probed-layout"])
def test_views_of_either_storage_see_the_others_bytes_and_both_free_cleanly(native):
    do = exchange.memory_exchange(torch.device("cpu"), native=native)
    assert do is not None
    a = torch.arange(64, dtype=torch.float32)
    b = torch.arange(64, dtype=torch.float32) + 1000
    view_a, view_b = a[8:12].view(2, 2), b[60:]
    pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    do(a.untyped_storage(), b.untyped_storage())
    assert a.untyped_storage().data_ptr() == pb and b.untyped_storage().data_ptr() == pa
    assert view_a.flatten().tolist() == [1008.0, 1009.0, 1010.0, 1011.0]
    assert view_b.tolist() == [60.0, 61.0, 62.0, 63.0]
    a.add_(1)  # writes land in the memory a now owns (b's old block)
    assert b[0].item() == 0.0 and a[0].item() == 1001.0
    do(a.untyped_storage(), b.untyped_storage())
    assert a.untyped_storage().data_ptr() == pa and view_b.tolist() == [1061.0, 1062.0, 1063.0, 1064.0]
    del a, b, view_a, view_b
    gc.collect()  # each block returns through its own deleter (a mismatch would crash here)


def test_the_probed_path_refuses_storages_of_different_sizes():
    do = exchange.memory_exchange(torch.device("cpu"), native=False)
    a, b = torch.zeros(16, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16 bytes on cpu and 32"):
        do(a.untyped_storage(), b.untyped_storage())
    assert a.untyped_storage().nbytes() == 16 and b.untyped_storage().nbytes() == 32
