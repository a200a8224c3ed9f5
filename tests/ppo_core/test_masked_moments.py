"""Shard moments and their combination against the whole batch: ``masked_var`` / ``masked_whiten`` of the
concatenation, for any cut into shards (empty ones included), NaN padding, and the edge counts 0 and 1."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from _constant import constant_cases
from hypothesis import given
from hypothesis import strategies as st

import ppo_core.masked_moments as masked_moments_module
from ppo_core.kernels.whiten import whiten_valid
from ppo_core.masked import masked_mean, masked_var, masked_whiten
from ppo_core.masked_moments import (
    Moments,
    combine_moments,
    masked_moments,
    reduce_row_moments,
    row_moments,
    whiten_with,
)


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


@st.composite
def split_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """``[B, T]`` float32 or float64 values, 0 where masked (as the estimators whiten them), cut points splitting
    the rows into contiguous blocks, and the elements per chunk of the elementwise passes."""
    rows = draw(st.integers(min_value=1, max_value=9))
    width = draw(st.sampled_from([1, 3, 6, 17, 1500, 2100]))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    offset = draw(st.sampled_from([0.0, 1e4]))
    values = (offset + scale * torch.randn(rows, width, generator=gen, dtype=torch.float64)).to(dtype)
    mask = torch.rand(rows, width, generator=gen) < draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))
    values = torch.where(mask, values, torch.zeros((), dtype=dtype))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=rows), max_size=4)))
    return values, mask, cuts, draw(st.sampled_from([1, 64, 1 << 22]))


@given(split_rows())
def test_whitening_by_blocks_of_rows_is_the_whole_batch_whitening_bit_for_bit(case) -> None:
    """What a data-parallel step does (each rank's row partials, reduced on the controller, each rank whitening its
    rows) gives the estimators' whitening of the whole batch, bit for bit, for any cut into contiguous blocks."""
    values, mask, cuts, chunk = case
    want = whiten_valid(values, mask)
    with mock.patch.object(masked_moments_module, "_CHUNK_ELEMENTS", chunk):
        parts = _shards(values, mask, cuts)
        moments = reduce_row_moments([row_moments(v, m) for v, m in parts])
        got = torch.cat([whiten_with(v, m, moments) for v, m in parts])
    assert got.dtype == values.dtype
    assert torch.equal(got, want)
    # the moments are the batch's, within float64 rounding
    whole = masked_moments(values, mask)
    assert moments.count == whole.count
    spread = max(whole.var(), 1.0)
    assert moments.mean == pytest.approx(whole.mean, rel=1e-12, abs=1e-12 * spread)
    assert moments.var() == pytest.approx(whole.var(), rel=1e-9, abs=1e-12 * spread)


@given(case=constant_cases(dtypes=[torch.float32, torch.float64]))
def test_row_moments_of_constant_values_are_exact(case) -> None:
    values, mask = case
    moments = reduce_row_moments([row_moments(values, mask)])
    assert moments.mean == float(values[mask][0]) and moments.m2 == 0.0
    assert torch.equal(whiten_valid(values, mask), torch.zeros_like(values))


def test_row_moments_edge_cases() -> None:
    empty = row_moments(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))
    assert reduce_row_moments([empty]) == Moments(count=0, mean=0.0, m2=0.0)
    assert reduce_row_moments([]) == Moments(count=0, mean=0.0, m2=0.0)
    # masked NaN never enters; a valid one is refused
    nan = torch.tensor([[5.0, float("nan")], [float("inf"), 7.0]])
    got = reduce_row_moments([row_moments(nan, torch.tensor([[True, False], [False, True]]))])
    assert got == Moments(count=2, mean=6.0, m2=2.0)
    with pytest.raises(ValueError, match="NaN or inf"):
        row_moments(nan, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[b, T\]"):
        row_moments(torch.zeros(3), torch.ones(3, dtype=torch.bool))


@given(
    rows=st.integers(0, 5),
    width=st.integers(0, 2 * masked_moments_module.ROW_BLOCK + 3),
    seed=st.integers(0, 2**16),
)
def test_row_sums_are_the_rows_sums_and_a_rows_bits_its_own(rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64) * 1e3
    sums = masked_moments_module.row_sums(x)
    assert sums.shape == (rows,) and sums.dtype == torch.float64
    torch.testing.assert_close(sums, x.sum(dim=-1), rtol=1e-12, atol=1e-9)
    for i in range(rows):  # each row alone, or any run of rows, gives the same bits
        assert torch.equal(masked_moments_module.row_sums(x[i : i + 1]), sums[i : i + 1])
    assert torch.equal(masked_moments_module.row_sums(x[1:]), sums[1:])
