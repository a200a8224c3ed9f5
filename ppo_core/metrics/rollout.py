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

import math
from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_mask, check_same_shape
from ppo_core.masked_moments import Moments, combine_moments, masked_moments

__all__ = ["reduce_rollout_probs_diff", "rollout_probs_diff_metrics", "rollout_probs_diff_parts"]


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
    diff = _valid_diffs(rollout_log_probs, old_log_probs, response_mask)
    n = diff.numel()
    if n == 0:
        return {f"training/rollout_probs_diff_{k}": 0.0 for k in ("max", "mean", "std")}
    return {
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if n > 1 else 0.0,
    }


def _valid_diffs(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``|exp(rollout) - exp(old)|`` in float64 at the valid tokens (1-D), checked as the metrics need."""
    check_floating("rollout_log_probs", rollout_log_probs)
    check_floating("old_log_probs", old_log_probs)
    check_same_shape(rollout_log_probs=rollout_log_probs, old_log_probs=old_log_probs)
    mask = check_mask("response_mask", response_mask, like=rollout_log_probs, like_name="rollout_log_probs")
    diff = (rollout_log_probs.double().exp() - old_log_probs.double().exp()).abs()[mask]
    if not bool(torch.isfinite(diff).all()):
        for name, value in (("rollout_log_probs", rollout_log_probs), ("old_log_probs", old_log_probs)):
            if not bool(torch.isfinite(value[mask]).all()):
                raise ValueError(f"{name} is not finite at a valid (response_mask=1) position")
    return diff


def rollout_probs_diff_parts(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[Moments, float]:
    """One shard's part of :func:`rollout_probs_diff_metrics` (``[b, R]`` in): the :class:`Moments` of its valid
    differences and their maximum (0.0 without one); :func:`reduce_rollout_probs_diff` combines the shards'."""
    diff = _valid_diffs(rollout_log_probs, old_log_probs, response_mask)
    moments = masked_moments(diff, torch.ones_like(diff, dtype=torch.bool))
    return moments, float(diff.max()) if diff.numel() else 0.0


def reduce_rollout_probs_diff(parts: Sequence[tuple[Moments, float]]) -> dict[str, float]:
    """:func:`rollout_probs_diff_metrics` of the batch the ``parts`` were cut from (mean and std within 1e-12
    relative: float64 sums in another order; the maximum exactly).

    Example:
        >>> r, o, m = torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.4, 0.2]])), torch.ones(1, 2)
        >>> whole = rollout_probs_diff_metrics(r, o, m)
        >>> cut = reduce_rollout_probs_diff([rollout_probs_diff_parts(r[:, :1], o[:, :1], m[:, :1]),
        ...                                  rollout_probs_diff_parts(r[:, 1:], o[:, 1:], m[:, 1:])])
        >>> {k: round(v, 12) for k, v in cut.items()} == {k: round(v, 12) for k, v in whole.items()}
        True
    """
    whole = combine_moments([p[0] for p in parts])
    held = [p[1] for p in parts if p[0].count]
    return {
        "training/rollout_probs_diff_max": max(held) if held else 0.0,
        "training/rollout_probs_diff_mean": whole.mean if whole.count else 0.0,
        "training/rollout_probs_diff_std": math.sqrt(whole.var()) if whole.count > 1 else 0.0,
    }
