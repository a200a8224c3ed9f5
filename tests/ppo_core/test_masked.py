"""Masked statistics against a float64 loop reference: dims, empty and single-entry masks, NaN padding, whitening."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _constant import FLOAT_DTYPES, constant_cases
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.masked import WHITEN_EPS, masked_mean, masked_sum, masked_var, masked_whiten


@st.composite
def masked_cases(draw: st.DrawFn) -> dict:
    """Values of 1-3 dims (sizes 0..5) with NaN/inf in masked slots, a mask of any density, a ``dim``."""
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=3)))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    offset = draw(st.sampled_from([0.0, 5.0]))
    values = (offset + scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    mask = torch.rand(shape, generator=gen) < density
    junk = draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
    if junk is not None:
        values = values.masked_fill(~mask, junk)
    mask_kind = draw(st.sampled_from(["bool", "int", "float"]))
    mask_in = {"bool": mask, "int": mask.long(), "float": mask.to(dtype)}[mask_kind]
    ndim = len(shape)
    dim_choice = draw(
        st.one_of(
            st.none(),
            st.integers(min_value=-ndim, max_value=ndim - 1),
            st.lists(
                st.integers(min_value=0, max_value=ndim - 1), min_size=1, max_size=ndim, unique=True
            ).map(tuple),
        )
    )
    return {"values": values, "mask": mask, "mask_in": mask_in, "dim": dim_choice, "scale": scale}


def _reference(values: torch.Tensor, mask: torch.Tensor, dim, stat) -> np.ndarray:
    """Apply ``stat`` (a function of a Python list of valid floats) over ``dim`` in float64 with plain loops."""
    v = values.double().numpy()
    m = mask.numpy()
    ndim = v.ndim
    dims = (
        tuple(range(ndim))
        if dim is None
        else tuple(d % ndim for d in ((dim,) if isinstance(dim, int) else dim))
    )
    keep = [d for d in range(ndim) if d not in dims]
    out_shape = tuple(v.shape[d] for d in keep)
    n_reduced = math.prod(v.shape[d] for d in dims)
    v = np.transpose(v, keep + list(dims)).reshape(*out_shape, n_reduced)
    m = np.transpose(m, keep + list(dims)).reshape(*out_shape, n_reduced)
    out = np.zeros(out_shape)
    for idx in np.ndindex(*out_shape):
        out[idx] = stat([float(x) for x, keep_x in zip(v[idx], m[idx], strict=True) if keep_x])
    return out


def _sum(xs: list[float]) -> float:
    return math.fsum(xs)


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def _var(unbiased: bool):
    def stat(xs: list[float]) -> float:
        n = len(xs)
        denom = n - 1 if unbiased else n
        if denom <= 0:
            return 0.0
        mu = math.fsum(xs) / n
        return math.fsum((x - mu) ** 2 for x in xs) / denom

    return stat


def _close(
    got: torch.Tensor, expected: np.ndarray, values: torch.Tensor, scale: float, power: int = 1
) -> None:
    rtol = 1e-4 if values.dtype == torch.float32 else 1e-10
    atol = rtol * (scale + 5.0) ** power
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=rtol, atol=atol)


@given(masked_cases())
def test_sum_and_mean_match_reference(case: dict) -> None:
    values, mask, dim = case["values"], case["mask"], case["dim"]
    got_sum = masked_sum(values, case["mask_in"], dim=dim)
    got_mean = masked_mean(values, case["mask_in"], dim=dim)
    assert got_sum.dtype == values.dtype and torch.isfinite(got_mean).all()
    # a length-5 float32 sum carries rounding error of the order of its terms
    _close(got_sum, _reference(values, mask, dim, _sum), values, case["scale"])
    _close(got_mean, _reference(values, mask, dim, _mean), values, case["scale"])


@given(masked_cases(), st.booleans())
def test_var_matches_reference(case: dict, unbiased: bool) -> None:
    values, mask, dim = case["values"], case["mask"], case["dim"]
    got = masked_var(values, case["mask_in"], unbiased=unbiased, dim=dim)
    assert torch.isfinite(got).all() and bool((got >= 0).all())
    _close(got, _reference(values, mask, dim, _var(unbiased)), values, case["scale"], power=2)


@given(masked_cases(), st.booleans())
def test_whiten_has_mean_zero_and_unit_variance_on_the_mask(case: dict, shift_mean: bool) -> None:
    values, mask = case["values"], case["mask"]
    out = masked_whiten(values, case["mask_in"], shift_mean=shift_mean)
    assert out.shape == values.shape and out.dtype == values.dtype
    valid = values.double()[mask].tolist()
    got = out.double()[mask]
    assert torch.isfinite(got).all()
    mu, var = _mean(valid), _var(True)(valid)
    shift = 0.0 if shift_mean else mu
    expected = torch.tensor(
        [(x - mu) / math.sqrt(var + WHITEN_EPS) + shift for x in valid], dtype=torch.float64
    )
    tol = 1e-4 if values.dtype == torch.float32 else 1e-9
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * (1 + abs(mu)))
    if len(valid) >= 2 and var > 1e-4:
        assert _mean(got.tolist()) == pytest.approx(0.0 if shift_mean else mu, abs=tol * 10 * (1 + abs(mu)))
        assert _var(True)(got.tolist()) == pytest.approx(1.0, rel=1e-3)


@given(masked_cases())
def test_padding_values_never_reach_valid_outputs(case: dict) -> None:
    values, mask, dim = case["values"], case["mask_in"], case["dim"]
    other = case["values"].masked_fill(~case["mask"], 123.0)
    for fn in (masked_sum, masked_mean, masked_var):
        torch.testing.assert_close(fn(values, mask, dim=dim), fn(other, mask, dim=dim))
    torch.testing.assert_close(
        masked_whiten(values, mask)[case["mask"]], masked_whiten(other, mask)[case["mask"]]
    )


def test_zero_and_one_valid_elements() -> None:
    values = torch.tensor([[3.0, float("nan"), 1.0], [4.0, 7.0, float("inf")]])
    mask = torch.tensor([[0, 0, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([0.0, 4.0]))
    torch.testing.assert_close(masked_sum(values, mask, dim=-1), torch.tensor([0.0, 4.0]))
    torch.testing.assert_close(masked_var(values, mask, dim=-1), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(masked_var(values, mask, unbiased=False, dim=-1), torch.tensor([0.0, 0.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    assert masked_var(values, torch.zeros_like(mask)).item() == 0.0
    # one valid entry: whitened to exactly 0 there (no NaN); no valid entry: finite wherever the values are
    assert masked_whiten(values, mask)[1, 0].item() == 0.0
    empty = masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))
    assert torch.isfinite(empty).all()


def test_documented_examples() -> None:
    assert masked_sum(torch.tensor([[1.0, 2.0, float("nan")]]), torch.tensor([[1, 1, 0]])).item() == 3.0
    torch.testing.assert_close(
        masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0]]), dim=-1),
        torch.tensor([2.0, 0.0]),
    )
    assert masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0])).item() == 1.0
    out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]]))
    torch.testing.assert_close(out[0, :3], torch.tensor([-1.0, 0.0, 1.0]), rtol=0, atol=1e-6)


def test_bad_arguments_name_the_argument() -> None:
    values = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask"):
        masked_mean(values, torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        masked_sum(values, torch.full((2, 3), 0.5))
    with pytest.raises(TypeError, match="values"):
        masked_var(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(TypeError, match="values"):
        masked_whiten([[1.0]], torch.ones(1, 1))


def test_fp16_mean_over_many_tokens() -> None:
    # Counts and sums accumulate in fp32: an fp16 count above 65504 would overflow to inf.
    values = torch.full((70_000,), 0.01, dtype=torch.float16)
    mask = torch.ones(70_000, dtype=torch.bool)
    mean = masked_mean(values, mask)
    assert mean.dtype == torch.float16
    assert mean.item() == pytest.approx(0.01, rel=1e-2)
    assert masked_var(values, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_bf16_whiten_over_many_tokens_has_unit_variance() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5_000, generator=gen).to(torch.bfloat16)
    mask = torch.ones(5_000, dtype=torch.bool)
    out = masked_whiten(values, mask).float()
    assert out.mean().item() == pytest.approx(0.0, abs=2e-2)
    assert out.var().item() == pytest.approx(1.0, rel=2e-2)


@given(constant_cases(min_dims=1, max_dims=3, max_size=6), st.sampled_from([float("nan"), float("inf"), 3.0]))
def test_constant_valid_values_whiten_to_exactly_zero(
    case: tuple[torch.Tensor, torch.Tensor], junk: float
) -> None:
    # The float32 mean of equal values is in general not that value (their sum rounds): centred about that mean,
    # whitening multiplied an ulp by rsqrt(1e-8) = 1e4. Centred about a valid value first, each difference is 0.
    values, mask = case
    values = values.masked_fill(~mask, junk)
    out = masked_whiten(values, mask)
    assert out.dtype == values.dtype
    assert torch.equal(out[mask], torch.zeros_like(out[mask])), out[mask]
    # scale only: the true mean, the value itself, comes back
    assert torch.equal(masked_whiten(values, mask, shift_mean=False)[mask], values[mask])
    assert masked_var(values, mask).item() == 0.0


@given(st.data(), st.sampled_from(FLOAT_DTYPES))
def test_constant_slices_have_variance_exactly_zero(data: st.DataObject, dtype: torch.dtype) -> None:
    """Reduced over ``dim``, each slice has its own constant and its own first valid entry."""
    shape = tuple(data.draw(st.lists(st.integers(min_value=1, max_value=5), min_size=2, max_size=3)))
    dims = data.draw(
        st.lists(st.integers(min_value=0, max_value=len(shape) - 1), min_size=1, unique=True).map(tuple)
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(min_value=0, max_value=2**31 - 1)))
    per_slice = [1 if d in dims else n for d, n in enumerate(shape)]
    scale = data.draw(st.sampled_from([1e-3, 1.0, 1e4]))
    values = (scale * (1 + torch.rand(per_slice, generator=gen, dtype=torch.float64))).to(dtype).expand(shape)
    mask = torch.rand(shape, generator=gen) < 0.7
    got = masked_var(values.masked_fill(~mask, float("nan")), mask, dim=dims)
    assert torch.equal(got, torch.zeros_like(got)), got


def test_large_common_offset_keeps_float32_precision() -> None:
    """``1e4`` plus noise of ``1e-2``: a float32 sum of the raw values (``3e6``, an ulp of 0.25) puts an error of
    about ``1e-3`` in the mean, ``0.1`` once divided by the spread; centred about a valid value first, the offset
    goes exactly (the difference of two floats within a factor of two is exact) before anything is summed."""
    gen = torch.Generator().manual_seed(0)
    values = (1e4 + 1e-2 * torch.randn(8, 50, generator=gen, dtype=torch.float64)).float()
    mask = torch.rand(8, 50, generator=gen) < 0.8
    valid = values.double()[mask].tolist()
    mu, var = _mean(valid), _var(True)(valid)
    expected = torch.tensor([(x - mu) / math.sqrt(var + WHITEN_EPS) for x in valid], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(values, mask).double()[mask], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        masked_var(values, mask).double(), torch.tensor(var, dtype=torch.float64), rtol=1e-5, atol=0
    )


@given(
    st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=2, max_size=12),
    st.floats(1e36, 3.4e38),
)
def test_float32_values_near_the_largest_give_the_float64_statistics(unit: list[float], scale: float) -> None:
    """Finite float32 values whose sums or squares overflow float32: the statistics are computed again in float64
    (no silent NaN, inf or zeros), then rounded to float32; a NaN at a valid entry still raises."""
    x = (torch.tensor(unit, dtype=torch.float64) * scale).to(torch.float32)[None]
    mask = torch.ones_like(x, dtype=torch.bool)
    wide = x.double()
    # float32 rounds terms of size `scale` (a mean may cancel to far less than its terms)
    tolerance = {"atol": 1e-6 * scale, "rtol": 1e-5}
    torch.testing.assert_close(masked_mean(x, mask), masked_mean(wide, mask).float(), **tolerance)
    var = masked_var(x, mask)  # inf where the float64 variance is beyond float32's range
    assert not torch.isnan(var)
    torch.testing.assert_close(var, masked_var(wide, mask).float(), rtol=1e-4, atol=0.0)
    whitened = masked_whiten(x, mask)
    torch.testing.assert_close(whitened, masked_whiten(wide, mask).float(), atol=1e-4, rtol=1e-4)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"values contains NaN at 1 valid \(mask=1\) position"):
        masked_whiten(x, mask)


def test_float64_overflow_is_named() -> None:
    x = torch.tensor([1.7e308, -1.7e308, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="overflow float64"):
        masked_var(x, torch.ones(3, dtype=torch.bool))
