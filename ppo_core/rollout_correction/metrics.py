"""The ``rollout_corr/*`` metrics of :func:`~ppo_core.rollout_correction.compute_rollout_correction`, under verl's
names: importance-weight statistics, rejection fractions and divergences between the training and rollout policies.

Every statistic runs over the valid tokens (``response_mask = 1``) or over the *valid rows* (rows with at least one
valid token); verl averages some row statistics over every row, empty ones included (they then count as a row
with log-ratio 0). With no valid token every metric is 0.0. All inputs are already 0 at masked positions.

Each metric is defined by *partials* a shard of rows computes (``*_parts``: a name -> partial dict) and a finish
that reads the combined partials (the metric functions): a mean, a fraction, a minimum or a maximum is a
:class:`~ppo_core.metrics.partial.TokenStats` (float64 count, sum, minimum, maximum of the values over their
domain; a fraction is the mean of a 0/1 indicator), a standard deviation a
:class:`~ppo_core.masked_moments.Moments` (count, mean and the sum of squared deviations, combined exactly in
Chan's form, never as a difference of sums of squares). The whole batch is one shard; a data-parallel step
combines its ranks' partials (:mod:`ppo_core.rollout_correction.partial`). Every metric here has an exact partial
form (no median or quantile).
"""

from __future__ import annotations

import math

import torch

from ppo_core.masked_moments import Moments, masked_moments
from ppo_core.metrics.partial import TokenStats, token_stats
from ppo_core.rollout_correction.config import RejectionBound

__all__: list[str] = []

Part = TokenStats | Moments
"""One partial of a metric (see the module docstring)."""


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean of each row over its valid tokens (0 for an empty row)."""
    return values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def _avg(part: TokenStats) -> float:
    """The mean of a :class:`TokenStats` (0 when it holds nothing)."""
    return part.total / part.count if part.count else 0.0


def _hi(part: TokenStats) -> float:
    return part.high if part.count else 0.0


def _lo(part: TokenStats) -> float:
    return part.low if part.count else 0.0


def importance_parts(
    token_weights: torch.Tensor,
    log_weight_rows: torch.Tensor | None,
    mask: torch.Tensor,
    threshold: float,
) -> dict[str, Part]:
    """Partials of the statistics of the importance weights before truncation (verl's ``rollout_is_*``).

    Args:
        token_weights: ``[B, T]`` float64 weights per token before truncation (0 at masked positions).
        log_weight_rows: ``[B]`` float64 unclamped log-weight of each row (``"sequence"`` level), None at token level.
        mask: ``[B, T]`` bool valid tokens.
        threshold: the truncation bound ``u``; ``1/u`` is the lower reference of the ``_low`` fractions.
    """
    rows = mask.any(dim=-1)
    out: dict[str, Part] = {"is/w": token_stats(token_weights, mask)}
    if log_weight_rows is None:
        out["is/high"] = token_stats((token_weights > threshold).double(), mask)
        out["is/low"] = token_stats((token_weights < 1 / threshold).double(), mask)
    else:  # in log space: a product of ratios may be far outside the exp(+-20) the weights are bounded by
        out["is/log_row"] = token_stats(log_weight_rows, rows)
        out["is/high"] = token_stats((log_weight_rows > math.log(threshold)).double(), rows)
        out["is/low"] = token_stats((log_weight_rows < -math.log(threshold)).double(), rows)
    # std and ESS of the weights clamped to [1/u, u], over tokens (verl's definitions)
    out["is/clamped"] = masked_moments(token_weights.clamp(min=1 / threshold, max=threshold), mask)
    seq = _row_mean(token_weights, mask)
    out["is/seq"] = token_stats(seq, rows)
    out["is/seq_moments"] = masked_moments(seq, rows)
    out["is/seq_high"] = token_stats((seq > threshold).double(), rows)
    out["is/seq_low"] = token_stats((seq < 1 / threshold).double(), rows)
    return out


def importance_metrics(parts: dict[str, Part], sequence: bool) -> dict[str, float]:
    """verl's ``rollout_is_*`` from :func:`importance_parts` (combined); ``sequence``: sequence-level weights.

    ``rollout_is_std`` is the population standard deviation of the clamped weights and
    ``rollout_is_eff_sample_size`` ``1 / mean((c / mean c)^2) = mean(c)^2 / (var(c) + mean(c)^2)``, both from the
    clamped weights' moments.
    """
    weights = parts["is/w"]
    out = {"rollout_is_mean": _avg(weights)}
    if not sequence:
        out["rollout_is_max"] = _hi(weights)
        out["rollout_is_min"] = _lo(weights)
    else:
        rows = parts["is/log_row"]
        out["rollout_is_max"] = math.exp(min(rows.high, 20.0)) if rows.count else 0.0
        out["rollout_is_min"] = math.exp(rows.low) if rows.count else 0.0
    out["rollout_is_ratio_fraction_high"] = _avg(parts["is/high"])
    out["rollout_is_ratio_fraction_low"] = _avg(parts["is/low"])
    clamped = parts["is/clamped"]
    var = clamped.m2 / clamped.count if clamped.count else 0.0
    out["rollout_is_std"] = math.sqrt(max(var, 0.0)) if clamped.count > 1 else 0.0
    second = var + clamped.mean**2
    out["rollout_is_eff_sample_size"] = clamped.mean**2 / second if clamped.count and second > 0 else 0.0
    seq, moments = parts["is/seq"], parts["is/seq_moments"]
    out["rollout_is_seq_mean"] = _avg(seq)
    out["rollout_is_seq_std"] = math.sqrt(moments.var()) if seq.count > 1 else 0.0
    out["rollout_is_seq_max"] = _hi(seq)
    out["rollout_is_seq_min"] = _lo(seq)
    # max |s - 1| = max(max s - 1, 1 - min s), exactly (rounding is monotone and symmetric)
    out["rollout_is_seq_max_deviation"] = max(seq.high - 1, 1 - seq.low) if seq.count else 0.0
    out["rollout_is_seq_fraction_high"] = _avg(parts["is/seq_high"])
    out["rollout_is_seq_fraction_low"] = _avg(parts["is/seq_low"])
    return out


def rejection_parts(
    bound: RejectionBound,
    token_stat: torch.Tensor,
    row_stat: torch.Tensor | None,
    accepted: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, Part]:
    """Partials of the statistics of one rejection filter (verl's ``rollout_rs_{option}_*``).

    Args:
        bound: the filter and its accepted range.
        token_stat: ``[B, T]`` per-token statistic (token filters) or the row statistic broadcast (row filters).
        row_stat: ``[B]`` row statistic of a sequence filter; None for a token filter.
        accepted: ``[B, T]`` bool: the filter accepts the token.
        mask: ``[B, T]`` bool valid tokens.
    """
    prefix, rows = f"rs/{bound.option}", mask.any(dim=-1)
    rejected = mask & ~accepted
    stat, where = (token_stat, mask) if row_stat is None else (row_stat, rows)
    low = (stat < bound.lower) if bound.lower is not None else torch.zeros_like(where)
    out = {
        f"{prefix}/tokens": token_stats(token_stat, mask),
        f"{prefix}/high": token_stats((stat > bound.upper).double(), where),
        f"{prefix}/low": token_stats(low.double(), where),
        f"{prefix}/rejected": token_stats(rejected.double(), mask),
        f"{prefix}/rejected_rows": token_stats(rejected.any(dim=-1).double(), rows),
    }
    if row_stat is not None:
        out[f"{prefix}/rows"] = token_stats(row_stat, rows)
    return out


def rejection_metrics(bound: RejectionBound, parts: dict[str, Part]) -> dict[str, float]:
    """verl's ``rollout_rs_{option}_*`` from :func:`rejection_parts` (combined)."""
    prefix, key = f"rollout_rs_{bound.option}", f"rs/{bound.option}"
    domain = parts.get(f"{key}/rows", parts[f"{key}/tokens"])
    return {
        f"{prefix}_mean": _avg(parts[f"{key}/tokens"]),
        f"{prefix}_max": _hi(domain),
        f"{prefix}_min": _lo(domain),
        f"{prefix}_fraction_high": _avg(parts[f"{key}/high"]),
        f"{prefix}_fraction_low": _avg(parts[f"{key}/low"]),
        f"{prefix}_masked_fraction": _avg(parts[f"{key}/rejected"]),
        f"{prefix}_seq_masked_fraction": _avg(parts[f"{key}/rejected_rows"]),
    }


def total_rejection_parts(accepted: torch.Tensor, mask: torch.Tensor) -> dict[str, Part]:
    """Partials of the fractions of the valid tokens, and of the valid rows, that the filters reject together."""
    rejected = mask & ~accepted
    return {
        "rs/rejected": token_stats(rejected.double(), mask),
        "rs/rejected_rows": token_stats(rejected.any(dim=-1).double(), mask.any(dim=-1)),
    }


def total_rejection_metrics(parts: dict[str, Part]) -> dict[str, float]:
    """``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction`` from :func:`total_rejection_parts`."""
    return {
        "rollout_rs_masked_fraction": _avg(parts["rs/rejected"]),
        "rollout_rs_seq_masked_fraction": _avg(parts["rs/rejected_rows"]),
    }


def offpolicy_parts(
    old: torch.Tensor, rollout: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, bound: float
) -> dict[str, Part]:
    """Partials of the divergences between the training (``old``) and rollout policies (see
    :func:`offpolicy_metrics`).

    Args:
        old, rollout: ``[B, T]`` float64 log-probs, 0 at masked positions.
        log_ratio: ``[B, T]`` float64 ``old - rollout`` (unclamped; 0 at masked positions).
        mask: ``[B, T]`` bool valid tokens.
        bound: the clamp of ``log r`` before ``exp``.
    """
    rows = mask.any(dim=-1)
    safe = log_ratio.clamp(-bound, bound)
    row_sum = log_ratio.sum(dim=-1).clamp(-bound, bound)
    mean_old, mean_rollout = _row_mean(old, mask), _row_mean(rollout, mask)
    diff = mean_rollout - mean_old
    return {
        "op/kl": token_stats(-log_ratio, mask),
        "op/k3_kl": token_stats(safe.exp() - 1 - safe, mask),
        "op/chi2_token": token_stats((2 * safe).exp(), mask),
        "op/training_ppl": token_stats((-mean_old).exp(), rows),
        "op/training_log_ppl": token_stats(-mean_old, rows),
        "op/rollout_ppl": token_stats((-mean_rollout).exp(), rows),
        "op/rollout_log_ppl": token_stats(-mean_rollout, rows),
        "op/log_ppl_diff": token_stats(diff, rows),
        "op/log_ppl_abs_diff": token_stats(diff.abs(), rows),
        "op/ppl_ratio": token_stats(diff.exp(), rows),
        "op/chi2_seq": token_stats((2 * row_sum).exp(), rows),
    }


def offpolicy_metrics(parts: dict[str, Part]) -> dict[str, float]:
    """Divergences between the training and rollout policies over the valid tokens (verl's names), from
    :func:`offpolicy_parts` (combined).

    ``kl``: k1 estimate of KL(rollout || training), mean of ``-log r``; ``k3_kl``: mean of ``r - 1 - log r``;
    ``chi2_token``: mean of ``r^2`` minus 1; ``chi2_seq``: mean over rows of ``(prod_t r_t)^2`` minus 1; perplexities
    are means over rows of ``exp(-mean_t log p)``. ``log r`` is clamped before every ``exp``.
    """
    out = {
        name: _avg(parts[f"op/{name}"])
        for name in (
            "kl",
            "k3_kl",
            "training_ppl",
            "training_log_ppl",
            "rollout_ppl",
            "rollout_log_ppl",
            "log_ppl_diff",
            "log_ppl_abs_diff",
            "ppl_ratio",
        )
    }
    out["log_ppl_diff_max"] = _hi(parts["op/log_ppl_diff"])
    out["log_ppl_diff_min"] = _lo(parts["op/log_ppl_diff"])
    chi2_token, chi2_seq = parts["op/chi2_token"], parts["op/chi2_seq"]
    out["chi2_token"] = _avg(chi2_token) - 1 if chi2_token.count else 0.0
    out["chi2_seq"] = _avg(chi2_seq) - 1 if chi2_seq.count else 0.0
    return out
