"""Micro-batches by token budget: the fewest balanced groups of rows whose token counts stay within a budget.

A fixed number of rows per micro-batch lets one long response set the memory of its whole micro-batch, and leaves
micro-batches of short rows underfull. :func:`partition_by_token_budget` instead groups rows so that each group
holds at most ``max_tokens`` tokens: it starts from the lower bound on the number of groups (every row longer
than the budget alone, the others ``ceil(sum / max_tokens)``) and balances the rows into that many groups with
:func:`~ppo_core.batch.balance_by_seqlen` (Karmarkar-Karp, groups of any size), adding a group until every group
is within the budget or holds a single row. A row longer than the budget cannot be split: it gets a group of its
own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ppo_core.batch.balance import _as_weights, balance_by_seqlen

__all__ = ["partition_by_token_budget"]


def _fits(weights: list[float], part: list[int], max_tokens: float) -> bool:
    return len(part) == 1 or math.fsum(weights[i] for i in part) <= max_tokens


def partition_by_token_budget(seqlens: Sequence[float] | torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Group rows into the fewest balanced micro-batches of at most ``max_tokens`` tokens each (module docstring).

    Args:
        seqlens: ``[B]`` tokens per row (e.g. ``attention_mask.sum(-1)``), a 1-D tensor or a sequence of numbers.
        max_tokens: the budget of one micro-batch (>= 1).

    Returns:
        Lists of row indices (each ascending, the lists ordered by their smallest index) covering every row once;
        ``[]`` for no rows. Every list's total is ``<= max_tokens`` unless it is a single row.

    Raises:
        ValueError: ``max_tokens < 1``; negative or non-finite seqlens; a tensor that is not 1-D.
        TypeError: ``seqlens`` is not a tensor or a sequence of numbers.

    Example:
        >>> partition_by_token_budget([5, 1, 4, 2, 9], max_tokens=6)
        [[0, 1], [2, 3], [4]]
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    weights = _as_weights(seqlens)
    n = len(weights)
    if n == 0:
        return []
    over = sum(w > max_tokens for w in weights)
    within = math.fsum(w for w in weights if w <= max_tokens)
    for k in range(max(1, over + math.ceil(within / max_tokens)), n):
        parts = [p for p in balance_by_seqlen(weights, k, equal_size=False)[0] if p]
        if all(_fits(weights, p, max_tokens) for p in parts):
            return parts
    return [[i] for i in range(n)]
