"""How far the rollout engine's probabilities are from the training engine's, on the same sampled tokens.

The rollout engine samples with its own kernels (a KV cache, CUDA graphs, another attention kernel, or another
program altogether such as vLLM); the training engine recomputes the log-probs of the same tokens as
``old_log_probs``. Both are ``log p(token)`` under the same weights at the sampling temperature, so they differ
only by the two engines' numerics, which the PPO ratio silently absorbs when the rollout log-probs stand in for
``old_log_probs``. verl logs the gap as ``training/rollout_probs_diff_{max,mean,std}``; so do we.

Example:
    >>> m = rollout_probs_diff_metrics(torch.log(torch.tensor([[0.5, 0.2]])),
    ...                                torch.log(torch.tensor([[0.4, 0.2]])), torch.tensor([[1, 1]]))
    >>> {k: round(v, 3) for k, v in m.items()}
    {'training/rollout_probs_diff_max': 0.1, 'training/rollout_probs_diff_mean': 0.05, 'training/rollout_probs_diff_std': 0.071}
"""

from __future__ import annotations

import torch

from ppo_core._checks import check_floating, check_mask, check_same_shape

__all__ = ["rollout_probs_diff_metrics"]


def rollout_probs_diff_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Max, mean and (unbiased) standard deviation of ``|exp(rollout_log_probs) - exp(old_log_probs)|`` over the
    valid tokens.

    Args:
        rollout_log_probs: ``[B, R]`` log-probs of the sampled tokens from the rollout engine.
        old_log_probs: ``[B, R]`` log-probs of the same tokens from the training engine.
        response_mask: ``[B, R]`` 1 on valid response tokens (masked positions may hold anything).

    Returns:
        ``training/rollout_probs_diff_max``, ``_mean``, ``_std`` (0.0 when no token is valid; the std is 0.0 with
        fewer than two). Computed in float64.

    Raises:
        ValueError: shapes differ, the mask is not 0/1, or a valid position is not finite (naming the argument).
    """
    check_floating("rollout_log_probs", rollout_log_probs)
    check_floating("old_log_probs", old_log_probs)
    check_same_shape(rollout_log_probs=rollout_log_probs, old_log_probs=old_log_probs)
    mask = check_mask("response_mask", response_mask, like=rollout_log_probs, like_name="rollout_log_probs")
    diff = (rollout_log_probs.double().exp() - old_log_probs.double().exp()).abs()[mask]
    if not bool(torch.isfinite(diff).all()):
        for name, value in (("rollout_log_probs", rollout_log_probs), ("old_log_probs", old_log_probs)):
            if not bool(torch.isfinite(value[mask]).all()):
                raise ValueError(f"{name} is not finite at a valid (response_mask=1) position")
    n = diff.numel()
    if n == 0:
        return {f"training/rollout_probs_diff_{k}": 0.0 for k in ("max", "mean", "std")}
    return {
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if n > 1 else 0.0,
    }
