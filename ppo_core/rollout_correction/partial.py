"""Rollout correction over shards of rows: what each data-parallel rank computes from its rows and how the
controller combines it (``trainer.resident_batches``, ``docs/resident-batches.md``).

Everything of :func:`~ppo_core.rollout_correction.compute_rollout_correction` is row-local (the weights before the
batch normalisation, the rejection) except two things, which :class:`CorrectionParts` carries:

- the batch normalisation's mean of the kept weights: an :class:`ExactSum` (the exact rational sum of the per-row
  float64 terms and their count), so the mean, and the weights divided by it, are the same bits however the rows
  are split into shards (the whole-batch function computes it the same way);
- the ``rollout_corr/*`` metrics' partials (:mod:`ppo_core.rollout_correction.metrics`): counts, float64 sums,
  minima and maxima, and moments; combined, the metrics equal the whole batch's up to the order of their float64
  sums.

Example:
    >>> import torch
    >>> from ppo_core.rollout_correction import compute_rollout_correction
    >>> old, rollout = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0)), -torch.ones(4, 3)
    >>> mask, cfg = torch.ones(4, 3), {"rollout_is": "token", "rollout_is_batch_normalize": True}
    >>> parts = [correction_rows(old[:1], rollout[:1], mask[:1], cfg)[2],
    ...          correction_rows(old[1:], rollout[1:], mask[1:], cfg)[2]]
    >>> factor, _ = reduce_correction_parts(parts, cfg)
    >>> factor == compute_rollout_correction(old, rollout, mask, cfg)[2]["rollout_corr/rollout_is_batch_norm_factor"]
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from ppo_core.masked_moments import Moments, combine_moments
from ppo_core.metrics.partial import TokenStats, combine_token_stats
from ppo_core.rollout_correction import metrics as M
from ppo_core.rollout_correction.config import RolloutCorrectionConfig

__all__ = [
    "NORM_MIN",
    "CorrectionParts",
    "ExactSum",
    "correction_rows",
    "normalize_weights",
    "reduce_correction_parts",
]

NORM_MIN = 1e-8
"""A batch-normalisation mean at or below this leaves the weights as they are (factor 1)."""


@dataclasses.dataclass(frozen=True)
class ExactSum:
    """``count`` terms and their exact sum ``total`` (a :class:`~fractions.Fraction`: float64 terms are dyadic
    rationals, so the sum of any grouping is the same number)."""

    count: int
    total: Fraction

    @staticmethod
    def of(values: torch.Tensor) -> ExactSum:
        """The exact sum of the finite float64 ``values`` (``[n]``)."""
        pairs = [float(v).as_integer_ratio() for v in values.tolist()]
        den = max((d for _, d in pairs), default=1)  # powers of two: the largest is a common denominator
        return ExactSum(count=len(pairs), total=Fraction(sum(n * (den // d) for n, d in pairs), den))

    def mean(self) -> float:
        """``total / count`` rounded once to float64 (0 without terms)."""
        return float(self.total / self.count) if self.count else 0.0


@dataclasses.dataclass(frozen=True)
class CorrectionParts:
    """One shard's part of the rollout correction: ``metrics`` partials by name
    (:mod:`ppo_core.rollout_correction.metrics`) and ``norm`` (the batch normalisation's kept weights, None
    without ``rollout_is_batch_normalize``)."""

    metrics: dict[str, TokenStats | Moments]
    norm: ExactSum | None = None


def correction_rows(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig | Mapping[str, Any],
    with_parts: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, CorrectionParts | None]:
    """The row-local part of :func:`~ppo_core.rollout_correction.compute_rollout_correction` on one shard's rows.

    Args: as :func:`~ppo_core.rollout_correction.compute_rollout_correction` (``[b, T]`` tensors);
    ``with_parts``: also compute the shard's :class:`CorrectionParts` (None otherwise).

    Returns:
        ``(weights, response_mask, parts)``: the truncated weights *before* the batch normalisation (see
        :func:`normalize_weights`), or None without ``rollout_is``; the mask without the rejected tokens; the parts.
    """
    from ppo_core.rollout_correction.compute import _correction_rows

    return _correction_rows(
        old_log_probs, rollout_log_probs, response_mask, RolloutCorrectionConfig.coerce(config), with_parts
    )


def _combine(parts: Sequence[dict[str, TokenStats | Moments]]) -> dict[str, TokenStats | Moments]:
    out: dict[str, TokenStats | Moments] = {}
    for name, first in parts[0].items():
        pieces = [p[name] for p in parts]
        out[name] = combine_token_stats(pieces) if isinstance(first, TokenStats) else combine_moments(pieces)
    return out


def reduce_correction_parts(
    parts: Sequence[CorrectionParts], config: RolloutCorrectionConfig | Mapping[str, Any]
) -> tuple[float | None, dict[str, float]]:
    """Combine the shards' parts (in row order): the batch normalisation's mean of the kept weights (None without
    ``rollout_is_batch_normalize``; :func:`normalize_weights` applies it) and the ``rollout_corr/*`` metrics."""
    config = RolloutCorrectionConfig.coerce(config)
    if not parts:
        raise ValueError("no rollout correction parts to reduce")
    combined = _combine([p.metrics for p in parts])
    metrics: dict[str, float] = {}
    for bound in config.rejection_bounds():
        metrics.update(M.rejection_metrics(bound, combined))
    if config.rollout_rs is not None:
        metrics.update(M.total_rejection_metrics(combined))
    mean = None
    if config.rollout_is is not None:
        metrics.update(M.importance_metrics(combined, sequence=config.rollout_is == "sequence"))
        if config.rollout_is_batch_normalize:
            norm = [p.norm for p in parts]
            if any(n is None for n in norm):
                raise ValueError("rollout_is_batch_normalize needs every shard's ExactSum (parts.norm)")
            mean = ExactSum(count=sum(n.count for n in norm), total=sum((n.total for n in norm), Fraction(0)))
            mean = mean.mean()
            metrics["rollout_is_batch_norm_factor"] = mean if mean > NORM_MIN else 1.0
    metrics.update(M.offpolicy_metrics(combined))
    return mean, {f"rollout_corr/{name}": value for name, value in metrics.items()}


def normalize_weights(weights: torch.Tensor, mean: float | None) -> torch.Tensor:
    """``weights`` divided by the batch normalisation's ``mean`` (rounded to the weights' dtype); unchanged when
    ``mean`` is None or at most :data:`NORM_MIN`."""
    if mean is None or not mean > NORM_MIN:
        return weights
    return weights / torch.as_tensor(mean, dtype=weights.dtype, device=weights.device)
