"""Masked moments of one shard and their exact combination: batch-global whitening and variances without the batch.

A data-parallel rank holding rows of a ``[B, T]`` tensor computes :func:`masked_moments` of its rows (valid count,
mean, and the sum of squared deviations from that mean, ``m2``, in float64); the controller combines the ranks'
moments with :func:`combine_moments` (Chan, Golub and LeVeque's pairwise update, numerically stable: no sum of
squares is ever subtracted from another): what the token-level metrics need (means, variances), equal to the
whole batch's up to rounding. Masked entries are exactly 0 in :func:`whiten_with`'s output, as the estimators'
whitening leaves them.

The estimators' whitening itself (:func:`ppo_core.kernels.whiten.whiten_valid`: GAE, REINFORCE++ and
REINFORCE++-baseline on the PyTorch path) is built on :func:`row_moments` and :func:`reduce_row_moments`: each row's
count, first valid value, float64 sum about it and float64 sum of squared deviations from the row's mean (every
row summed in fixed blocks of columns, so a row's partials do not depend on which other rows share its tensor),
reduced over the rows with
:func:`math.fsum` (exactly rounded, so independent of the order and the grouping of the rows). A data-parallel
rank computes the row partials of its rows, the controller reduces the concatenation: the whitened values are bit
for bit those of the whole batch, whatever the split of the rows into contiguous blocks.

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 0.0]]); m = torch.tensor([[1, 1], [1, 0]]).bool()
    >>> whole = combine_moments([masked_moments(x[:1], m[:1]), masked_moments(x[1:], m[1:])])
    >>> whole.count, whole.mean, whole.var()
    (3, 2.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ppo_core._checks import check_floating, check_mask
from ppo_core.masked import WHITEN_EPS

__all__ = [
    "Moments",
    "RowMoments",
    "combine_moments",
    "masked_moments",
    "reduce_row_moments",
    "row_moments",
    "row_sums",
    "whiten_with",
]

ROW_BLOCK = 1024
"""Columns summed per block in :func:`row_moments`: a row's sum is the sum of its blocks' sums, the same
arithmetic whichever rows share its tensor (PyTorch may split one long reduction across threads)."""


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
    if values.dim() != 2:
        out = (values.to(torch.float64) - moments.mean) * scale
        return out.masked_fill_(~mask, 0.0).to(values.dtype)
    rows, width = values.shape
    result = torch.empty_like(values)
    step = _row_chunks(rows, width).step
    for lo in _row_chunks(rows, width):
        hi = min(lo + step, rows)
        out = values[lo:hi].to(torch.float64, copy=True).sub_(moments.mean).mul_(scale)
        result[lo:hi] = out.masked_fill_(~mask[lo:hi], 0.0)
    return result


@dataclasses.dataclass(frozen=True)
class RowMoments:
    """Per-row partials of a masked ``[b, T]`` tensor, all ``[b]``: ``count`` int64 valid entries, ``ref`` float64
    the row's first valid value (0 for an empty row), ``total`` float64 sum of the valid ``x - ref`` and ``m2``
    float64 sum of squared deviations from the row's mean.

    The values are taken about ``ref`` before they are summed: equal values differ by exactly 0, so a constant
    batch has a mean of exactly its value and a variance of exactly 0, in float64 inputs too."""

    count: torch.Tensor
    ref: torch.Tensor
    total: torch.Tensor
    m2: torch.Tensor


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """``[b]`` sums of float64 ``values`` ``[b, T]``, each the sum of its :data:`ROW_BLOCK`-column blocks' sums: a
    row's sum in one fixed order whichever rows share its tensor, so sums taken on shards equal those of the whole.

    Example:
        >>> x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
        >>> row_sums(x)
        tensor([ 3., 12.], dtype=torch.float64)
    """
    rows, width = values.shape
    pad = -width % ROW_BLOCK
    if pad:
        values = F.pad(values, (0, pad))
    return values.reshape(rows, (width + pad) // ROW_BLOCK, ROW_BLOCK).sum(dim=-1).sum(dim=-1)


def _row_chunks(rows: int, width: int) -> range:
    """Starts of the row chunks that the elementwise passes take one at a time (a chunk's float64 copies stay in
    cache); a chunk's results are those of its rows alone, so the chunking changes no bit."""
    return range(0, rows, max(1, _CHUNK_ELEMENTS // max(width, 1)))


_CHUNK_ELEMENTS = 1 << 22


def row_moments(values: torch.Tensor, mask: torch.Tensor, check: bool = True) -> RowMoments:
    """:class:`RowMoments` of ``values`` ``[b, T]`` (floating) over ``mask`` (same shape), in float64.

    Masked entries (NaN or inf included) never enter. With ``check`` a valid non-finite value raises
    ``ValueError`` (one host sync); without it, it makes the row's partials non-finite.
    """
    values = check_floating("values", values)
    mask = check_mask("mask", mask, like=values, like_name="values")
    if values.dim() != 2:
        raise ValueError(f"values must be [b, T]; got shape {tuple(values.shape)}")
    rows, width = values.shape
    count = mask.sum(dim=-1, dtype=torch.int64)
    ref = torch.zeros(rows, dtype=torch.float64, device=values.device)
    total = torch.zeros(rows, dtype=torch.float64, device=values.device)
    m2 = torch.zeros(rows, dtype=torch.float64, device=values.device)
    step = _row_chunks(rows, width).step
    for lo in _row_chunks(rows, width):
        hi = min(lo + step, rows)
        inside = mask[lo:hi]
        outside = ~inside
        acc = values[lo:hi].to(torch.float64, copy=True).masked_fill_(outside, 0.0)
        if width:
            # the first valid column (a max's index is its first; an empty row reads a masked 0)
            first = inside.view(torch.uint8).max(dim=-1, keepdim=True).indices
            ref[lo:hi] = acc.gather(-1, first).squeeze(-1)
        acc.sub_(ref[lo:hi].unsqueeze(-1)).masked_fill_(outside, 0.0)
        total[lo:hi] = row_sums(acc)
        mean = total[lo:hi] / count[lo:hi].clamp(min=1)
        m2[lo:hi] = row_sums(acc.sub_(mean.unsqueeze(-1)).masked_fill_(outside, 0.0).square_())
    if check and not bool(torch.isfinite(total).all() and torch.isfinite(ref).all()):
        raise ValueError("values hold NaN or inf where mask is 1; whitening needs finite values")
    return RowMoments(count=count, ref=ref, total=total, m2=m2)


def reduce_row_moments(parts: Sequence[RowMoments]) -> Moments:
    """The :class:`Moments` of the rows of every part (the concatenation of the row partials).

    With ``g`` the ``ref`` of the first row holding a valid entry: ``mean = g + fsum(count_i * (ref_i - g),
    total_i) / count``; ``m2 = fsum(m2_i, count_i * (mean_i - mean) ** 2)`` with each row's mean ``mean_i = ref_i +
    total_i / count_i`` (the exact decomposition of the sum of squared deviations into within-row and between-row
    parts). :func:`math.fsum` rounds exactly once, so the result depends on the row partials in row order only:
    neither on how the rows are grouped into parts nor on the order of the terms.
    """
    parts = [p for p in parts if p.count.numel()]
    if not parts:
        return Moments(count=0, mean=0.0, m2=0.0)
    count = torch.cat([p.count.cpu() for p in parts])
    ref = torch.cat([p.ref.cpu() for p in parts])
    total = torch.cat([p.total.cpu() for p in parts])
    m2 = torch.cat([p.m2.cpu() for p in parts])
    counts = count.tolist()
    n = sum(counts)
    if n == 0:
        return Moments(count=0, mean=0.0, m2=0.0)
    g = ref.tolist()[next(i for i, c in enumerate(counts) if c)]
    weight = count.to(torch.float64)
    offsets = weight * (ref - g)
    mean = g + math.fsum(itertools.chain(offsets.tolist(), total.tolist())) / n
    row_mean = ref + total / count.clamp(min=1)
    # an empty row adds nothing (its mean of 0 may be far from a huge batch mean: 0 * inf is NaN)
    between = torch.where(count > 0, weight * (row_mean - mean).square(), 0.0)
    return Moments(count=n, mean=mean, m2=math.fsum(itertools.chain(m2.tolist(), between.tolist())))
