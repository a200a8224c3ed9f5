"""The ``rollout_corr/*`` metrics of :func:`~ppo_core.rollout_correction.compute_rollout_correction`, under verl's
names: importance-weight statistics, rejection fractions and divergences between the training and rollout policies.

Every statistic runs over the valid tokens (``response_mask = 1``) or over the *valid rows* (rows with at least one
valid token); verl averages some row statistics over every row, empty ones included (they then count as a row
with log-ratio 0). With no valid token every metric is 0.0. All inputs are already 0 at masked positions.
"""

from __future__ import annotations

import math

import torch

from ppo_core.rollout_correction.config import RejectionBound

__all__: list[str] = []


def _mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``where`` is true (0 when nowhere)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(where, values, zero).sum() / where.sum().clamp(min=1)


def _max(values: torch.Tensor, where: torch.Tensor) -> float:
    return float(values[where].max()) if bool(where.any()) else 0.0


def _min(values: torch.Tensor, where: torch.Tensor) -> float:
    return float(values[where].min()) if bool(where.any()) else 0.0


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean of each row over its valid tokens (0 for an empty row)."""
    return values.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def importance_metrics(
    token_weights: torch.Tensor,
    log_weight_rows: torch.Tensor | None,
    mask: torch.Tensor,
    threshold: float,
) -> dict[str, float]:
    """Statistics of the importance weights before truncation (verl's ``rollout_is_*``).

    Args:
        token_weights: ``[B, T]`` weights per token before truncation (0 at masked positions).
        log_weight_rows: ``[B]`` unclamped log-weight of each row (``"sequence"`` level), None at token level.
        mask: ``[B, T]`` bool valid tokens.
        threshold: the truncation bound ``u``; ``1/u`` is the lower reference of the ``_low`` fractions.
    """
    rows = mask.any(dim=-1)
    out: dict[str, float] = {"rollout_is_mean": float(_mean(token_weights, mask))}
    if log_weight_rows is None:
        out["rollout_is_max"] = _max(token_weights, mask)
        out["rollout_is_min"] = _min(token_weights, mask)
        out["rollout_is_ratio_fraction_high"] = float(_mean((token_weights > threshold).to(mask.dtype), mask))
        out["rollout_is_ratio_fraction_low"] = float(
            _mean((token_weights < 1 / threshold).to(mask.dtype), mask)
        )
    else:  # in log space: a product of ratios may be far outside the exp(+-20) the weights are bounded by
        out["rollout_is_max"] = math.exp(min(_max(log_weight_rows, rows), 20.0)) if bool(rows.any()) else 0.0
        out["rollout_is_min"] = math.exp(_min(log_weight_rows, rows)) if bool(rows.any()) else 0.0
        high, low = log_weight_rows > math.log(threshold), log_weight_rows < -math.log(threshold)
        out["rollout_is_ratio_fraction_high"] = float(_mean(high.double(), rows))
        out["rollout_is_ratio_fraction_low"] = float(_mean(low.double(), rows))
    # std and ESS of the weights clamped to [1/u, u], over tokens (verl's definitions)
    clamped = token_weights.clamp(min=1 / threshold, max=threshold)
    mean_c = _mean(clamped, mask)
    n_tokens = int(mask.sum())
    var = _mean(clamped.square(), mask) - mean_c.square()
    out["rollout_is_std"] = float(var.clamp(min=0).sqrt()) if n_tokens > 1 else 0.0
    ess = 1 / _mean((clamped / mean_c).square(), mask) if n_tokens else torch.zeros(())
    out["rollout_is_eff_sample_size"] = float(ess)
    seq = _row_mean(token_weights, mask)[rows]
    if seq.numel():
        out["rollout_is_seq_mean"] = float(seq.mean())
        out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
        out["rollout_is_seq_max"] = float(seq.max())
        out["rollout_is_seq_min"] = float(seq.min())
        out["rollout_is_seq_max_deviation"] = float((seq - 1).abs().max())
        out["rollout_is_seq_fraction_high"] = float((seq > threshold).double().mean())
        out["rollout_is_seq_fraction_low"] = float((seq < 1 / threshold).double().mean())
    else:
        for name in ("mean", "std", "max", "min", "max_deviation", "fraction_high", "fraction_low"):
            out[f"rollout_is_seq_{name}"] = 0.0
    return out


def rejection_metrics(
    bound: RejectionBound,
    token_stat: torch.Tensor,
    row_stat: torch.Tensor | None,
    accepted: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """Statistics of one rejection filter (verl's ``rollout_rs_{option}_*``).

    Args:
        bound: the filter and its accepted range.
        token_stat: ``[B, T]`` per-token statistic (token filters) or the row statistic broadcast (row filters).
        row_stat: ``[B]`` row statistic of a sequence filter; None for a token filter.
        accepted: ``[B, T]`` bool: the filter accepts the token.
        mask: ``[B, T]`` bool valid tokens.
    """
    prefix, rows = f"rollout_rs_{bound.option}", mask.any(dim=-1)
    rejected = mask & ~accepted
    stat, where = (token_stat, mask) if row_stat is None else (row_stat, rows)
    low = (stat < bound.lower) if bound.lower is not None else torch.zeros_like(where)
    return {
        f"{prefix}_mean": float(_mean(token_stat, mask)),
        f"{prefix}_max": _max(stat, where),
        f"{prefix}_min": _min(stat, where),
        f"{prefix}_fraction_high": float(_mean((stat > bound.upper).double(), where)),
        f"{prefix}_fraction_low": float(_mean(low.double(), where)),
        f"{prefix}_masked_fraction": float(_mean(rejected.double(), mask)),
        f"{prefix}_seq_masked_fraction": float(_mean(rejected.any(dim=-1).double(), rows)),
    }


def total_rejection_metrics(accepted: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Fractions of the valid tokens, and of the valid rows with a token, that the filters reject together."""
    rejected = mask & ~accepted
    return {
        "rollout_rs_masked_fraction": float(_mean(rejected.double(), mask)),
        "rollout_rs_seq_masked_fraction": float(_mean(rejected.any(dim=-1).double(), mask.any(dim=-1))),
    }


def offpolicy_metrics(
    old: torch.Tensor, rollout: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, bound: float
) -> dict[str, float]:
    """Divergences between the training (``old``) and rollout policies over the valid tokens (verl's names).

    ``kl``: k1 estimate of KL(rollout || training), mean of ``-log r``; ``k3_kl``: mean of ``r - 1 - log r``;
    ``chi2_token``: mean of ``r^2`` minus 1; ``chi2_seq``: mean over rows of ``(prod_t r_t)^2`` minus 1; perplexities
    are means over rows of ``exp(-mean_t log p)``. ``log r`` is clamped to ``[-bound, bound]`` before every ``exp``.

    Args:
        old, rollout: ``[B, T]`` log-probs, 0 at masked positions.
        log_ratio: ``[B, T]`` ``old - rollout`` (unclamped; 0 at masked positions).
        mask: ``[B, T]`` bool valid tokens.
        bound: the clamp of ``log r`` before ``exp``.
    """
    rows = mask.any(dim=-1)
    safe = log_ratio.clamp(-bound, bound)
    row_sum = log_ratio.sum(dim=-1).clamp(-bound, bound)
    mean_old, mean_rollout = _row_mean(old, mask), _row_mean(rollout, mask)
    diff = mean_rollout - mean_old
    out = {
        "kl": float(_mean(-log_ratio, mask)),
        "k3_kl": float(_mean(safe.exp() - 1 - safe, mask)),
        "training_ppl": float(_mean((-mean_old).exp(), rows)),
        "training_log_ppl": float(_mean(-mean_old, rows)),
        "rollout_ppl": float(_mean((-mean_rollout).exp(), rows)),
        "rollout_log_ppl": float(_mean(-mean_rollout, rows)),
        "log_ppl_diff": float(_mean(diff, rows)),
        "log_ppl_abs_diff": float(_mean(diff.abs(), rows)),
        "log_ppl_diff_max": _max(diff, rows),
        "log_ppl_diff_min": _min(diff, rows),
        "ppl_ratio": float(_mean(diff.exp(), rows)),
        "chi2_token": float(_mean((2 * safe).exp(), mask) - 1) if bool(mask.any()) else 0.0,
        "chi2_seq": float(_mean((2 * row_sum).exp(), rows) - 1) if bool(rows.any()) else 0.0,
    }
    return out
