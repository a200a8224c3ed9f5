"""Half-precision losses accumulate (and compute) in fp32: fp16 counts overflow above 65504, exp(Δ) above Δ ≈ 11."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    policy_loss_names,
)
from ppo_core.testing import policy_loss_inputs
from ppo_core.testing.loss_oracles import agg_loss_oracle, value_loss_oracle, vanilla_policy_loss_oracle

HALF = [torch.float16, torch.bfloat16]


def test_issue_examples_fp16_token_mean_over_65504_tokens():
    """The two cases of the report: NaN (inf / inf) and exactly 0 (7000 / inf) before the fix."""
    ones = torch.ones(300, 300, dtype=torch.float16)
    assert agg_loss(ones, torch.ones(300, 300, dtype=torch.bool)).item() == 1.0
    tenths = torch.full((280, 250), 0.1, dtype=torch.float16)
    got = agg_loss(tenths, torch.ones(280, 250, dtype=torch.bool))
    assert got.item() == pytest.approx(float(torch.tensor(0.1, dtype=torch.float16)), rel=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_half_matches_the_float64_oracle_on_large_batches(dtype, mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.rand(300, 300, generator=gen).to(dtype)
    mask = torch.rand(300, 300, generator=gen) < 0.9  # ~81000 valid tokens: more than fp16 can count
    factor = 300.0 if mode == "seq-mean-token-sum-norm" else None
    got = agg_loss(loss, mask, mode, loss_scale_factor=factor)
    assert got.dtype == torch.float32, "half-precision losses are returned in their fp32 accumulation dtype"
    expected = agg_loss_oracle(loss, mask, mode, loss_scale_factor=factor)
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", HALF)
def test_agg_loss_half_gradient_reaches_the_input_in_its_dtype(dtype):
    loss = torch.full((280, 250), 0.1, dtype=dtype, requires_grad=True)
    out = agg_loss(loss, torch.ones(280, 250, dtype=torch.bool))
    (grad,) = torch.autograd.grad(out, loss)
    assert grad.dtype == dtype
    assert torch.all(grad > 0), "a zero gradient is what the fp16 overflow used to give"
    assert grad.float().mean().item() == pytest.approx(1 / 70_000, rel=1e-2)


@pytest.mark.parametrize("dtype", HALF)
def test_policy_loss_half_over_65504_tokens_matches_float64(dtype):
    gen = torch.Generator().manual_seed(1)
    shape = (280, 250)
    old = -torch.rand(shape, generator=gen) * 2
    new = old + 0.3 * torch.randn(shape, generator=gen)
    adv = torch.randn(shape, generator=gen)
    mask = torch.ones(shape, dtype=torch.bool)
    half = [t.to(dtype) for t in (old, new, adv)]
    loss, metrics = compute_policy_loss(*half, mask, config=PolicyLossConfig())
    assert loss.dtype == torch.float32 and all(m.dtype == torch.float32 for m in metrics.values())
    # the reference sees exactly the rounded half-precision inputs
    ref = compute_policy_loss(*(t.double() for t in half), mask, config=PolicyLossConfig())[0]
    assert math.isfinite(loss.item()) and loss.item() != 0.0
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("name", [n for n in policy_loss_names() if n != "dro"])
def test_fp16_log_ratio_beyond_11_does_not_overflow(name):
    """exp(12) > 65504: computed in fp16 the ratio was inf, and −A·inf gave inf or NaN."""
    old = torch.full((2, 3), -14.0, dtype=torch.float16)
    new = torch.full((2, 3), -2.0, dtype=torch.float16, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.0], [-0.5, 2.0, 0.0]], dtype=torch.float16)
    config = PolicyLossConfig(loss_mode=name)
    loss, metrics = compute_policy_loss(
        old, new, adv, torch.ones(2, 3), config=config, generator=torch.Generator().manual_seed(0)
    )
    assert torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@settings(max_examples=25)
@given(inputs=policy_loss_inputs(max_batch=6, max_len=10), dtype=st.sampled_from(HALF))
def test_vanilla_half_agrees_with_the_oracle_on_the_rounded_inputs(inputs, dtype):
    half = [t.to(dtype) for t in (inputs.old_log_prob, inputs.log_prob, inputs.advantages)]
    loss, _ = compute_policy_loss(*half, inputs.response_mask, config=PolicyLossConfig())
    expected, _ = vanilla_policy_loss_oracle(*half, inputs.response_mask)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_value_loss_half_over_65504_tokens_matches_the_oracle(dtype):
    gen = torch.Generator().manual_seed(2)
    shape = (300, 300)
    values = torch.randn(shape, generator=gen).to(dtype)
    vpreds = (values.float() + 0.8 * torch.randn(shape, generator=gen)).to(dtype).requires_grad_(True)
    returns = torch.randn(shape, generator=gen).to(dtype)
    mask = torch.rand(shape, generator=gen) < 0.95
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and loss.item() > 0
    expected_loss, expected_clipfrac = value_loss_oracle(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert clipfrac.item() == pytest.approx(expected_clipfrac, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, vpreds)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
