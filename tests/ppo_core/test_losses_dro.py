"""The ``dro`` policy loss against its float64 oracle, with the invariants every policy loss satisfies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import LOSS_AGG_MODES, PolicyLossConfig, compute_policy_loss, dro_policy_loss
from ppo_core.testing import dro_policy_loss_oracle, policy_loss_inputs
from ppo_core.testing.loss_oracles import PolicyLossInputs

BETAS = [0.01, 0.1, 1.0, 5.0]


def _call(inputs: PolicyLossInputs, beta: float, **kwargs):
    config = PolicyLossConfig(loss_mode="dro", dro_beta=beta)
    return compute_policy_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                               config=config, rollout_is_weights=inputs.rollout_is_weights, **kwargs)  # fmt: skip


@st.composite
def agg_kwargs(draw: st.DrawFn, mask: torch.Tensor) -> dict:
    mode = draw(st.sampled_from(LOSS_AGG_MODES))
    kwargs: dict = {"loss_agg_mode": mode}
    if mode == "seq-mean-token-sum-norm":
        kwargs["loss_scale_factor"] = float(draw(st.integers(1, 20)))
    if draw(st.booleans()):
        kwargs |= {
            "dp_size": draw(st.integers(1, 3)),
            "batch_num_tokens": int(mask.sum()) + draw(st.integers(0, 5)),
            "global_batch_size": mask.shape[0] + draw(st.integers(0, 3)),
        }
    return kwargs


@settings(max_examples=50)
@given(data=st.data())
def test_dro_matches_oracle(data):
    inputs = data.draw(policy_loss_inputs())
    beta = data.draw(st.sampled_from(BETAS))
    kwargs = data.draw(agg_kwargs(inputs.response_mask))
    loss, metrics = _call(inputs, beta, **kwargs)
    expected, expected_metrics = dro_policy_loss_oracle(
        inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask, dro_beta=beta,
        rollout_is_weights=inputs.rollout_is_weights, **kwargs,
    )  # fmt: skip
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert math.isclose(float(loss), expected, rel_tol=1e-9, abs_tol=1e-10)
    assert set(metrics) == set(expected_metrics) == {"ppo_kl"}
    assert math.isclose(float(metrics["ppo_kl"]), expected_metrics["ppo_kl"], rel_tol=1e-9, abs_tol=1e-10)


def test_dro_hand_computed_value_and_gradient():
    """L = −A·logp + ½β(logp − old)²; ∇L = −A + βΔ per token, token-mean over 2 tokens."""
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    new = torch.tensor([[-0.5, -2.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    loss, metrics = _call(PolicyLossInputs(old, new, adv, torch.ones(1, 2)), 0.4)
    assert loss.item() == pytest.approx(((2.0 * 0.5 + 0.2 * 0.25) + (-2.5 + 0.2 * 0.25)) / 2)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.allclose(
        grad, torch.tensor([[(-2.0 + 0.4 * 0.5) / 2, (1.0 - 0.4 * 0.5) / 2]], dtype=torch.float64)
    )
    assert metrics["ppo_kl"].item() == pytest.approx(0.0)  # Δ = +0.5 and −0.5


def test_dro_needs_a_positive_beta():
    with pytest.raises(ValueError, match="dro_beta is required"):
        PolicyLossConfig(loss_mode="dro")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="dro_beta"):
            PolicyLossConfig(loss_mode="dro", dro_beta=bad)
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"config\.dro_beta"):
        dro_policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2))  # default config: no beta
    assert PolicyLossConfig.from_dict({"loss_mode": "dro", "dro_beta": 0.5}).dro_beta == 0.5


def _poison(t: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -7.0], dtype=t.dtype)
    return torch.where(mask, t, junk[torch.randint(0, len(junk), t.shape, generator=gen)])


@settings(max_examples=25)
@given(inputs=policy_loss_inputs(), seed=st.integers(0, 2**31 - 1))
def test_padding_values_never_change_loss_metrics_or_gradient(inputs, seed):
    mask = inputs.response_mask
    clean = inputs.log_prob.clone().requires_grad_(True)
    loss, metrics = _call(PolicyLossInputs(**{**vars(inputs), "log_prob": clean}), 0.1)
    (grad,) = torch.autograd.grad(loss, clean)
    gen = torch.Generator().manual_seed(seed)
    weights = inputs.rollout_is_weights
    dirty = PolicyLossInputs(
        old_log_prob=_poison(inputs.old_log_prob, mask, gen),
        log_prob=_poison(inputs.log_prob, mask, gen).requires_grad_(True),
        advantages=_poison(inputs.advantages, mask, gen),
        response_mask=mask,
        rollout_is_weights=None if weights is None else _poison(weights, mask, gen),
    )
    dirty_loss, dirty_metrics = _call(dirty, 0.1)
    (dirty_grad,) = torch.autograd.grad(dirty_loss, dirty.log_prob)
    assert torch.equal(dirty_loss, loss) and torch.equal(dirty_grad, grad)
    assert torch.all(dirty_grad[~mask] == 0)
    assert torch.equal(dirty_metrics["ppo_kl"], metrics["ppo_kl"])


def test_all_masked_batch_gives_zero_loss_and_gradient():
    new = torch.full((3, 4), -1.0, requires_grad=True)
    inputs = PolicyLossInputs(torch.full((3, 4), float("nan")), new, torch.ones(3, 4), torch.zeros(3, 4))
    for mode in LOSS_AGG_MODES:
        loss, metrics = _call(inputs, 0.1, loss_agg_mode=mode, loss_scale_factor=4.0)
        assert loss.item() == 0.0 and metrics["ppo_kl"].item() == 0.0
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.equal(grad, torch.zeros(3, 4))


@settings(max_examples=25)
@given(data=st.data())
def test_micro_batch_losses_sum_to_the_mini_batch_loss(data):
    inputs = data.draw(policy_loss_inputs(max_batch=10))
    mode = data.draw(st.sampled_from(LOSS_AGG_MODES))
    n_rows = inputs.response_mask.shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(n_rows - 1, 1)), max_size=3))) - {n_rows})
    glob = {
        "loss_agg_mode": mode,
        "loss_scale_factor": 16.0 if mode == "seq-mean-token-sum-norm" else None,
        "batch_num_tokens": int(inputs.response_mask.sum()),
        "global_batch_size": n_rows,
    }
    full, _ = _call(inputs, 0.3, **glob)
    total = 0.0
    for start, stop in zip([0, *cuts], [*cuts, n_rows], strict=True):
        part = PolicyLossInputs(**{k: None if v is None else v[start:stop] for k, v in vars(inputs).items()})
        total = total + _call(part, 0.3, **glob)[0]
    assert torch.allclose(torch.as_tensor(total, dtype=full.dtype), full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("delta", [100.0, -100.0])
def test_huge_log_ratio_gives_finite_loss_and_a_restoring_gradient(delta):
    old = torch.full((2, 3), -150.0 if delta > 0 else -0.01)
    new = (old + delta).detach().requires_grad_(True)
    loss, metrics = _call(PolicyLossInputs(old, new, torch.zeros(2, 3), torch.ones(2, 3)), 0.1)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(loss) and torch.isfinite(metrics["ppo_kl"])
    # with A = 0 the gradient is βΔ/n: it pulls log_prob back towards old_log_prob (no clamp cuts it off)
    assert torch.allclose(grad, torch.full((2, 3), 0.1 * delta / 6))


@settings(max_examples=10)
@given(inputs=policy_loss_inputs(max_batch=4, max_len=5), mode=st.sampled_from(LOSS_AGG_MODES))
def test_gradient_matches_finite_differences(inputs, mode):
    def fn(new: torch.Tensor) -> torch.Tensor:
        return _call(PolicyLossInputs(**{**vars(inputs), "log_prob": new}), 0.7, loss_agg_mode=mode,
                     loss_scale_factor=7.0)[0]  # fmt: skip

    assert torch.autograd.gradcheck(fn, (inputs.log_prob.clone().requires_grad_(True),), eps=1e-6, atol=1e-5)


def test_float32_agrees_with_float64():
    gen = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(6, 9, 5, generator=gen, dtype=torch.float64), -1)[..., 0]
    new = (old + 0.05 * torch.randn(6, 9, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=gen) < 0.8
    ref, _ = _call(PolicyLossInputs(old, new, adv, mask), 0.2)
    low, _ = _call(PolicyLossInputs(old.float(), new.float(), adv.float(), mask), 0.2)
    assert low.dtype == torch.float32
    assert math.isclose(float(low), float(ref), rel_tol=1e-5, abs_tol=1e-6)
