"""``fp64`` fingerprints of many rows in one launch (``engine.cuda.fp64_kernel``) against the torch
reference, on a GPU (``gpu``) and on the CPU under Triton's interpreter where it is installed
(``TRITON_INTERPRET=1``; the interpreter runs the word kernel, whose table holds plain addresses)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from weightsync.engine.datapath.checksums import _bytes, _range, fp64

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")
def test_the_word_kernel_equals_the_reference_on_dense_and_pitched_rows():
    from weightsync.engine.cuda.fp64_kernel import WORDS, Fingerprints

    g = torch.Generator().manual_seed(0)
    views = [torch.randint(-2**31, 2**31 - 1, (3 * WORDS + 5,), generator=g, dtype=torch.int32),  # weights wrap
             torch.randint(-2**31, 2**31 - 1, (70000,), generator=g, dtype=torch.int32),  # past 65521 words
             torch.randn(333, 100, generator=g).to(torch.bfloat16),
             torch.randn(64, 300, generator=g).to(torch.bfloat16)[:, 10:110]]  # pitched: 200-byte rows
    ranges = tuple(_range(v) for v in views)
    assert ranges[3][2] != ranges[3][3]  # (pitched indeed)
    assert Fingerprints(ranges, torch.device("cpu")).run() == [fp64(_bytes(v.contiguous())) for v in views]


async def test_fp64_many_async_equals_the_blocking_one_in_order():
    from weightsync.engine.datapath.checksums import fp64_many, fp64_many_async

    g = torch.Generator().manual_seed(1)
    views = [torch.randn(37, 11, generator=g).to(torch.bfloat16), torch.randint(0, 255, (1001,), generator=g,
             dtype=torch.uint8), torch.randn(64, 300, generator=g)[:, 3:50], torch.empty(0)]
    assert await fp64_many_async(views) == fp64_many(views) == [fp64(_bytes(v.contiguous())) for v in views]
