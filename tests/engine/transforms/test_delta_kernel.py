"""The batched delta kernels (``engine.cuda.delta_kernel`` and ``delta_apply``; on CPUs ``engine.transforms.
delta_cpu``'s ``encode_many`` and ``Applier``) against the torch codec, bit for bit.

The Triton kernels on a GPU (``gpu``), and on the CPU under Triton's interpreter where it is installed
(``TRITON_INTERPRET=1``; ``make test`` has no Triton and skips those); the compiled CPU ones
(``"numba"``) wherever numba is. Rows of every width the kernels take, block edges, gaps around 256
(escaped across a block boundary too), far steps; malformed deltas refused before anything is written.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from weightsync.engine.datapath.checksums import fp64_change
from weightsync.engine.transforms import delta as codec

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs CUDA")]),
           pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")),
           pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                          reason="needs numba"))]
TILE, BLOCK = 2048, 1024  # the Triton kernels' (rows and changes cut at these)


def _kernel(device: str = "cuda"):
    if device == "numba":
        from weightsync.engine.transforms import delta_cpu

        return delta_cpu
    from weightsync.engine.cuda import delta_kernel

    assert (delta_kernel.TILE, delta_kernel.BLOCK) == (TILE, BLOCK)
    return delta_kernel


def _apply(device: str = "cuda"):
    if device == "numba":
        from weightsync.engine.transforms import delta_cpu

        return delta_cpu
    from weightsync.engine.cuda import delta_apply

    return delta_apply


def _pair(g, numel: int, dtype: torch.dtype, fraction: float, far: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new): ``fraction`` of the values changed, most by one unit, ``far`` of those by a lot."""
    new = (torch.randn(numel, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    base = new.clone()
    bits = codec.bits(base)
    picked = torch.rand(numel, generator=g) < fraction
    steps = torch.where(torch.rand(numel, generator=g) < far, torch.randint(-3000, 3000, (numel,), generator=g),
                        torch.ones(numel, dtype=torch.long))
    span = 1 << (8 * bits.element_size())
    moved = (bits[picked].to(torch.int64) + steps[picked]) % span
    if bits.dtype != torch.uint8:
        moved = torch.where(moved >= span // 2, moved - span, moved)
    bits[picked] = moved.to(bits.dtype)
    return base, new


def _edges(block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows whose changes sit at block boundaries, with gaps of 255, 256 and more across them."""
    rows = []
    for numel in (block - 1, block, block + 1, 3 * block + 7):
        new = torch.zeros(numel, dtype=torch.bfloat16)
        base = new.clone()
        bits = codec.bits(base)
        for p in (0, 254, 255 + 254, block - 1, block, block + 256, 2 * block + 1, numel - 1):
            if p < numel:
                bits[p] = 1
        rows.append((base, new))
    return rows


def _rows(g) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = [_pair(g, n, dtype, f) for n, dtype, f in (
        (5000, torch.bfloat16, 0.01), (3000, torch.float32, 0.2), (70000, torch.bfloat16, 0.001),
        (4100, torch.uint8, 0.05), (9000, torch.float16, 0.3), (100, torch.bfloat16, 0.9), (0, torch.bfloat16, 0.1),
        (2048, torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.uint8, 0.02))]
    return rows + _edges(TILE) + [_change_edges(BLOCK)]


def _change_edges(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row whose changes cross blocks of ``block`` changes with far gaps and far steps at the edges."""
    positions = list(range(block - 1)) + [block - 1 + 300, block - 1 + 600, block + 601] + \
        [block + 1000 + 3 * k for k in range(block + 5)]
    new = torch.zeros(positions[-1] + 50, dtype=torch.bfloat16)
    base = new.clone()
    bits = codec.bits(base)
    for k, p in enumerate(positions):
        bits[p] = 1 if k % (block // 2) else 2000  # (a far step every half block, at the edges too)
    return base, new


def _on(device: str, rows):
    device = "cpu" if device == "numba" else device
    return [(b.to(device), n.to(device)) for b, n in rows]


@pytest.mark.parametrize("device", DEVICES)
def test_batched_encode_equals_the_torch_codec_and_brings_every_base_to_the_new_bytes(device):
    g = torch.Generator().manual_seed(7)
    rows = _rows(g)
    refs = [codec.encode(base.clone(), new) for base, new in rows]
    bases = _on(device, rows)
    out = _kernel(device).encode_many(bases)
    for (base, new), ref, got in zip(bases, refs, out):
        assert torch.equal(codec.bits(base).cpu(), codec.bits(new).cpu())
        if ref is None:
            assert got.packed is None
            continue
        assert torch.equal(got.packed.cpu(), codec.pack_tensor(ref))
        assert (got.changes, got.change) == (ref.changes, fp64_change(*ref.changed, ref.width))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("room, whole", [(lambda c: c[0] + c[2], [False, True, False]),  # row 1 alone outgrows it
                                         (lambda c: c[1] + 1, [False, False, False])])  # three groups
def test_rows_past_the_staging_go_in_groups_or_whole_and_every_base_still_lands(device, monkeypatch, room, whole):
    if device == "numba":
        pytest.skip("the compiled CPU encoder stages nothing: each row is one pass")
    kernel = _kernel()
    g = torch.Generator().manual_seed(9)
    rows = [_pair(g, 20000, torch.bfloat16, f) for f in (0.001, 0.02, 0.01)]  # ~20, ~400, ~200 changes
    changed = [int((codec.bits(b) != codec.bits(n)).sum()) for b, n in rows]
    monkeypatch.setattr(kernel, "STAGING_MIN", 4 * room(changed))
    monkeypatch.setattr(kernel, "STAGING_SHARE", 1 << 40)
    refs = [codec.encode(base.clone(), new) for base, new in rows]
    bases = _on(device, rows)
    out = kernel.encode_many(bases)
    assert [o.packed is None for o in out] == whole
    assert [o.changes for o in out] == changed
    for (base, new), ref, got in zip(bases, refs, out):
        assert torch.equal(codec.bits(base).cpu(), codec.bits(new).cpu())
        if got.packed is not None:
            assert torch.equal(got.packed.cpu(), codec.pack_tensor(ref))
            assert got.change == fp64_change(*ref.changed, ref.width)


def _packed(rows) -> tuple[torch.Tensor, list[int], list]:
    """Every row's delta packed into one region, 16-byte aligned; the deltas."""
    deltas = [codec.encode(base.clone(), new, whole_if_larger=False) for base, new in rows]
    parts = [codec.pack_tensor(d) for d in deltas]
    starts, at = [], 0
    for p in parts:
        starts.append(at)
        at += -(-p.numel() // 16) * 16
    region = torch.zeros(at + 64, dtype=torch.uint8)
    for s, p in zip(starts, parts):
        region[s:s + p.numel()] = p
    return region, starts, deltas


@pytest.mark.parametrize("device", DEVICES)
def test_batched_apply_lands_every_row_bit_exact_with_the_fingerprint_change(device):
    g = torch.Generator().manual_seed(8)
    rows = [r for r in _rows(g) if r[1].numel()]
    region, starts, deltas = _packed(rows)
    region = _on(device, [(region, region)])[0][0]
    heads = _apply(device).headers(region, starts)
    targets = [t for t, _ in _on(device, [(base.clone(), base) for base, _ in rows])]
    applier = _apply(device).Applier([(region[s:], t, h) for s, t, h in zip(starts, targets, heads)])
    assert applier.check() == [None] * len(rows)
    changes = applier.apply()
    for (_, new), t, d, change in zip(rows, targets, deltas, changes):
        assert torch.equal(codec.bits(t).cpu(), codec.bits(new))
        assert change == fp64_change(*d.changed, d.width)


def _at(region, start, head):
    """Offsets of a packed delta's arrays: gaps, steps, far gaps, far steps."""
    c, fg = head[2], head[3]
    return start + 24, start + 24 + c, start + 24 + 2 * c, start + 24 + 2 * c + 4 * fg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("damage, says", [
    (lambda r, a: r.__setitem__(a[0] + 3, 0), "escaped gaps"),  # a zero gap no far gap stands for
    (lambda r, a: r.__setitem__(a[0] + 3, 255), "outside the row"),  # positions run past the row
    (lambda r, a: r.__setitem__(slice(a[2], a[2] + 4), 0), "a gap below 1"),  # a far gap of 0
    (lambda r, a: r.__setitem__(a[1], 0x80), "escaped steps"),  # an escaped step with no far step
])
def test_malformed_deltas_are_refused_before_any_byte_is_written(device, damage, says):
    g = torch.Generator().manual_seed(9)
    rows = [_pair(g, 70000, torch.bfloat16, 0.004, far=0.0), _pair(g, 5000, torch.bfloat16, 0.01)]
    region, starts, deltas = _packed(rows)
    heads = _apply(device).headers(region, starts)
    assert heads[0][3] > 0  # the first row has far gaps to damage
    damage(region, _at(region, starts[0], heads[0]))
    region = _on(device, [(region, region)])[0][0]
    targets = [t for t, _ in _on(device, [(base.clone(), base) for base, _ in rows])]
    applier = _apply(device).Applier([(region[s:], t, h) for s, t, h in zip(starts, targets, heads)])
    verdicts = applier.check()
    assert verdicts[0] is not None and says in verdicts[0] and verdicts[1] is None
    with pytest.raises(codec.DeltaError):
        applier.apply()
    for (base, _), t in zip(rows, targets):
        assert torch.equal(codec.bits(t).cpu(), codec.bits(base))
