"""compute_value_loss and compute_entropy_loss against their loop oracles, plus edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import LOSS_AGG_MODES, compute_entropy_loss, compute_value_loss
from ppo_core.testing import response_masks
from ppo_core.testing.loss_oracles import entropy_loss_oracle, value_loss_oracle


def test_value_loss_reference_example():
    vpreds = torch.tensor([[1.0, 2.0]], requires_grad=True)
    zeros = torch.zeros(1, 2)
    c = 0.5
    # token t: l1 = (v − R)², l2 = (clip(v, V − c, V + c) − R)² = c²; loss = ½ · mean(max(l1, l2))
    l1, l2 = [1.0, 4.0], [c**2, c**2]
    expected = 0.5 * sum(max(a, b) for a, b in zip(l1, l2, strict=True)) / 2
    assert expected == 1.25
    loss, clipfrac = compute_value_loss(vpreds, zeros, zeros, torch.ones(1, 2), cliprange_value=c)
    assert loss.item() == pytest.approx(expected)
    assert clipfrac.item() == 0.0  # l2 > l1 nowhere: the pessimistic max keeps the unclipped loss
    # gradient ½ · 2(v − R) / 2 tokens
    assert torch.autograd.grad(loss, vpreds)[0].tolist()[0] == pytest.approx([0.5, 1.0])


def test_value_loss_clipped_branch_has_zero_gradient():
    # V = 0, R = 3, v = 1, c = 0.5: l1 = (1 − 3)² = 4 < l2 = (0.5 − 3)² = 6.25, so the constant clipped branch wins
    vpreds = torch.tensor([[1.0]], requires_grad=True)
    loss, clipfrac = compute_value_loss(vpreds, torch.tensor([[3.0]]), torch.zeros(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.5 * (0.5 - 3.0) ** 2)
    assert clipfrac.item() == 1.0
    assert torch.autograd.grad(loss, vpreds)[0].item() == 0.0


@st.composite
def value_batches(draw: st.DrawFn):
    """``(vpreds, returns, values, mask)``: returns equal values at padding, as after GAE."""
    mask = draw(response_masks(max_batch=6, max_len=10))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    returns = torch.where(mask, values + torch.randn(mask.shape, generator=gen, dtype=torch.float64), values)
    vpreds = values + draw(st.sampled_from([0.1, 0.5, 2.0])) * torch.randn(
        mask.shape, generator=gen, dtype=torch.float64
    )
    return vpreds, returns, values, mask


@settings(max_examples=100)
@given(
    value_batches(),
    st.sampled_from(LOSS_AGG_MODES),
    st.sampled_from([None, 0.0, 0.2, 0.5, 10.0]),
    st.booleans(),
)
def test_value_loss_matches_oracle(batch, mode, cliprange, global_info):
    vpreds, returns, values, mask = batch
    kwargs: dict = {"loss_scale_factor": 9.0} if mode == "seq-mean-token-sum-norm" else {}
    if global_info:
        kwargs |= {
            "dp_size": 2,
            "batch_num_tokens": int(mask.sum()) + 3,
            "global_batch_size": mask.shape[0] + 1,
        }
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange, mode, **kwargs)
    expected, expected_clipfrac = value_loss_oracle(
        vpreds, returns, values, mask, cliprange, loss_agg_mode=mode, **kwargs
    )
    assert math.isclose(loss.item(), expected, rel_tol=1e-10, abs_tol=1e-12)
    assert math.isclose(clipfrac.item(), expected_clipfrac, rel_tol=1e-12, abs_tol=1e-12)
    assert not clipfrac.requires_grad


@settings(max_examples=50)
@given(value_batches(), st.integers(0, 2**31 - 1))
def test_value_loss_ignores_padding_values_nan_included(batch, seed):
    vpreds, returns, values, mask = batch
    vpreds = vpreds.clone().requires_grad_(True)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask)
    (grad,) = torch.autograd.grad(loss, vpreds)
    gen = torch.Generator().manual_seed(seed)

    def poison(t):
        junk = torch.tensor([float("nan"), float("inf"), -1e30], dtype=t.dtype)
        return torch.where(mask, t, junk[torch.randint(0, 3, t.shape, generator=gen)])

    dirty_v = poison(vpreds.detach()).requires_grad_(True)
    dirty, dirty_clipfrac = compute_value_loss(dirty_v, poison(returns), poison(values), mask)
    assert torch.equal(dirty, loss) and torch.equal(dirty_clipfrac, clipfrac)
    assert torch.equal(torch.autograd.grad(dirty, dirty_v)[0], grad)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_all_masked_is_zero(mode):
    vpreds = torch.full((2, 3), float("nan"), requires_grad=True)
    factor = 3.0 if mode == "seq-mean-token-sum-norm" else None
    loss, clipfrac = compute_value_loss(vpreds, vpreds.detach(), vpreds.detach(), torch.zeros(2, 3),
                                        loss_agg_mode=mode, loss_scale_factor=factor)  # fmt: skip
    assert loss.item() == 0.0 and clipfrac.item() == 0.0
    assert torch.equal(torch.autograd.grad(loss, vpreds)[0], torch.zeros(2, 3))


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"vpreds": torch.zeros(2, 4)}, ValueError, "vpreds"),
        ({"returns": torch.zeros(2, 3, dtype=torch.int64)}, TypeError, "returns"),
        ({"values": "0"}, TypeError, "values"),
        ({"response_mask": torch.ones(3, 3)}, ValueError, "response_mask"),
        ({"cliprange_value": -0.1}, ValueError, "cliprange_value"),
        ({"cliprange_value": "0.5"}, TypeError, "cliprange_value"),
        ({"loss_agg_mode": "mean"}, ValueError, "loss_agg_mode"),
    ],
)
def test_value_loss_bad_inputs_name_the_argument(kwargs, exc, name):
    args = {"vpreds": torch.zeros(2, 3), "returns": torch.zeros(2, 3), "values": torch.zeros(2, 3),
            "response_mask": torch.ones(2, 3)} | kwargs  # fmt: skip
    with pytest.raises(exc, match=name):
        compute_value_loss(**args)


@st.composite
def logits_and_mask(draw: st.DrawFn):
    mask = draw(response_masks(max_batch=5, max_len=6))
    vocab = draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = 3 * torch.randn(*mask.shape, vocab, generator=gen, dtype=torch.float64)
    if vocab > 1 and draw(st.booleans()):  # masked vocabulary entries, never a whole row
        banned = torch.rand(logits.shape, generator=gen) < 0.3
        banned[..., 0] = False
        logits = logits.masked_fill(banned, -math.inf)
    return logits, mask


@settings(max_examples=100)
@given(logits_and_mask(), st.sampled_from(LOSS_AGG_MODES))
def test_entropy_loss_matches_oracle(data, mode):
    logits, mask = data
    factor = 5.0 if mode == "seq-mean-token-sum-norm" else None
    loss = compute_entropy_loss(logits, mask, mode, loss_scale_factor=factor)
    expected = entropy_loss_oracle(logits, mask, loss_agg_mode=mode, loss_scale_factor=factor)
    assert math.isclose(loss.item(), expected, rel_tol=1e-10, abs_tol=1e-12)


def test_entropy_loss_of_uniform_logits_is_log_vocab_and_padding_gets_no_gradient():
    logits = torch.zeros(2, 3, 4, dtype=torch.float64)
    logits[1, 2] = torch.tensor([50.0, -20.0, 3.0, 1e4])  # finite garbage at a masked position
    logits.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = compute_entropy_loss(logits, mask)
    assert loss.item() == pytest.approx(math.log(4))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(grad[1, 2], torch.zeros(4, dtype=torch.float64))


def test_entropy_loss_non_finite_logits_raise_even_when_masked():
    logits = torch.zeros(1, 2, 3)
    logits[0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        compute_entropy_loss(logits, torch.tensor([[1, 0]]))


def test_entropy_loss_bad_inputs():
    with pytest.raises(ValueError, match="logits"):
        compute_entropy_loss(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="response_mask"):
        compute_entropy_loss(torch.zeros(2, 3, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_entropy_loss(torch.zeros(2, 3, 4), torch.ones(2, 3), "sum")
