"""The compiled CPU deltas (engine/transforms/delta_cpu.py) against the torch codec they stand in for:
the same delta bytes, the same bases, the same fingerprint changes, the same refusals, bit for bit."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_delta import DAMAGES, DTYPES, changed, random_row

from weightsync.engine.datapath.checksums import fp64, fp64_change
from weightsync.engine.transforms import delta as d

k = pytest.importorskip("weightsync.engine.transforms.delta_cpu")
if k._kernels() is None:
    pytest.skip("numba is not installed", allow_module_level=True)

MASK = (1 << 64) - 1


def fingerprint(t: torch.Tensor) -> int:
    return fp64(t.reshape(-1).view(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), seed=st.integers(0, 2**16),
       fraction=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.3, 1.0]), ulps=st.sampled_from([1, 2, 200]),
       skew=st.integers(0, 7))
def test_advance_gives_the_torch_delta_and_the_fingerprint_change_bit_for_bit(dtype, n, seed, fraction, ulps, skew):
    width = torch.empty(0, dtype=dtype).element_size()
    skew = skew // width * width  # (rows start anywhere a value may: off the 8-byte words the kernel compares)
    room = torch.zeros(n * width + skew, dtype=torch.uint8)
    base = room[skew:].view(dtype)
    base.copy_(random_row(dtype, n, seed))
    new = changed(base, seed + 1, fraction, ulps)
    reference, before = d.encode(base, new), fingerprint(base)
    got, change = k.advance(base, new)
    assert torch.equal(d.bits(base), d.bits(new))  # (the base took the new row, delta or not)
    if reference is None:
        assert got is None
        return
    assert got is not None and d.pack(got) == d.pack(reference)
    assert (before + change) & MASK == fingerprint(new)
    assert change == fp64_change(*reference.changed, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skew", [0, 1])
def test_rows_of_many_chunks_of_words_encode_as_the_torch_codec_does(dtype, skew):
    """Rows longer than the words the kernel compares a pass (``CHUNK_WORDS``), changed at the first and
    last values of each chunk, of the words beside them and after the last whole word, and here and
    there between: the same delta and fingerprint change as the torch codec; a row off the 8-byte words
    (``skew``: compared value by value) too."""
    kernels = k._kernels()
    width = torch.empty(0, dtype=dtype).element_size()
    per, chunk = 8 // width, kernels.CHUNK_WORDS
    n = (3 * chunk + 5) * per + per - 1  # (three chunks and a part, then values after the last whole word)
    room = torch.zeros(n * width + skew * width, dtype=torch.uint8)
    base = room[skew * width:].view(dtype)
    base.copy_(random_row(dtype, n, 7))
    new = changed(base, 8, 0.002, 2)
    bits = d.bits(new)
    for edge in (1, 2, 3):
        for at in (edge * chunk * per - 1, edge * chunk * per, edge * chunk * per + per - 1, n - 1, 0):
            bits[at] = d.bits(base)[at] ^ 1
    reference, before = d.encode(base, new), fingerprint(base)
    got, change = k.advance(base, new)
    assert reference is not None and got is not None and d.pack(got) == d.pack(reference)
    assert (before + change) & MASK == fingerprint(new) and torch.equal(d.bits(base), d.bits(new))


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), seed=st.integers(0, 2**16),
       fraction=st.sampled_from([0.001, 0.03, 0.3]), ulps=st.sampled_from([1, 200]))
def test_apply_and_undo_match_the_torch_apply(dtype, n, seed, fraction, ulps):
    base = random_row(dtype, n, seed)
    new = changed(base, seed + 1, fraction, ulps)
    delta = d.unpack(d.pack(d.encode(base, new, whole_if_larger=False)))
    ours, theirs = base.clone(), base.clone()
    change = k.apply(delta, ours, "w")
    expected = fp64_change(*d.apply(delta, theirs, "w"), delta.width)
    assert torch.equal(d.bits(ours), d.bits(new)) and torch.equal(d.bits(ours), d.bits(theirs))
    assert change == expected
    assert (k.apply(delta, ours, "w", undo=True) + change) & MASK == 0
    assert torch.equal(d.bits(ours), d.bits(base))


def test_a_row_whose_delta_would_not_be_smaller_goes_whole_and_the_base_still_takes_it():
    base = random_row(torch.bfloat16, 4096, 1)
    new = changed(base, 2, 1.0, 1)
    assert k.advance(base, new)[0] is None and torch.equal(d.bits(base), d.bits(new))


@pytest.mark.parametrize("damage, says", DAMAGES + [
    (lambda x: x.__class__(x.width, x.numel, x.gaps, torch.zeros_like(x.far_gaps), x.steps, x.far_steps),
     "strictly increasing"),
])
def test_a_malformed_delta_is_refused_with_the_torch_error_before_any_byte_is_written(damage, says):
    base = random_row(torch.bfloat16, 100_000, 3)
    new = changed(base, 4, 0.01, 1)
    new[-1] = 1.0  # (and one far change: an escaped gap to damage)
    delta = d.encode(base, new)
    assert delta.far_gaps.numel()
    target = base.clone()
    with pytest.raises(d.DeltaError, match=f"layers.0.w: .*{says}"):
        k.apply(damage(delta), target, "layers.0.w")
    assert torch.equal(d.bits(target), d.bits(base))


def test_cpu_rows_take_the_kernels_and_others_do_not():
    assert k.usable(torch.zeros(4), torch.zeros(4))
    assert not k.usable(torch.zeros(4), torch.zeros(4, device="meta"))


def _skewed(dtype: torch.dtype, n: int, seed: int, skew: int) -> torch.Tensor:
    """A random row of ``n`` values starting ``skew`` values into its memory (off 8-byte words)."""
    width = torch.empty(0, dtype=dtype).element_size()
    room = torch.zeros((n + skew) * width, dtype=torch.uint8)
    row = room[skew * width:].view(dtype)
    row.copy_(random_row(dtype, n, seed))
    return row


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 3000), st.integers(0, 2**16),
                               st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]), st.sampled_from([1, 200]),
                               st.integers(0, 3)), min_size=1, max_size=8))
def test_a_batch_encodes_each_row_as_advance_does_one_by_one_and_applies_back_bit_for_bit(rows):
    bases, news, olds = [], [], []
    for dtype, n, seed, fraction, ulps, skew in rows:
        base = _skewed(dtype, n, seed, skew)
        bases.append(base)
        olds.append(base.clone())
        news.append(changed(base, seed + 1, fraction, ulps))
    singles = [k.advance(old.clone(), new) for old, new in zip(olds, news)]
    batch = k.encode_many(list(zip(bases, news)))
    for base, new, (delta, change), got in zip(bases, news, singles, batch):
        assert torch.equal(d.bits(base), d.bits(new))  # (every base took its new row, delta or not)
        assert (got.packed is None) == (delta is None)
        if delta is not None:
            assert bytes(got.packed.numpy()) == d.pack(delta)
            assert (got.changes, got.change) == (delta.changes, change)
    sent = [(got, old, new) for got, old, new in zip(batch, olds, news) if got.packed is not None]
    if not sent:
        return
    targets = [old.clone() for _, old, _ in sent]
    items = [(got.packed, t, k.headers(got.packed, [0])[0]) for (got, _, _), t in zip(sent, targets)]
    applier = k.Applier(items, concurrent.futures.ThreadPoolExecutor(3), threads=3)
    assert applier.check() == [None] * len(items)
    assert applier.apply() == [got.change for got, _, _ in sent]
    for t, (_, _, new) in zip(targets, sent):
        assert torch.equal(d.bits(t), d.bits(new))
    assert all((c + got.change) & MASK == 0 for c, (got, _, _) in zip(applier.apply(undo=True), sent))
    for t, (_, old, _) in zip(targets, sent):
        assert torch.equal(d.bits(t), d.bits(old))


def test_an_applier_refuses_to_apply_before_every_delta_checked_good():
    base = random_row(torch.bfloat16, 5000, 5)
    new = changed(base, 6, 0.01, 1)
    packed = k.encode_many([(base.clone(), new)])[0].packed
    bad = packed.clone()
    bad[24 + 3] = 0  # (a zero gap no far gap stands for)
    target = base.clone()
    applier = k.Applier([(bad, target, k.headers(bad, [0])[0]), (packed, base.clone(), k.headers(packed, [0])[0])])
    with pytest.raises(d.DeltaError, match="apply before a check"):
        applier.apply()
    assert "escaped gaps" in applier.check()[0] and applier.check()[1] is None
    with pytest.raises(d.DeltaError, match="apply before a check"):
        applier.apply()
    assert torch.equal(d.bits(target), d.bits(base))


def test_a_batch_refuses_rows_it_cannot_take_naming_them():
    with pytest.raises(d.DeltaError, match="differ"):
        k.encode_many([(torch.zeros(4), torch.zeros(5))])
    with pytest.raises(d.DeltaError, match="not contiguous"):
        k.encode_many([(torch.zeros(8), torch.zeros(4, 2).t())])
