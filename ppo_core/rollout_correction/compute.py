"""``compute_rollout_correction``: truncated importance weights and rejection of the tokens or responses whose
rollout probabilities are too far from the training forward's (verl's ``rollout_corr_helper`` semantics).

Notation: ``log r_t = old_log_probs_t - rollout_log_probs_t`` (training over rollout policy) at every valid token;
``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r``. Everything is computed in log space and ``log r``
(or a row's sum of it) is clamped to ``[-20, 20]`` (:data:`~ppo_core.losses.LOG_RATIO_CLAMP`) before any ``exp``,
so weights and statistics stay within ``[exp(-20), exp(20)]`` and never overflow, in float32 at least.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

from ppo_core._checks import (
    check_all_finite,
    check_devices_match,
    check_floating,
    check_mask_deferred,
    check_ndim,
    check_same_shape,
)
from ppo_core.losses._common import LOG_RATIO_CLAMP
from ppo_core.masked_moments import row_sums
from ppo_core.rollout_correction import metrics as M
from ppo_core.rollout_correction.config import RejectionBound, RolloutCorrectionConfig
from ppo_core.rollout_correction.metrics import Part
from ppo_core.rollout_correction.partial import (
    CorrectionParts,
    ExactSum,
    normalize_weights,
    reduce_correction_parts,
)

__all__ = ["compute_rollout_correction"]

_FINITE = (
    "rollout correction needs finite log-probs where response_mask is 1 (masked positions may hold anything)"
)


def _row_statistic(kind: str, token_stat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` sum, mean or max of a per-token statistic over each row's valid tokens (0 for an empty row)."""
    if kind == "seq_sum":
        return token_stat.sum(dim=-1)
    if kind == "seq_mean":
        return token_stat.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    if token_stat.shape[-1] == 0:  # (max over an empty dimension raises)
        return token_stat.sum(dim=-1)
    lowest = torch.full((), -math.inf, dtype=token_stat.dtype, device=token_stat.device)
    peak = torch.where(mask, token_stat, lowest).max(dim=-1).values
    return torch.where(mask.any(dim=-1), peak, torch.zeros_like(peak))


def _rejection(
    bounds: tuple[RejectionBound, ...], log_ratio: torch.Tensor, mask: torch.Tensor, with_parts: bool
) -> tuple[torch.Tensor, dict[str, Part]]:
    """``[B, T]`` bool: every filter accepts the token (a row filter accepts all tokens of a row or none); and the
    filters' metric partials (with ``with_parts``)."""
    safe = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1 - safe}  # all 0 at masked positions
    accepted = torch.ones_like(mask)
    parts: dict[str, Part] = {}
    for bound in bounds:
        kind, _, estimator = bound.option.rpartition("_")
        token_stat, row_stat = stats[estimator], None
        if kind != "token":
            row_stat = _row_statistic(kind, token_stat, mask)
            token_stat = row_stat[:, None].expand_as(mask)
        ok = token_stat <= bound.upper
        if bound.lower is not None:
            ok = ok & (token_stat >= bound.lower)
        accepted = accepted & ok
        if with_parts:
            parts.update(M.rejection_parts(bound, token_stat, row_stat, ok, mask))
    if with_parts:
        parts.update(M.total_rejection_parts(accepted, mask))
    return accepted, parts


def _weights(
    config: RolloutCorrectionConfig, log_ratio: torch.Tensor, mask: torch.Tensor, with_parts: bool
) -> tuple[torch.Tensor, dict[str, Part]]:
    """``[B, T]`` truncated weights (before the batch normalisation), 0 at masked positions, and their metric
    partials (with ``with_parts``)."""
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    if config.rollout_is == "token":
        log_w, row_log_w = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), None
    else:
        row_log_w = log_ratio.sum(dim=-1)
        log_w = row_log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None].expand_as(log_ratio)
    parts: dict[str, Part] = {}
    if with_parts:
        raw = torch.where(mask, log_w.exp(), zero)
        parts = M.importance_parts(
            raw.double(), None if row_log_w is None else row_log_w.double(), mask, config.rollout_is_threshold
        )
    weights = torch.where(mask, log_w.exp().clamp(max=config.rollout_is_threshold), zero)
    return weights, parts


def _norm_terms(config: RolloutCorrectionConfig, weights: torch.Tensor, kept: torch.Tensor) -> ExactSum:
    """What the batch normalisation averages, over what the loss keeps (valid and not rejected): the kept tokens'
    weights (one float64 term a row: its kept weights summed in fixed column blocks, the same bits whichever rows
    share the tensor), or for sequence weights the weight of each row with a kept token."""
    if weights.numel() == 0:
        return ExactSum(count=0, total=Fraction(0))
    if config.rollout_is == "token":
        zero = torch.zeros((), dtype=torch.float64, device=weights.device)
        terms = row_sums(torch.where(kept, weights.double(), zero))
        return dataclasses.replace(ExactSum.of(terms), count=int(kept.sum()))
    rows = kept.any(dim=-1)
    # every valid token of a row holds the row's weight (>= 0; 0 at masked positions): the row's maximum is it
    row_weight = weights.amax(dim=-1)
    return ExactSum.of(row_weight[rows].double())


def _correction_rows(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    with_parts: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, CorrectionParts | None]:
    """:func:`~ppo_core.rollout_correction.partial.correction_rows` (checks, weights, rejection, partials)."""
    old = check_ndim("old_log_probs", check_floating("old_log_probs", old_log_probs), 2)
    rollout = check_floating("rollout_log_probs", rollout_log_probs)
    check_same_shape(old_log_probs=old, rollout_log_probs=rollout)
    mask, mask_flag = check_mask_deferred("response_mask", response_mask, like=old, like_name="old_log_probs")
    check_devices_match(old_log_probs=old, rollout_log_probs=rollout, response_mask=mask)
    dtype = torch.promote_types(torch.promote_types(old.dtype, rollout.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old.device)
    old = torch.where(mask, old.detach().to(dtype), zero)
    rollout = torch.where(mask, rollout.detach().to(dtype), zero)
    check_all_finite(
        {"old_log_probs": old, "rollout_log_probs": rollout},
        purpose=_FINITE,
        scope=" valid (response_mask=1)",
        mask_name="response_mask",
        mask_flag=mask_flag,
    )
    log_ratio = old - rollout
    parts: dict[str, Part] = {}
    kept = mask
    if config.rollout_rs is not None:
        accepted, rs_parts = _rejection(config.rejection_bounds(), log_ratio, mask, with_parts)
        kept = mask & accepted
        parts.update(rs_parts)
    weights, norm = None, None
    if config.rollout_is is not None:
        weights, is_parts = _weights(config, log_ratio, mask, with_parts)
        parts.update(is_parts)
        if with_parts and config.rollout_is_batch_normalize:
            norm = _norm_terms(config, weights, kept)
    if with_parts:
        parts.update(
            M.offpolicy_parts(old.double(), rollout.double(), log_ratio.double(), mask, LOG_RATIO_CLAMP)
        )
    out_mask = kept if response_mask.dtype == torch.bool else kept.to(response_mask.dtype)
    return weights, out_mask, (CorrectionParts(metrics=parts, norm=norm) if with_parts else None)


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig | Mapping[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Importance weights and rejection for the mismatch between the rollout and training policies.

    Weights (``config.rollout_is``): ``"token"``: ``w_t = min(r_t, u)``; ``"sequence"``: ``w_t = min(prod_s r_s, u)``
    for every token of the row (``u = rollout_is_threshold``); with ``rollout_is_batch_normalize`` divided by
    their mean over the kept tokens (or kept rows), computed exactly from per-row float64 terms and rounded once
    (so a data-parallel step gets the same bits from its ranks' parts: :mod:`ppo_core.rollout_correction.partial`).
    Rejection (``config.rollout_rs``): a token stays when every
    filter accepts it: ``token_kX`` tests the token's statistic, ``seq_{sum,mean,max}_kX`` its row's sum, mean or
    maximum over valid tokens; ``k1`` filters keep ``log lower <= stat <= log upper``, the others ``stat <= upper``.

    Args:
        old_log_probs: ``[B, T]`` log-probs of the sampled tokens under the training forward (``pi_old``).
        rollout_log_probs: ``[B, T]`` log-probs of the same tokens under the sampler.
        response_mask: ``[B, T]`` bool or 0/1 valid tokens; masked positions of the log-probs may hold anything.
        config: a :class:`RolloutCorrectionConfig` or a dict of its fields.

    Returns:
        ``(rollout_is_weights, response_mask, metrics)``: ``[B, T]`` weights (float32 for half-precision inputs,
        else the inputs' dtype; 0 at masked positions) or None without ``rollout_is``; the mask with the rejected
        tokens set to 0 (same dtype as given); ``rollout_corr/*`` scalars (``docs/semantics.md``).

    Raises:
        ValueError: shapes differ, the mask is not 0/1, a log-prob is NaN or inf at a valid position.

    Example:
        >>> old = torch.tensor([[-1.0, -1.0, -2.0]])
        >>> rollout = torch.tensor([[-1.5, -1.0, -0.5]])
        >>> w, mask, m = compute_rollout_correction(old, rollout, torch.ones(1, 3),
        ...                                         {"rollout_is": "token", "rollout_rs": "token_k1",
        ...                                          "rollout_rs_threshold": 2.0})
        >>> w
        tensor([[1.6487, 1.0000, 0.2231]])
        >>> mask
        tensor([[1., 1., 0.]])
    """
    config = RolloutCorrectionConfig.coerce(config)
    weights, out_mask, parts = _correction_rows(old_log_probs, rollout_log_probs, response_mask, config, True)
    mean, metrics = reduce_correction_parts([parts], config)
    if weights is not None:
        weights = normalize_weights(weights, mean)
    return weights, out_mask, metrics
