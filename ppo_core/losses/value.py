"""Clipped value (critic) loss."""

from __future__ import annotations

import math

import torch

from ppo_core._checks import (
    check_all_finite,
    check_devices_match,
    check_floating,
    check_mask_deferred,
    check_ndim,
    check_same_shape,
)
from ppo_core.losses.aggregation import _acc_dtype, _aggregate, _check_agg_args
from ppo_core.masked import _mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, pessimistic (OpenAI baselines style), halved.

    ``v_clip = clamp(vpreds, values − c, values + c)``, ``l1 = (vpreds − returns)²``, ``l2 = (v_clip − returns)²``,
    ``loss = ½ · agg_loss(max(l1, l2), response_mask, loss_agg_mode, ...)`` and ``clipfrac = mean([l2 > l1])`` over
    valid tokens, as in verl. Masked entries (``returns`` at padding equal ``values`` after verl's GAE, or
    hold anything) change neither result nor any gradient.

    Args:
        vpreds: ``[B, T]`` current critic predictions (differentiated).
        returns: ``[B, T]`` targets; values: ``[B, T]`` critic values at rollout time (both treated as constants).
        response_mask: ``[B, T]`` bool or 0/1.
        cliprange_value: ``c >= 0`` (verl's critic default 0.5); None disables clipping (``l = l1``).
        loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see
            :func:`ppo_core.losses.agg_loss`.

    Returns:
        ``(loss, clipfrac)``: 0-d tensors (fp32 for half-precision ``vpreds``: computed in fp32); ``clipfrac`` is
        detached.

    Raises:
        ValueError: NaN or inf in ``vpreds``, ``returns`` or (with clipping) ``values`` at a valid position, naming
            the argument (one fused check, one host sync per call); tensors on different devices.

    Example:
        >>> zeros = torch.zeros(1, 2)
        >>> loss, clipfrac = compute_value_loss(torch.tensor([[1.0, 2.0]]), zeros, zeros, torch.ones(1, 2))
        >>> loss  # ½ · mean(max(1, 0.25), max(4, 0.25))
        tensor(1.2500)
    """
    vpreds = check_ndim("vpreds", check_floating("vpreds", vpreds), 2)
    returns = check_floating("returns", returns)
    values = check_floating("values", values)
    check_same_shape(vpreds=vpreds, returns=returns, values=values)
    mask, mask_flag = check_mask_deferred("response_mask", response_mask, like=vpreds, like_name="vpreds")
    check_devices_match(vpreds=vpreds, returns=returns, values=values, response_mask=mask)
    if cliprange_value is not None:
        if isinstance(cliprange_value, bool) or not isinstance(cliprange_value, (int, float)):
            raise TypeError(f"cliprange_value must be a number or None, got {type(cliprange_value).__name__}")
        if not (cliprange_value >= 0 and math.isfinite(cliprange_value)):
            raise ValueError(f"cliprange_value must be a finite number >= 0, got {cliprange_value}")
    agg = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    dtype = _acc_dtype(vpreds.dtype)
    zero = torch.zeros((), dtype=dtype, device=vpreds.device)
    vpreds = torch.where(mask, vpreds.to(dtype), zero)
    returns = torch.where(mask, returns.detach().to(dtype), zero)
    values = torch.where(mask, values.detach().to(dtype), zero)
    named = {"vpreds": vpreds, "returns": returns}
    if cliprange_value is not None:  # without clipping the rollout-time values do not enter the loss
        named["values"] = values
    check_all_finite(
        named,
        purpose="the value loss needs finite inputs where response_mask is 1 (masked positions may hold anything)",
        scope=" valid (response_mask=1)",
        mask_name="response_mask",
        mask_flag=mask_flag,
    )
    loss1 = (vpreds - returns).square()
    if cliprange_value is None:
        per_token, clipped = loss1, torch.zeros_like(mask)
    else:
        vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        loss2 = (vpreds_clipped - returns).square()
        per_token, clipped = torch.maximum(loss1, loss2), loss2 > loss1
    loss = 0.5 * _aggregate(per_token, mask, **agg)  # every input is 0 at masked entries, so per_token is too
    return loss, _mean(clipped.to(dtype), mask).detach()
