"""Lossless row deltas (engine/transforms/delta.py): bit-exact over dtypes, sizes and masks, malformed
deltas refused before any byte is written, and about two bytes per one-ulp change."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.engine.transforms import delta as d

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.uint8]


def changed(base: torch.Tensor, seed: int, fraction: float, ulps: int, jumps: float = 0.05) -> torch.Tensor:
    """``base`` with ``fraction`` of its values moved by 1 to ``ulps`` units in the last place (bit
    patterns, either way), ``jumps`` of those by thousands."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    bits = d.bits(new)
    n = bits.numel()
    mask = torch.rand(n, generator=g) < fraction
    step = torch.randint(1, ulps + 1, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    jump = torch.rand(n, generator=g) < jumps
    step = torch.where(jump, torch.randint(1000, 30000, (n,), generator=g), step)
    span = 1 << (8 * new.element_size())
    moved = (bits.to(torch.int64) + step) % span if span <= (1 << 32) else bits.to(torch.int64) + step
    if bits.dtype not in (torch.uint8, torch.int64):
        moved = torch.where(moved >= span // 2, moved - span, moved)
    bits[mask] = moved[mask].to(bits.dtype)
    return new


def random_row(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 5000), seed=st.integers(0, 2**16),
       fraction=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.3, 1.0]), ulps=st.sampled_from([1, 2, 200]))
def test_applied_to_the_base_a_delta_gives_the_new_row_bit_for_bit(dtype, n, seed, fraction, ulps):
    base = random_row(dtype, n, seed)
    new = changed(base, seed + 1, fraction, ulps)
    delta, forced = d.encode(base, new), d.encode(base, new, whole_if_larger=False)
    if delta is None:  # a delta no smaller than the row: the row goes whole
        assert forced.nbytes >= n * base.element_size()
    else:
        assert delta.nbytes < n * base.element_size() and delta.nbytes == forced.nbytes
    target = base.clone()
    d.apply(d.unpack(d.pack(forced)), target)
    assert torch.equal(d.bits(target), d.bits(new))


def test_one_ulp_changes_cost_at_most_three_bytes_each():
    base = random_row(torch.bfloat16, 1 << 20, 0)
    for fraction in (0.01, 0.03):
        delta = d.encode(base, changed(base, 1, fraction, 1))
        assert delta.nbytes / delta.changes <= 3.0, (fraction, delta.nbytes / delta.changes)


def test_an_unchanged_row_is_an_empty_delta_and_a_dense_change_goes_whole():
    base = random_row(torch.bfloat16, 4096, 1)
    empty = d.encode(base, base.clone())
    assert empty is not None and empty.changes == 0 and empty.nbytes == 24
    assert d.encode(base, changed(base, 2, 1.0, 1)) is None


DAMAGES = [
    (lambda x: x.__class__(x.width, x.numel, x.gaps[:-1], x.far_gaps, x.steps, x.far_steps), "positions but"),
    (lambda x: x.__class__(x.width, 10, x.gaps, x.far_gaps, x.steps, x.far_steps), "for a row of"),
    (lambda x: x.__class__(x.width, x.numel, torch.cat([x.gaps, torch.tensor([255] * 40, dtype=torch.uint8)]),
                           x.far_gaps, torch.cat([x.steps, torch.ones(40, dtype=torch.int8)]), x.far_steps),
     "outside the row"),
    (lambda x: x.__class__(x.width, x.numel, torch.zeros_like(x.gaps), x.far_gaps, x.steps, x.far_steps), "escaped gaps"),
    (lambda x: x.__class__(x.width, x.numel, x.gaps, x.far_gaps, torch.full_like(x.steps, -128), x.far_steps),
     "escaped steps"),
]  # (damage to a delta, what its refusal says)


@pytest.mark.parametrize("damage, says", DAMAGES)
def test_a_malformed_delta_is_refused_naming_the_row_before_any_byte_is_written(damage, says):
    base = random_row(torch.bfloat16, 8192, 3)
    delta = d.encode(base, changed(base, 4, 0.01, 1))
    target = base.clone()
    with pytest.raises(d.DeltaError, match=f"layers.0.w: .*{says}"):
        d.apply(damage(delta), target, "layers.0.w")
    assert torch.equal(d.bits(target), d.bits(base))


def test_a_gap_below_one_would_write_a_position_twice_and_is_refused():
    base = random_row(torch.float32, 100_000, 5)
    new = base.clone()
    new[[7, 90_000]] += 1.0  # the second is far: an escaped gap
    delta = d.encode(base, new)
    assert delta.far_gaps.numel() == 1  # (the first gap, 8, fits a byte; the second, 89,993, escapes)
    bad = d.Delta(delta.width, delta.numel, delta.gaps, torch.zeros_like(delta.far_gaps), delta.steps, delta.far_steps)
    with pytest.raises(d.DeltaError, match="strictly increasing"):
        d.apply(bad, base.clone(), "norm")


@pytest.mark.parametrize("data, says", [(b"\0" * 10, "shorter than"), (b"\0" * 24, "not a delta")])
def test_bytes_that_are_not_a_delta_are_refused(data, says):
    with pytest.raises(d.DeltaError, match=says):
        d.unpack(data, "embed")


def test_a_truncated_delta_is_refused():
    base = random_row(torch.bfloat16, 8192, 6)
    packed = d.pack(d.encode(base, changed(base, 7, 0.02, 1)))
    with pytest.raises(d.DeltaError, match="the header says"):
        d.unpack(packed[:-1], "embed")
