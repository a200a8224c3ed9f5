"""Shard moments and their combination against the whole batch: ``masked_var`` / ``masked_whiten`` of the
concatenation, for any cut into shards (empty ones included), NaN padding, and the edge counts 0 and 1."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.masked import masked_mean, masked_var, masked_whiten
from ppo_core.masked_moments import Moments, combine_moments, masked_moments, whiten_with


@st.composite
def sharded(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``[B, T]`` float64 values with NaN where masked, a mask, and cut points splitting the rows into shards."""
    rows = draw(st.integers(min_value=0, max_value=9))
    width = draw(st.integers(min_value=1, max_value=6))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    offset = draw(st.sampled_from([0.0, 7.0]))
    values = offset + scale * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, width, generator=gen) < draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))
    values = values.masked_fill(~mask, float("nan"))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=rows), max_size=4)))
    return values, mask, cuts


def _shards(values: torch.Tensor, mask: torch.Tensor, cuts: list[int]):
    bounds = [0, *cuts, values.shape[0]]
    return [(values[lo:hi], mask[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


@given(sharded())
def test_combined_moments_equal_the_whole_batch(case) -> None:
    values, mask, cuts = case
    whole = combine_moments([masked_moments(v, m) for v, m in _shards(values, mask, cuts)])
    assert whole.count == int(mask.sum())
    scale = float(values[mask].abs().max()) if whole.count else 1.0
    assert whole.mean == pytest.approx(float(masked_mean(values, mask)), rel=1e-12, abs=1e-12 * scale)
    assert whole.var() == pytest.approx(float(masked_var(values, mask)), rel=1e-9, abs=1e-12 * scale**2)
    assert whole.var(unbiased=False) == pytest.approx(
        float(masked_var(values, mask, unbiased=False)), rel=1e-9, abs=1e-12 * scale**2
    )


@given(sharded())
def test_whitening_each_shard_with_the_batch_moments_is_the_batch_whitening(case) -> None:
    values, mask, cuts = case
    parts = _shards(values, mask, cuts)
    moments = combine_moments([masked_moments(v, m) for v, m in parts])
    got = torch.cat([whiten_with(v, m, moments) for v, m in parts]) if parts else values
    want = torch.where(mask, masked_whiten(values, mask), torch.zeros((), dtype=values.dtype))
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))  # exactly 0 where masked (NaN there)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-9, atol=1e-9)


def test_edge_counts() -> None:
    assert masked_moments(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool)) == Moments(
        count=0, mean=0.0, m2=0.0
    )
    assert combine_moments([]) == Moments(count=0, mean=0.0, m2=0.0)
    one = masked_moments(torch.tensor([[5.0, float("inf")]]), torch.tensor([[True, False]]))
    assert one == Moments(count=1, mean=5.0, m2=0.0) and one.var() == 0.0
    # a single valid entry whitens to 0 (never a division by a zero variance), as masked_whiten gives it
    out = whiten_with(torch.tensor([[5.0, 1.0]]), torch.tensor([[True, False]]), one)
    assert torch.equal(out, torch.zeros(1, 2))
    assert whiten_with(torch.ones(2, 2, dtype=torch.float32), torch.ones(2, 2), one).dtype == torch.float32


def test_a_valid_non_finite_value_is_refused() -> None:
    with pytest.raises(ValueError, match="NaN or inf"):
        masked_moments(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, True]]))
