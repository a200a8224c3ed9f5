"""Sequence-length balancing across data-parallel ranks that keeps every group (``uid``) on one rank.

Group estimators (GRPO, RLOO, ...) and per-prompt metrics need all ``n`` responses of a prompt on the same rank.
:func:`balance_groups_by_seqlen` treats each group as one item whose workload is the sum of its rows' workloads and
partitions the groups with the same Karmarkar-Karp / greedy pair as :func:`ppo_core.batch.balance_by_seqlen`, then
expands the groups back into row indices.

Rows belong to the same group when their ids are equal, wherever they are in the batch: the rows of a group need
not be contiguous (grouping only runs of equal neighbours would split a group that was shuffled apart).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from ppo_core.batch.balance import _as_weights, _best_partitions

__all__ = ["balance_groups_by_seqlen"]


def _group_rows(uids: Sequence[Hashable] | torch.Tensor, size: int) -> list[list[int]]:
    """Row indices per group, groups in order of first appearance."""
    if isinstance(uids, torch.Tensor):
        if uids.dim() != 1:
            raise ValueError(f"uids must be 1-D, got shape {tuple(uids.shape)}")
        uids = uids.tolist()
    elif isinstance(uids, (str, bytes)) or not isinstance(uids, Sequence):
        raise TypeError(f"uids must be a sequence of hashable ids or a 1-D tensor, got {type(uids).__name__}")
    if len(uids) != size:
        raise ValueError(f"uids has {len(uids)} entries but seqlens has {size}; they must match")
    rows: dict[Hashable, list[int]] = {}
    for i, uid in enumerate(uids):
        try:
            rows.setdefault(uid, []).append(i)
        except TypeError as exc:
            raise TypeError(f"uids must hold hashable ids, got uids[{i}] = {uid!r}") from exc
    return list(rows.values())


def balance_groups_by_seqlen(
    seqlens: Sequence[float] | torch.Tensor,
    uids: Sequence[Hashable] | torch.Tensor,
    k: int,
    equal_size: bool = True,
) -> tuple[list[list[int]], torch.Tensor]:
    """Partition ``B`` rows into ``k`` sets of about equal total ``seqlens``, never splitting a group of rows
    that share a ``uid``.

    Args:
        seqlens: ``[B]`` non-negative workload per row (token count, or a FLOP proxy), a 1-D tensor or a sequence.
        uids: ``[B]`` group id per row (strings, ints, any hashable; or a 1-D integer tensor). Rows with equal ids
            form one group wherever they are.
        k: number of partitions (the data-parallel size), ``1 <= k <= number of groups``.
        equal_size: give every partition the same number of groups (``G // k``; needs ``G`` divisible by ``k``).
            When every group has the same size (``rollout.n`` responses per prompt), every partition then has
            ``B // k`` rows, so ``select(batch, permutation)`` followed by ``split_for_dp(..., k)`` sends
            partition ``j`` to rank ``j`` with every group whole.

    Returns:
        ``(partitions, permutation)``: ``k`` lists of row indices (each sorted ascending, the lists ordered by
        their smallest index) covering every row once, the rows of a group always in the same list; and the
        ``[B]`` int64 permutation ``cat(partitions)``.

    Raises:
        ValueError: ``k < 1``; fewer groups than ``k``; ``equal_size`` with a number of groups that ``k`` does not
            divide (the message names both); ``uids`` and ``seqlens`` of different lengths; negative or
            non-finite seqlens. TypeError: ``uids`` that is not a sequence or holds unhashable ids.

    Example:
        >>> uids = ["a", "b", "c", "d", "a", "b", "c", "d"]  # 4 prompts, 2 responses each
        >>> parts, perm = balance_groups_by_seqlen([9, 1, 8, 2, 9, 1, 8, 2], uids, k=2)
        >>> [sorted({uids[i] for i in p}) for p in parts]
        [['a', 'b'], ['c', 'd']]
        >>> perm.tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    weights = _as_weights(seqlens)
    groups = _group_rows(uids, len(weights))
    if len(groups) < k:
        raise ValueError(
            f"cannot balance {len(groups)} groups (distinct uids) into k={k} partitions without splitting a "
            "group: need at least k groups"
        )
    if equal_size and len(groups) % k != 0:
        raise ValueError(
            f"equal_size=True needs the number of groups divisible by k, got {len(groups)} groups (distinct uids) "
            f"and k={k}; pass equal_size=False or change the number of prompts"
        )
    group_weights = [math.fsum(weights[i] for i in rows) for rows in groups]
    partitions = [
        sorted(i for g in group_ids for i in groups[g])
        for group_ids in _best_partitions(group_weights, k, equal_size)
    ]
    partitions.sort(key=lambda p: (p[0] if p else len(weights), len(p)))
    permutation = torch.tensor([i for p in partitions for i in p], dtype=torch.int64)
    return partitions, permutation
