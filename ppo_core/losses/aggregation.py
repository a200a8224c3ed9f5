"""Loss aggregation: reduce a per-token loss matrix ``[B, T]`` to the scalar that is back-propagated.

Notation: ``S_i = Σ_t loss[i, t]·mask[i, t]`` (row sum), ``n_i = Σ_t mask[i, t]`` (valid tokens of row ``i``),
``v_i = [n_i > 0]`` (row has a valid token), ``dp = dp_size``.

=========================== ============================================================================
mode                        loss
=========================== ============================================================================
``token-mean``              ``Σ_i S_i / N · dp``, ``N = batch_num_tokens`` (default: ``Σ n_i`` of this call)
``token-sum``               ``Σ_i S_i · dp``
``seq-mean-token-sum``      ``Σ_i S_i / G · dp``, ``G = global_batch_size`` (default: ``Σ v_i`` of this call)
``seq-mean-token-mean``     ``Σ_i v_i · S_i / n_i / G · dp``
``seq-mean-token-sum-norm`` ``Σ_i S_i / G · dp / loss_scale_factor`` (``loss_scale_factor`` is required)
=========================== ============================================================================

Micro-batching: pass the *global* denominators of the mini-batch (``batch_num_tokens`` = Σ mask over
the whole mini-batch on all data-parallel ranks, ``global_batch_size`` = its number of rows on all ranks, and
``dp_size``); then the losses of the micro-batches of one rank sum to that rank's share, and the data-parallel
gradient *average* times ``dp`` gives the gradient of the whole-mini-batch loss. ``global_batch_size`` counts every
row, all-masked ones included; the local default counts only rows with a valid token (as verl does).

Deviations from verl (see ``docs/semantics.md``):

- all-masked input never gives NaN: every denominator is clamped to at least 1, so the loss is exactly
  0 and its gradient is finite (zero);
- ``seq-mean-token-mean`` divides by ``n_i`` exactly (verl adds 1e-8);
- ``seq-mean-token-sum-norm`` without ``loss_scale_factor`` raises ``ValueError``: verl then divides by
  the padded width ``T`` of the tensor, so the loss would depend on padding and on how micro-batches are padded;
- half-precision input is summed and counted in fp32 and the result is fp32 (in fp16 a count above 65504 is inf);
- NaN/inf at a valid entry raises ``ValueError`` naming ``loss_mat`` (verl returns NaN).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import torch

from ppo_core._checks import (
    check_all_finite,
    check_devices_match,
    check_floating,
    check_mask_deferred,
    check_ndim,
)

__all__ = ["LOSS_AGG_MODES", "LossAggMode", "agg_loss"]

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""The valid values of ``loss_agg_mode`` (the annotation of the config fields that hold one)."""

LOSS_AGG_MODES: tuple[str, ...] = typing.get_args(LossAggMode)
"""The valid values of ``loss_agg_mode``."""

Number = int | float | torch.Tensor


def _check_loss_agg_mode(loss_agg_mode: object) -> str:
    """Return ``loss_agg_mode`` if valid, else raise ``ValueError`` listing :data:`LOSS_AGG_MODES`."""
    if not isinstance(loss_agg_mode, str) or loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid values: {', '.join(LOSS_AGG_MODES)}"
        )
    return loss_agg_mode


def _check_count(name: str, value: Number | None, *, positive: bool = False) -> Number | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or a 0-d tensor, got {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a single number, got shape {tuple(value.shape)}")
        return value.reshape(())
    bad = value <= 0 if positive else value < 0
    if bad or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _check_agg_args(
    loss_agg_mode: object,
    dp_size: object,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: float | None,
) -> dict[str, Any]:
    """Validate the aggregation arguments (no host sync); return them as keywords of :func:`_aggregate`."""
    mode = _check_loss_agg_mode(loss_agg_mode)
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    batch_num_tokens = _check_count("batch_num_tokens", batch_num_tokens)
    global_batch_size = _check_count("global_batch_size", global_batch_size)
    if mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        raise ValueError(
            "loss_scale_factor is required for loss_agg_mode='seq-mean-token-sum-norm' (e.g. the maximum response "
            "length); verl's fallback to the padded width makes the loss depend on padding"
        )
    if mode == "token-mean" and batch_num_tokens is None and dp_size > 1:
        raise ValueError("batch_num_tokens is required for loss_agg_mode='token-mean' when dp_size > 1")
    if mode.startswith("seq-mean") and global_batch_size is None and dp_size > 1:
        raise ValueError(f"global_batch_size is required for loss_agg_mode={mode!r} when dp_size > 1")
    return {
        "loss_agg_mode": mode,
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": _check_count("loss_scale_factor", loss_scale_factor, positive=True),
    }


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses are computed and returned in: fp32 for half precision (fp16 counts overflow above 65504)."""
    return torch.promote_types(dtype, torch.float32)


def _denominator(given: Number | None, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``given`` (global) or ``local`` as a tensor of ``like``'s dtype, clamped to >= 1 so 0/0 becomes 0/1."""
    denom = local if given is None else torch.as_tensor(given, device=like.device)
    return denom.to(like.dtype).clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: Number | None = None,
    global_batch_size: Number | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar, ignoring masked entries (whatever they hold, NaN included).

    Args:
        loss_mat: ``[B, T]`` floating per-token loss.
        loss_mask: ``[B, T]`` bool or 0/1 mask of the tokens that count, on ``loss_mat``'s device.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (table in the module docstring).
        dp_size: number of data-parallel ranks whose gradients are averaged (the loss is multiplied by it).
        batch_num_tokens: global number of valid tokens (``token-mean``); required when ``dp_size > 1``.
            Ignored by the other modes.
        global_batch_size: global number of rows (``seq-mean-*``); required when ``dp_size > 1``. Ignored by the
            token modes.
        loss_scale_factor: constant divisor of ``seq-mean-token-sum-norm`` (e.g. the maximum response length, as in
            Dr.GRPO); required by that mode and ignored by the others.

    The global counts may be Python numbers (checked to be finite and >= 0) or 0-d tensors, e.g. the result of an
    all-reduce (not range-checked, which would synchronise the device).

    Returns:
        0-d tensor of ``loss_mat``'s dtype, or fp32 for half-precision input (sums and counts accumulate in fp32:
        in fp16 a count above 65504 is inf). Exactly 0, with a zero gradient, when nothing is valid.

    Raises:
        ValueError: NaN or inf in ``loss_mat`` at a valid position (one fused check, one host sync per call),
            a mask that is not 0/1, a mask on another device, or an invalid aggregation argument.

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
        >>> mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
        >>> agg_loss(loss, mask, "token-mean")
        tensor(3.5000)
        >>> agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=10)
        tensor(4.2000)
    """
    loss_mat = check_ndim("loss_mat", check_floating("loss_mat", loss_mat), 2)
    mask, mask_flag = check_mask_deferred("loss_mask", loss_mask, like=loss_mat, like_name="loss_mat")
    check_devices_match(loss_mat=loss_mat, loss_mask=mask)
    agg = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    loss_mat = loss_mat.to(_acc_dtype(loss_mat.dtype))
    # torch.where (not a product) so that NaN/inf at masked entries give neither a NaN value nor a NaN gradient.
    masked = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    check_all_finite(
        {"loss_mat": masked},
        purpose="the loss must be finite where loss_mask is 1 (masked positions may hold anything)",
        scope=" valid (loss_mask=1)",
        mask_name="loss_mask",
        mask_flag=mask_flag,
    )
    return _aggregate(masked, mask, **agg)


def _aggregate(
    masked: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    dp_size: int,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None,
) -> torch.Tensor:
    """:func:`agg_loss` of a ``[B, T]`` loss that is already 0 at masked entries, arguments already validated.

    No check and no host sync: the policy and value losses validate their inputs once and aggregate here.
    """
    row_sum = masked.sum(dim=-1)
    row_count = mask.sum(dim=-1)
    mode = loss_agg_mode
    if mode == "token-sum":
        return row_sum.sum() * dp_size
    if mode == "token-mean":
        return row_sum.sum() / _denominator(batch_num_tokens, row_count.sum(), masked) * dp_size
    n_seqs = _denominator(global_batch_size, (row_count > 0).sum(), masked)
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / row_count.to(masked.dtype).clamp(min=1)
    loss = row_sum.sum() / n_seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / loss_scale_factor
    return loss
