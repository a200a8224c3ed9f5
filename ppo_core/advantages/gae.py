"""Generalised advantage estimation (Schulman et al., 2016) over masked, possibly multi-turn responses."""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_same_shape
from ppo_core.advantages._common import (
    REWARDS,
    check_finite,
    check_rewards_and_mask,
    check_rewards_and_mask_unsynced,
    check_scalar,
    no_grad,
)
from ppo_core.kernels.dispatch import _gae_checked, flags_set

__all__ = ["compute_gae"]


@no_grad
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets, skipping masked tokens as verl does.

    Backwards over the valid tokens of each row (``nextv`` and ``lastgae`` start at 0, so the last valid token is
    treated as terminal)::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where ``V_next``/``A_next`` belong to the next *valid* token: a run of masked tokens inside a response
    (multi-turn observation tokens) costs exactly one ``gamma`` (and one ``gamma * lam``) step, whatever its
    length, as in verl. ``returns = A_raw + V``; ``advantages = masked_whiten(A_raw)`` over all valid tokens
    of the batch when ``whiten``.

    Semantics pinned by tests (see ``docs/semantics.md``):

    - rewards and values on masked positions are ignored, even NaN/inf (a reward placed on a masked
      token is dropped, as in verl; put outcome rewards on a valid token);
    - both outputs are exactly 0 on masked positions (deviation from verl, which leaves whitened padding and
      ``returns = V`` there, so every consumer has to mask);
    - 0 or 1 valid tokens in the batch: the whitened advantages are 0, never NaN (verl raises ``ValueError``);
    - NaN/inf in ``rewards`` or ``values`` on a valid token raises ``ValueError`` naming the argument.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        values: ``[B, T]`` floating critic values ``V_t``.
        response_mask: ``[B, T]`` bool or 0/1 mask of the tokens the policy produced.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.
        whiten: normalise the advantages to mean 0 / variance 1 over the valid tokens.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the promoted dtype of ``rewards`` and ``values``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0]])
        >>> v = torch.tensor([[0.5, 0.5, 0.5]])
        >>> adv, ret = compute_gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False)
        >>> ret
        tensor([[1., 1., 1.]])
    """
    rewards, mask, mask_flag = check_rewards_and_mask_unsynced(rewards, response_mask)
    values = check_floating("values", values)
    check_same_shape(rewards=rewards, values=values)
    if values.device != rewards.device:
        raise ValueError(
            f"values is on {values.device} but {REWARDS} is on {rewards.device}; they must match"
        )
    gamma = check_scalar("gamma", gamma, 0.0, 1.0)
    lam = check_scalar("lam", lam, 0.0, 1.0)
    # The scan zeroes masked positions and flags NaN/inf it reads at valid ones: one host sync, no extra pass.
    # (On CUDA the whitening statistics come from the scan too: one more kernel normalises.)
    advantages, returns, maybe_nonfinite = _gae_checked(
        rewards, values, mask, gamma, lam, whiten=bool(whiten)
    )
    if flags_set(maybe_nonfinite, mask_flag):
        check_rewards_and_mask(rewards, response_mask)
        check_finite(REWARDS, rewards, mask)
        check_finite("values", values, mask)
    return advantages, returns
