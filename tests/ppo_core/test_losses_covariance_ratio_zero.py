"""clip_cov and kl_cov with ``clip_cov_ratio = 0`` / ``kl_cov_ratio = 0``: the covariance rule is off, so no token
is detached or penalised and the loss is the plain surrogate. verl still selects ``max(int(0 · n), 1) = 1`` token.
"""

from __future__ import annotations

import pytest
import torch

from ppo_core.losses import PolicyLossConfig, clip_cov_policy_loss, kl_cov_policy_loss


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of three tokens, every log-ratio well inside the default clip range ``[0.8, 1.2]``."""
    old = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.1]], dtype=torch.float64))
    delta = torch.tensor([[0.05, -0.03, 0.02], [-0.04, 0.01, 0.06]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 1.5, 2.0]], dtype=torch.float64)
    return old, old + delta, adv, torch.ones(2, 3), delta


def test_clip_cov_with_ratio_zero_detaches_nothing() -> None:
    old, new, adv, mask, delta = _inputs()
    new = new.requires_grad_(True)
    wide = {"clip_cov_lb": -100.0, "clip_cov_ub": 100.0}  # every token is a candidate
    loss, metrics = clip_cov_policy_loss(old, new, adv, mask, config=PolicyLossConfig(clip_cov_ratio=0.0, **wide),
                                         loss_agg_mode="token-sum", generator=torch.Generator().manual_seed(0))  # fmt: skip
    r = delta.exp()
    assert loss.item() == pytest.approx((-adv * r).sum().item())  # the unclipped surrogate, summed
    assert metrics["pg_clipfrac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, -adv * r)  # every token keeps its gradient
    # with a positive ratio the rule is on: k = max(int(0.1 · 6), 1) = 1 token of 6 is detached
    _, on = clip_cov_policy_loss(old, new.detach(), adv, mask, config=PolicyLossConfig(clip_cov_ratio=0.1, **wide),
                                 loss_agg_mode="token-sum", generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert on["pg_clipfrac"].item() == pytest.approx(1 / 6)


def test_kl_cov_with_ratio_zero_penalises_nothing() -> None:
    old, new, adv, mask, delta = _inputs()
    surrogate = (-adv * delta.exp()).sum().item()
    off, _ = kl_cov_policy_loss(old, new, adv, mask, config=PolicyLossConfig(kl_cov_ratio=0.0),
                                loss_agg_mode="token-sum")  # fmt: skip
    assert off.item() == pytest.approx(surrogate)
    # with a positive ratio one token (k = max(int(0.2 · 6), 1) = 1) pays ppo_kl_coef · |Δ| > 0 on top
    on, _ = kl_cov_policy_loss(old, new, adv, mask, config=PolicyLossConfig(kl_cov_ratio=0.2),
                               loss_agg_mode="token-sum")  # fmt: skip
    penalties = [0.1 * abs(d) for d in delta.flatten().tolist()]
    assert any(on.item() == pytest.approx(surrogate + p) for p in penalties)
