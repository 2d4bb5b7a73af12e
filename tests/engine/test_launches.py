"""Copy kernels launched through the compiled kernel's own launcher (``engine.cuda.launches``) move the
same bytes as through Triton's launcher, and the way is taken only where its check on the device passed:
a check that copies wrong or raises sends every launch through Triton's launcher."""

from __future__ import annotations

import logging

import pytest
import torch

from weightsync.engine.cuda import launches

GPU = torch.cuda.is_available()


@pytest.fixture
def unchecked():
    """Each test checks the way afresh (the check is kept per device for the process)."""
    saved = dict(launches._checked)
    launches._checked.clear()
    yield
    launches._checked.clear()
    launches._checked.update(saved)


def test_without_cuda_the_check_fails_and_says_so(unchecked, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", _no_cuda)
    with caplog.at_level(logging.WARNING, logger="weightsync"):
        assert launches.direct_works(0) is False
    assert "Triton's launcher it is" in caplog.text
    assert launches.direct_works(0) is False  # (kept: checked once)


def _no_cuda(index):
    raise RuntimeError("no CUDA device here")


SPANS = [(0, 4096), (4096, 4101), (5008, 70000), (70003, 70010), (80000, 300000)]  # (bytes: two unaligned)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("programs", [None, 3])
def test_dense_copies_land_the_same_either_way(unchecked, programs):
    from weightsync.engine.cuda.copy_kernel import CopyKernel

    assert launches.direct_works(0), "this Triton's compiled kernels launch directly (checked on scratch memory)"
    src = torch.randint(-2**31, 2**31 - 1, (300_000,), dtype=torch.int32, device="cuda:0",
                        generator=torch.Generator("cuda:0").manual_seed(0)).view(torch.uint8)
    outs = []
    for direct in (True, False):
        dst = torch.zeros_like(src)
        copies = [(dst.data_ptr() + a, src.data_ptr() + a, b - a) for a, b in SPANS]
        kernel = CopyKernel(copies, 0, programs=programs, tile=256, steps=4, direct=direct)
        assert kernel.launcher.direct is direct and len(kernel.rest) == 2, kernel  # (unaligned: pointer copies)
        stream = torch.cuda.Stream(0)
        kernel.launch(stream)
        stream.synchronize()
        outs.append(dst)
    want = torch.zeros_like(src)
    for a, b in SPANS:
        want[a:b] = src[a:b]
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_pitched_copies_land_the_same_either_way(unchecked, monkeypatch):
    from weightsync.engine.cuda.copy_kernel import PitchedKernel

    full = torch.randn(700, 900, device="cuda:0")
    got = []
    for works in (True, False):
        launches._checked[0] = works
        dst = torch.zeros(300, 500, device="cuda:0")
        kernel = PitchedKernel([(dst.data_ptr(), full[100:].data_ptr() + 40 * 4, 500 * 4, 300, 900 * 4)], 0)
        assert kernel.launcher.direct is works
        kernel.launch(torch.cuda.current_stream(0))
        torch.cuda.synchronize(0)
        got.append(dst)
    assert torch.equal(got[0], full[100:400, 40:540]) and torch.equal(got[1], got[0])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("column", [40, 41, 42])  # (16-byte aligned: vectors; 4 or 8 bytes off: words)
def test_pitched_kernel_moves_vectors_only_where_every_copy_allows(column):
    from weightsync.engine.cuda.copy_kernel import PitchedKernel

    full = torch.randn(700, 900, device="cuda:0")
    dst = torch.zeros(300, 500, device="cuda:0")
    kernel = PitchedKernel([(dst.data_ptr(), full[100:].data_ptr() + column * 4, 500 * 4, 300, 900 * 4)], 0)
    assert kernel.vec is (column % 4 == 0)
    kernel.launch(torch.cuda.current_stream(0))
    torch.cuda.synchronize(0)
    assert torch.equal(dst, full[100:400, column:column + 500])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_a_check_that_copies_wrong_bytes_keeps_triton_s_launcher(unchecked, monkeypatch, caplog):
    from weightsync.engine.cuda import copy_kernel

    monkeypatch.setattr(copy_kernel.CopyKernel, "launch", lambda self, stream: None)  # (copies nothing)
    with caplog.at_level(logging.WARNING, logger="weightsync"):
        assert launches.direct_works(0) is False
    assert "copied wrong bytes" in caplog.text
    monkeypatch.undo()
    src = torch.arange(4096, dtype=torch.int32, device="cuda:0")
    dst = torch.zeros_like(src)
    kernel = copy_kernel.CopyKernel([(dst.data_ptr(), src.data_ptr(), src.numel() * 4)], 0)
    assert not kernel.launcher.direct
    kernel.launch(torch.cuda.current_stream(0))
    torch.cuda.synchronize(0)
    assert torch.equal(dst, src)
