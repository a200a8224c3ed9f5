"""The ``ppo_kl`` metric averages the log-ratio the loss uses: clamped to ±20 wherever the loss clamps it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import LOG_RATIO_CLAMP, PolicyLossConfig, compute_policy_loss, policy_loss_names
from ppo_core.testing import policy_loss_inputs
from ppo_core.testing.loss_oracles import vanilla_policy_loss_oracle

CLAMPING = sorted(set(policy_loss_names()) - {"dro"})


def _call(name, old, new, adv, mask):
    config = PolicyLossConfig(loss_mode=name, dro_beta=0.1 if name == "dro" else None)
    return compute_policy_loss(old, new, adv, mask, config=config, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", CLAMPING)
def test_log_ratio_beyond_20_reports_the_clamped_mean(name):
    """Δ = 30 and Δ = 0: the losses see Δ = 20 and 0, so the metric is −10 (it used to be the unclamped −15)."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[30.0, 0.0]], dtype=torch.float64)
    _, metrics = _call(name, old, new, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert metrics["ppo_kl"].item() == -10.0
    _, metrics = _call(name, new, old, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert metrics["ppo_kl"].item() == 10.0


def test_dro_does_not_clamp_its_log_ratio_and_neither_does_its_metric():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[30.0, 0.0]], dtype=torch.float64)
    _, metrics = _call("dro", old, new, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert metrics["ppo_kl"].item() == -15.0


@pytest.mark.parametrize("name", CLAMPING)
@settings(max_examples=20)
@given(inputs=policy_loss_inputs(), shift=st.sampled_from([0.0, 25.0, -40.0]))
def test_ppo_kl_is_the_masked_mean_of_the_clamped_negative_log_ratio(name, inputs, shift):
    new = inputs.log_prob + shift * inputs.response_mask  # pushes valid log-ratios past the clamp
    _, metrics = _call(name, inputs.old_log_prob, new, inputs.advantages, inputs.response_mask)
    mask = inputs.response_mask
    delta = (new - inputs.old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    expected = (-delta)[mask].sum() / max(int(mask.sum()), 1)
    assert metrics["ppo_kl"].item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)


def test_vanilla_oracle_agrees_beyond_the_clamp():
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[25.0, -30.0, 0.1], [0.0, 50.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, metrics = compute_policy_loss(old, new, adv, mask, config=PolicyLossConfig())
    _, expected = vanilla_policy_loss_oracle(old, new, adv, mask)
    assert metrics["ppo_kl"].item() == pytest.approx(expected["ppo_kl"], rel=1e-12)
    assert expected["ppo_kl"] == pytest.approx(-(20 - 20 + 0.1 + 0 + 20) / 5)
