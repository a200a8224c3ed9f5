"""Critic-free estimators built on per-token reward-to-go: REINFORCE++ and ReMax."""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_ndim
from ppo_core.advantages._common import (
    REWARDS,
    check_finite,
    check_rewards_and_mask,
    check_rewards_and_mask_unsynced,
    check_scalar,
    no_grad,
)
from ppo_core.kernels.dispatch import _return_advantages_checked, flags_set

__all__ = ["compute_reinforce_pp_advantage", "compute_remax_advantage", "reinforce_pp_returns"]


@no_grad
def compute_reinforce_pp_advantage(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted reward-to-go, whitened over the valid tokens of the batch.

    ``G_t = r_t + gamma * G_next`` over the valid tokens of each row (a masked run costs one ``gamma`` step and
    its rewards are dropped, as in verl); ``advantages = masked_whiten(G)``, ``returns = G``.

    ``gamma`` is an explicit argument (verl reads ``config.gamma`` and ignores the ``gamma`` passed to its
    dispatcher). Both outputs are 0 on masked tokens; with 0 or 1 valid tokens in the batch the advantages are
    0 (verl's whitening raises ``ValueError``). NaN/inf rewards on valid tokens raise ``ValueError``.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
        >>> adv, ret = compute_reinforce_pp_advantage(r, m, gamma=1.0)
        >>> ret[0]
        tensor([1., 1., 1., 0.])
    """
    rewards, mask, mask_flag = check_rewards_and_mask_unsynced(rewards, response_mask)
    gamma = check_scalar("gamma", gamma, 0.0, 1.0)
    advantages, returns, maybe_nonfinite = _return_advantages_checked(rewards, mask, gamma, whiten=True)
    if flags_set(maybe_nonfinite, mask_flag):
        check_rewards_and_mask(rewards, response_mask)
        check_finite(REWARDS, rewards, mask)
    return advantages, returns


@no_grad
def reinforce_pp_returns(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++'s ``returns`` ``G`` ``[B, T]`` before the whitening (:func:`compute_reinforce_pp_advantage`'s
    scan, the same checks): each row's ``G`` depends on that row only, so a data-parallel holder of some rows
    computes them and whitens with the batch's moments (:mod:`ppo_core.masked_moments`).

    Example:
        >>> reinforce_pp_returns(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), gamma=0.5)
        tensor([[0.5000, 1.0000]])
    """
    rewards, mask, mask_flag = check_rewards_and_mask_unsynced(rewards, response_mask)
    gamma = check_scalar("gamma", gamma, 0.0, 1.0)
    _, returns, maybe_nonfinite = _return_advantages_checked(rewards, mask, gamma)
    if flags_set(maybe_nonfinite, mask_flag):
        check_rewards_and_mask(rewards, response_mask)
        check_finite(REWARDS, rewards, mask)
    return returns


@no_grad
def compute_remax_advantage(
    rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023): undiscounted reward-to-go minus the greedy rollout's reward.

    ``G_t = sum of r_k over valid k >= t``; ``advantages = G_t - b_i`` on valid tokens, ``returns = G``. No
    whitening. Rewards on masked tokens are dropped (as in verl). Both outputs are 0 on masked tokens (verl leaves
    ``G_t`` there).

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        reward_baselines: ``[B]`` floating baseline per row (reward of the greedy response to the same prompt).
        response_mask: ``[B, T]`` bool or 0/1 mask.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the promoted dtype of ``rewards`` and ``reward_baselines``.

    Example:
        >>> adv, ret = compute_remax_advantage(torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]), torch.ones(1, 2))
        >>> adv
        tensor([[0.7500, 0.7500]])
    """
    rewards, mask, mask_flag = check_rewards_and_mask_unsynced(rewards, response_mask)
    baselines = check_ndim("reward_baselines", check_floating("reward_baselines", reward_baselines), 1)
    if baselines.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"reward_baselines has shape {tuple(baselines.shape)} but {REWARDS} has {rewards.shape[0]} rows; "
            "it must be [B]"
        )
    if baselines.device != rewards.device:
        raise ValueError(f"reward_baselines is on {baselines.device} but {REWARDS} is on {rewards.device}")
    dtype = torch.promote_types(rewards.dtype, baselines.dtype)
    # the scan subtracts the baselines and flags a non-finite one of a row with a valid token (the others are unused)
    advantages, returns, maybe_nonfinite = _return_advantages_checked(
        rewards if rewards.dtype == dtype else rewards.to(dtype),
        mask,
        1.0,
        baselines=baselines if baselines.dtype == dtype else baselines.to(dtype),
    )
    if flags_set(maybe_nonfinite, mask_flag):
        check_rewards_and_mask(rewards, response_mask)
        check_finite(REWARDS, rewards, mask)
        check_finite("reward_baselines", baselines, mask.any(dim=-1))
    return advantages, returns
