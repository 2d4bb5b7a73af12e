"""The block-FP8 kernel's own fingerprints (``fp8_kernel.Batch(fingerprint=True)``): what a launch writes in
place never is on the sender, so the launch adds up each block's share of the ``fp64`` of the weight row and
of the scales row. They equal ``fp64`` of the outputs' bytes, for tensors of every class (aligned, ragged
edges, transposed, a column slice). Run on the CPU under Triton's interpreter where it is installed
(``TRITON_INTERPRET=1``; ``make test`` has no Triton and skips this; the GPU tests run the kernel there)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from weightsync.engine.datapath.checksums import _bytes, fp64

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_launchs_fingerprints_equal_fp64_of_what_it_wrote(dtype):
    from weightsync.engine.transforms import fp8_kernel

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 260, generator=g) * 3).to(dtype)
    wide = torch.randn(530, 509, generator=g).to(dtype)  # (past 65521 words, odd rows: weights wrap, slots carry)
    aligned = torch.randn(650, 528, generator=g).to(dtype)  # (read back as words; past 65521 of them; edge blocks)
    xs = [x, x.t(), x[:, 5:133], torch.randn(128, 256, generator=g).to(dtype), torch.zeros(130, 17, dtype=dtype), wide,
          aligned]
    batch = fp8_kernel.Batch(xs, 128, fingerprint=True)
    out = batch.run()
    want = [(fp64(_bytes(q.contiguous())), fp64(_bytes(s.contiguous()))) for q, s in out]
    assert fp8_kernel.fingerprints(batch.prints) == want
    assert len(set(want)) == len(want)  # (distinct rows: a fingerprint per tensor, not one for all)
