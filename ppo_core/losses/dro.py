"""Policy gradient with a quadratic log-ratio penalty (``dro``), after Direct Reward Optimisation."""

from __future__ import annotations

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss

__all__ = ["dro_policy_loss"]


@_policy_loss("dro")
def dro_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with a quadratic penalty on the log-ratio ``Δ = log_prob − old_log_prob``, with ``β = dro_beta``::

        L = −A·log_prob + ½·β·Δ²        (× rollout_is_weights) → agg_loss

    so ``∇L = −(A − β·Δ)·∇log_prob``: the policy gradient of Direct Reward Optimisation (Richemond et al. 2024,
    arXiv 2405.19107) with the old policy as the reference, the penalty pulling ``log_prob`` back towards
    ``old_log_prob`` in proportion to how far it moved. ``Δ`` is not clamped: nothing is exponentiated, and a
    clamp would remove the restoring gradient exactly where the policy moved furthest. Metrics: ``ppo_kl`` (the
    mean of ``−Δ``, unclamped like the loss).

    ``config.dro_beta`` (β > 0) is required: the default ``PolicyLossConfig()`` has none and raises ``ValueError``.

    Example:
        >>> from ppo_core.losses import PolicyLossConfig
        >>> old = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> new = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> loss, m = dro_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2),
        ...                           config=PolicyLossConfig(loss_mode="dro", dro_beta=0.1))
        >>> round(loss.item(), 4)  # (log 2 + log 4 + 0.05·(log 2)²) / 2
        1.0517
    """
    beta = inp.config.dro_beta
    if beta is None:
        raise ValueError("the dro loss needs config.dro_beta (a number > 0); PolicyLossConfig() has none")
    log_ratio = inp.new - inp.old
    per_token = -inp.adv * inp.new + 0.5 * beta * log_ratio.square()
    return inp.aggregate(per_token), {"ppo_kl": inp.ppo_kl(log_ratio)}
