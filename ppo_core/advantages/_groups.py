"""Group bookkeeping for the outcome estimators: label factorisation and per-group statistics.

A batch of ``B`` responses carries one group label per row (``index``: the prompt's uid, shared by its ``n``
responses). :func:`factorize_index` turns the labels into dense ids ``0..G-1``; the statistics are then O(B)
scatter/index-add operations, with no Python loop over rows or groups.

Label semantics (deliberately stricter than verl's vectorized GRPO, which coerces numeric-looking labels to
integers and sizes its buckets by the largest id): labels are compared by Python equality/hash or by integer
value, never coerced: ``"01"`` and ``"1"`` are two groups, negative and huge integers work, and a label of
``10**9`` costs one bucket, not ``10**9``.

Statistics are accumulated in float64 around a per-group shift (the group minimum), so a group of identical
scores centres to exactly 0 and low-variance groups keep their precision (``(1, 1.00001)`` still has std
``7.07e-6``). Rows flagged invalid (no valid response token) are left out of every statistic.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GroupIndex", "GroupStats", "factorize_index", "group_count", "group_stats", "group_weighted_mean"]


@dataclass(frozen=True)
class GroupIndex:
    """Dense group ids for a batch.

    Attributes:
        ids: ``[B]`` int64 tensor, the group of each row, in ``[0, num_groups)``.
        num_groups: ``G``, the number of distinct labels.
    """

    ids: torch.Tensor
    num_groups: int


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics over the rows flagged valid, all float64.

    Attributes:
        count: ``[G]`` number of valid rows per group.
        mean: ``[G]`` mean of the valid rows' scores (0 for a group without valid rows).
        std: ``[G]`` unbiased (``n - 1``) standard deviation; 0 for groups with fewer than two valid rows.
        centred: ``[B]`` ``score - mean`` of the row's group; exactly 0 for invalid rows and identical scores.
    """

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    centred: torch.Tensor


def _factorize_tensor(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise TypeError(
            f"index must be an integer tensor or a sequence of hashable ids, got dtype {index.dtype}"
        )
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    uniques, inverse = torch.unique(index, return_inverse=True)
    return inverse.to(torch.int64), int(uniques.numel())


def _factorize_labels(index: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    table: dict[Hashable, int] = {}
    try:
        codes = [table.setdefault(label, len(table)) for label in index]
    except TypeError as err:
        raise TypeError(f"index labels must be hashable: {err}") from err
    if any(isinstance(label, torch.Tensor) for label in index):
        # tensors hash by identity, so two equal 0-d tensors would silently form two groups
        raise TypeError(
            "index labels must not be tensors; pass a 1-D integer tensor instead of a list of them"
        )
    return torch.tensor(codes, dtype=torch.int64), len(table)


def factorize_index(
    index: torch.Tensor | np.ndarray | Sequence[Hashable], batch_size: int, device: torch.device | str = "cpu"
) -> GroupIndex:
    """Map group labels to dense ids ``0..G-1``.

    Args:
        index: ``[B]`` labels: a 1-D integer tensor or numpy array, or a sequence of hashable ids (uuid strings,
            ints of any size and sign, tuples...). Labels are equal exactly when Python (or integer) equality says
            so; strings are never parsed as numbers.
        batch_size: ``B``, the number of rows the labels must cover.
        device: where the returned ids live.

    Returns:
        A :class:`GroupIndex`. Ids are consistent (same label, same id) but their order is unspecified.

    Example:
        >>> factorize_index(["01", "1", "01"], batch_size=3).ids
        tensor([0, 1, 0])
    """
    if isinstance(index, (str, bytes)):
        raise TypeError("index must be a sequence of ids or a 1-D integer tensor, not a single string")
    if isinstance(index, np.ndarray):
        if index.dtype.kind in "iu":
            index = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        else:
            index = index.tolist()
    if isinstance(index, torch.Tensor):
        ids, num_groups = _factorize_tensor(index)
    elif isinstance(index, Sequence):
        ids, num_groups = _factorize_labels(index)
    else:
        raise TypeError(
            f"index must be a 1-D integer tensor or a sequence of hashable ids, got {type(index).__name__}"
        )
    if ids.numel() != batch_size:
        raise ValueError(
            f"index has {ids.numel()} labels but the batch has {batch_size} rows; they must match"
        )
    return GroupIndex(ids=ids.to(device), num_groups=num_groups)


def _group_min(x: torch.Tensor, groups: GroupIndex, valid: torch.Tensor) -> torch.Tensor:
    """Per-group minimum over valid rows (0 for groups without one): the shift that makes centring exact."""
    inf = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
    ref = torch.full((groups.num_groups,), float("inf"), dtype=x.dtype, device=x.device)
    ref.scatter_reduce_(0, groups.ids, torch.where(valid, x, inf), reduce="amin", include_self=True)
    return torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)


def _group_sum(x: torch.Tensor, groups: GroupIndex) -> torch.Tensor:
    return x.new_zeros(groups.num_groups).index_add_(0, groups.ids, x)


def group_count(groups: GroupIndex, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[G]`` float64 number of rows (valid rows, if ``valid`` is given) per group.

    Example:
        >>> group_count(factorize_index([-5, 10**18, -5], batch_size=3))
        tensor([2., 1.], dtype=torch.float64)
    """
    if valid is None:
        valid = torch.ones_like(groups.ids, dtype=torch.bool)
    return _group_sum(valid.to(torch.float64), groups)


def group_stats(scores: torch.Tensor, groups: GroupIndex, valid: torch.Tensor | None = None) -> GroupStats:
    """Count, mean, unbiased std and centred scores per group, in float64, over the valid rows only.

    Args:
        scores: ``[B]`` floating scores (finite).
        groups: the factorised labels of the ``B`` rows.
        valid: ``[B]`` bool, rows that take part (default: all).

    Returns:
        :class:`GroupStats`; invalid rows have ``centred == 0`` and do not count.

    Example:
        >>> g = factorize_index(["a", "a", "b"], batch_size=3)
        >>> group_stats(torch.tensor([1.0, 3.0, 5.0]), g).centred
        tensor([-1.,  1.,  0.], dtype=torch.float64)
    """
    x = scores.to(torch.float64)
    if valid is None:
        valid = torch.ones_like(x, dtype=torch.bool)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    count = group_count(groups, valid)
    ref = _group_min(x, groups, valid)
    shifted = torch.where(valid, x - ref[groups.ids], zero)
    shifted_mean = _group_sum(shifted, groups) / count.clamp(min=1)
    centred = torch.where(valid, shifted - shifted_mean[groups.ids], zero)
    sq_sum = _group_sum(centred.square(), groups)
    var = torch.where(count > 1, sq_sum / (count - 1).clamp(min=1), zero)
    return GroupStats(count=count, mean=ref + shifted_mean, std=var.sqrt(), centred=centred)


def group_weighted_mean(
    scores: torch.Tensor, groups: GroupIndex, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted per-group mean ``sum(w * s) / sum(w)`` in float64 (0 where a group's weights sum to 0).

    Args:
        scores: ``[B]`` floating scores (finite).
        groups: the factorised labels of the ``B`` rows.
        weights: ``[B]`` non-negative weights; rows of weight 0 do not take part.

    Returns:
        ``(mean [G], centred [B])`` with ``centred = score - mean`` on rows of positive weight and 0 elsewhere.

    Example:
        >>> g = factorize_index([7, 7], batch_size=2)
        >>> group_weighted_mean(torch.tensor([1.0, 0.0]), g, torch.tensor([3.0, 1.0]))[0]
        tensor([0.7500], dtype=torch.float64)
    """
    x = scores.to(torch.float64)
    w = weights.to(torch.float64)
    valid = w > 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    ref = _group_min(x, groups, valid)
    shifted = torch.where(valid, x - ref[groups.ids], zero)
    total = _group_sum(w, groups)
    shifted_mean = _group_sum(shifted * w, groups) / torch.where(total > 0, total, torch.ones_like(total))
    centred = torch.where(valid, shifted - shifted_mean[groups.ids], zero)
    return ref + shifted_mean, centred
