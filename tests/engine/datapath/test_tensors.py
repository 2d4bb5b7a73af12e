"""Byte views, ties and flat layouts (engine/datapath/tensors.py)."""

from __future__ import annotations


import pytest
import torch

from weightsync.engine.datapath.tensors import FlatBuffer, aligned_layout, byte_view, find_ties, named_tensors
from weightsync.engine.errors import ConfigError


def test_byte_view_zero_copy_and_odd_dtypes():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    v = byte_view(t)
    assert len(v) == 12
    v[0] = 0xFF
    assert t.view(torch.uint8)[0, 0] == 0xFF  # same memory
    assert len(byte_view(torch.empty(0, 5))) == 0 and len(byte_view(torch.tensor(3, dtype=torch.int64))) == 8
    with pytest.raises(ConfigError, match="contiguous"):
        byte_view(t.t())


def test_ties_and_layout():
    w = torch.randn(4, 4)
    named = {"a": w, "b": w, "c": torch.randn(3), "d": w.t()}
    ties = find_ties(named)
    assert ties == {"b": "a"}  # same memory, but d has other strides: not a tie
    offsets, total = aligned_layout(named, ties)
    assert offsets["b"] == offsets["a"] and all(o % 256 == 0 for o in offsets.values())
    buf = FlatBuffer(total)
    assert buf.view(offsets["c"], torch.float32, (3,)).shape == (3,)
    module = torch.nn.Linear(2, 3)
    assert set(named_tensors(module)) == {"weight", "bias"}
    with pytest.raises(ConfigError, match="params"):
        named_tensors([1, 2])
