"""Entropy bonus: the aggregated per-token entropy of the policy (subtract ``coef · loss`` from the actor loss)."""

from __future__ import annotations

import torch

from ppo_core._checks import check_devices_match, check_floating, check_mask_deferred, check_mask_flag
from ppo_core.logprobs import entropy_from_logits
from ppo_core.losses.aggregation import _aggregate, _check_agg_args

__all__ = ["compute_entropy_loss"]


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """``agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, ...)``.

    The entropy is computed at every position without copying the ``[B, T, V]`` logits (memory-aware, see
    :mod:`ppo_core.logprobs`); masked positions change neither the value nor any gradient as long as their logits
    are finite (``-inf`` vocabulary entries are fine: 0·log 0 = 0). A position whose logits hold NaN or ``+inf``,
    or are all ``-inf``, raises ``ValueError`` (from :func:`~ppo_core.logprobs.entropy_from_logits`), masked or not.
    Unlike verl's ``compute_entropy_loss``, the global-denominator keywords are accepted, so micro-batch
    losses sum to the mini-batch loss.

    Args:
        logits: ``[B, T, V]`` floating logits of the response tokens.
        response_mask: ``[B, T]`` bool or 0/1.
        loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see
            :func:`ppo_core.losses.agg_loss`.

    Returns:
        0-d tensor (fp32 for half-precision logits), differentiable w.r.t. ``logits``.

    Example:
        >>> compute_entropy_loss(torch.zeros(1, 2, 4), torch.ones(1, 2))  # uniform over 4 tokens: log 4
        tensor(1.3863)
    """
    logits = check_floating("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    mask, mask_flag = check_mask_deferred(
        "response_mask", response_mask, like=logits[..., 0], like_name="logits[..., 0]"
    )
    check_devices_match(logits=logits, response_mask=mask)
    agg = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    check_mask_flag("response_mask", mask_flag)
    entropy = entropy_from_logits(logits)  # raises on non-finite logits: no second check needed
    return _aggregate(torch.where(mask, entropy, torch.zeros_like(entropy)), mask, **agg)
