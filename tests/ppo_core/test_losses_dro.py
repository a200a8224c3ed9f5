"""What is particular to ``dro``: its value and gradient by hand, the required β, the unclamped restoring gradient.

The oracle comparison and the invariants every policy loss satisfies run in ``test_losses_policy.py``.
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.losses import PolicyLossConfig, compute_policy_loss, dro_policy_loss
from ppo_core.testing.loss_oracles import PolicyLossInputs


def _call(inputs: PolicyLossInputs, beta: float, **kwargs):
    config = PolicyLossConfig(loss_mode="dro", dro_beta=beta)
    return compute_policy_loss(inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask,
                               config=config, rollout_is_weights=inputs.rollout_is_weights, **kwargs)  # fmt: skip


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


@pytest.mark.parametrize("delta", [100.0, -100.0])
def test_huge_log_ratio_gives_finite_loss_and_a_restoring_gradient(delta):
    old = torch.full((2, 3), -150.0 if delta > 0 else -0.01)
    new = (old + delta).detach().requires_grad_(True)
    loss, metrics = _call(PolicyLossInputs(old, new, torch.zeros(2, 3), torch.ones(2, 3)), 0.1)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(loss) and torch.isfinite(metrics["ppo_kl"])
    # with A = 0 the gradient is βΔ/n: it pulls log_prob back towards old_log_prob (no clamp cuts it off)
    assert torch.allclose(grad, torch.full((2, 3), 0.1 * delta / 6))
