"""Masked moments of one shard and their exact combination: batch-global whitening and variances without the batch.

A data-parallel rank holding rows of a ``[B, T]`` tensor computes :func:`masked_moments` of its rows (valid count,
mean, and the sum of squared deviations from that mean, ``m2``, in float64); the controller combines the ranks'
moments with :func:`combine_moments` (Chan, Golub and LeVeque's pairwise update, numerically stable: no sum of
squares is ever subtracted from another) and scatters the mean and variance back; each rank then whitens its rows
with :func:`whiten_with`. The result equals :func:`ppo_core.masked.masked_whiten` over the whole batch up to the
rounding of its float32 reduction (the order of the sums differs), and masked entries are exactly 0, as the
estimators' whitening leaves them.

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 0.0]]); m = torch.tensor([[1, 1], [1, 0]]).bool()
    >>> whole = combine_moments([masked_moments(x[:1], m[:1]), masked_moments(x[1:], m[1:])])
    >>> whole.count, whole.mean, whole.var()
    (3, 2.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ppo_core._checks import check_floating, check_mask
from ppo_core.masked import WHITEN_EPS

__all__ = ["Moments", "combine_moments", "masked_moments", "whiten_with"]


@dataclasses.dataclass(frozen=True)
class Moments:
    """Valid-entry count, mean and ``m2`` (sum of squared deviations from the mean) of a masked tensor."""

    count: int
    mean: float
    m2: float

    def var(self, unbiased: bool = True) -> float:
        """The variance (0 with too few entries, as :func:`ppo_core.masked.masked_var` gives it)."""
        denom = self.count - 1 if unbiased else self.count
        return self.m2 / denom if denom > 0 else 0.0


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> Moments:
    """:class:`Moments` of ``values`` (floating, any shape) over ``mask`` (same shape), in float64.

    Masked entries (NaN or inf included) never enter; a valid non-finite value raises ``ValueError``.
    """
    values = check_floating("values", values)
    mask = check_mask("mask", mask, like=values, like_name="values")
    acc = values.to(torch.float64)
    count = int(mask.sum())
    if count == 0:
        return Moments(count=0, mean=0.0, m2=0.0)
    zero = torch.zeros((), dtype=torch.float64)
    mean = torch.where(mask, acc, zero).sum() / count
    if not bool(torch.isfinite(mean)):
        raise ValueError("values hold NaN or inf where mask is 1; whitening needs finite values")
    m2 = torch.where(mask, (acc - mean).square(), zero).sum()
    return Moments(count=count, mean=float(mean), m2=float(m2))


def combine_moments(parts: Sequence[Moments]) -> Moments:
    """The :class:`Moments` of the union of disjoint shards, from each shard's (any order, empty shards allowed)."""
    count, mean, m2 = 0, 0.0, 0.0
    for part in parts:
        if part.count == 0:
            continue
        total = count + part.count
        delta = part.mean - mean
        mean += delta * part.count / total
        m2 += part.m2 + delta * delta * count * part.count / total
        count = total
    return Moments(count=count, mean=mean, m2=m2)


def whiten_with(values: torch.Tensor, mask: torch.Tensor, moments: Moments) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with the batch's ``moments`` (unbiased variance), 0 where masked.

    Args:
        values: ``[b, T]`` floating, one shard's rows; mask: ``[b, T]`` bool or 0/1.
        moments: the whole batch's :class:`Moments` (:func:`combine_moments` of every shard's).

    Returns:
        ``[b, T]`` in ``values``' dtype (computed in float64).
    """
    values = check_floating("values", values)
    mask = check_mask("mask", mask, like=values, like_name="values")
    scale = 1.0 / math.sqrt(moments.var() + WHITEN_EPS)
    out = (values.to(torch.float64) - moments.mean) * scale
    return torch.where(mask, out, torch.zeros((), dtype=torch.float64)).to(values.dtype)
