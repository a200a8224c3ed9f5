"""Group-baseline outcome advantages: RLOO, REINFORCE++-baseline, OPO and GPG.

They share the group semantics documented in :mod:`ppo_core.advantages.grpo` (scores summed over all positions,
rows without a valid token excluded from the statistics and given 0, exact zeros on masked tokens, NaN/inf rewards
rejected). A group of one row always uses baseline 0, so its advantage is its raw score.
"""

from __future__ import annotations

import torch

from ppo_core.advantages._common import IndexLike, broadcast_rows, check_scalar, no_grad, prepare_outcome
from ppo_core.advantages._groups import GroupIndex, group_count, group_stats, group_weighted_mean
from ppo_core.kernels.whiten import whiten_valid

__all__ = [
    "compute_gpg_advantage",
    "compute_opo_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_rloo_advantage",
    "opo_rows",
    "reinforce_pp_baseline_rows",
]


def _keep_valid(per_row: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, per_row, torch.zeros_like(per_row))


@no_grad
def compute_rloo_advantage(
    rewards: torch.Tensor, response_mask: torch.Tensor, index: IndexLike
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., 2024): score minus the mean of the *other* rows of the group.

    ``a_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_g)`` for ``n >= 2``. A singleton group gets its raw
    score ``s_i`` (baseline 0): verl's loop version does this while its vectorized version returns 0
    (verl issue #7793); we pick the raw score so ``rollout.n = 1`` still trains and RLOO agrees with
    GRPO's and the other estimators' singleton convention.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` (equal), dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[1.0], [0.0], [0.0], [0.7]])
        >>> compute_rloo_advantage(r, torch.ones(4, 1), ["p", "p", "p", "q"])[0].squeeze(-1)
        tensor([ 1.0000, -0.5000, -0.5000,  0.7000])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    stats = group_stats(scores, groups, valid)
    n = stats.count[groups.ids]
    per_row = torch.where(n > 1, stats.centred * n / (n - 1).clamp(min=1), scores)
    advantages = broadcast_rows(_keep_valid(per_row, valid), mask, rewards.dtype)
    return advantages, advantages.clone()


@no_grad
def compute_reinforce_pp_baseline_advantage(
    rewards: torch.Tensor, response_mask: torch.Tensor, index: IndexLike
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``s_i - mean_g`` on every valid token, then whitened over the batch's valid tokens.

    The whitening is token-weighted (long responses weigh more), as in verl. With 0 or 1 valid tokens in the batch
    the advantages are 0 (verl raises ``ValueError``). ``returns`` equals ``advantages``.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[1.0], [0.0]])
        >>> compute_reinforce_pp_baseline_advantage(r, torch.ones(2, 1), [3, 3])[0].squeeze(-1)
        tensor([ 0.7071, -0.7071])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    centred = broadcast_rows(reinforce_pp_baseline_rows(scores, valid, groups), mask, rewards.dtype)
    advantages = whiten_valid(centred, mask)
    return advantages, advantages.clone()


def reinforce_pp_baseline_rows(scores: torch.Tensor, valid: torch.Tensor, groups: GroupIndex) -> torch.Tensor:
    """REINFORCE++-baseline's ``[B]`` float64 per-row values before the broadcast and the whitening: ``s_i -
    mean_g`` (the raw score in a group of one), 0 for a row without a valid token. ``scores``, ``valid`` and
    ``groups`` as :func:`~ppo_core.advantages._common.prepare_outcome` returns them."""
    stats = group_stats(scores, groups, valid)
    return _keep_valid(torch.where(stats.count[groups.ids] > 1, stats.centred, scores), valid)


@no_grad
def compute_opo_advantage(
    rewards: torch.Tensor, response_mask: torch.Tensor, index: IndexLike
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., 2025): score minus the length-weighted group mean ``sum(L_j s_j) / sum(L_j)``.

    ``L_j`` is the number of valid tokens of row ``j`` (own row included). Singleton groups use baseline 0. Rows
    with no valid token have weight 0, so a group of only empty rows gives 0 instead of verl's 0/0 = NaN.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` (equal), dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> compute_opo_advantage(r, m, [0, 0])[0][:, 0]
        tensor([ 0.2500, -0.7500])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    per_row = opo_rows(scores, valid, mask.sum(dim=-1), groups)
    advantages = broadcast_rows(per_row, mask, rewards.dtype)
    return advantages, advantages.clone()


def opo_rows(
    scores: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, groups: GroupIndex
) -> torch.Tensor:
    """OPO's ``[B]`` float64 per-row values before the broadcast: ``s_i`` minus the length-weighted group mean (the
    raw score in a group of one valid row), 0 for a row without a valid token. ``scores``, ``valid`` and ``groups``
    as :func:`~ppo_core.advantages._common.prepare_outcome` returns them; ``lengths``: ``[B]`` valid tokens a row
    (any numeric dtype: whole numbers, exact in float64)."""
    _, centred = group_weighted_mean(scores, groups, lengths.to(torch.float64))
    per_row = torch.where(group_count(groups, valid)[groups.ids] > 1, centred, scores)
    return _keep_valid(per_row, valid)


@no_grad
def compute_gpg_advantage(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    f_norm: float = 1.0,
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., 2025): ``alpha * (s_i - mean_g) / f_norm``.

    ``alpha`` defaults to ``B_valid / max(#{rows with s_i != 0}, 1)`` over the rows with a valid token, which
    rescales the batch gradient for the rows that carry no signal. verl ignores an ``alpha`` argument and always
    uses this value; here an explicit ``alpha`` is honoured. ``B_valid`` counts only rows with a
    valid token (verl counts all ``B`` rows). Because ``alpha`` is batch-global, splitting a batch
    changes the advantages unless ``alpha`` is given.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row.
        f_norm: divisor, ``> 0``.
        alpha: fixed scale ``>= 0``, or None for the adaptive value above.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` (equal), dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
        >>> compute_gpg_advantage(r, torch.ones(4, 1), [0, 0, 1, 1])[0].squeeze(-1)
        tensor([ 2., -2.,  0.,  0.])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    f_norm = check_scalar("f_norm", f_norm, 0.0)
    if f_norm == 0.0:
        raise ValueError("f_norm must be > 0, got 0.0")
    stats = group_stats(scores, groups, valid)
    per_row = torch.where(stats.count[groups.ids] > 1, stats.centred, scores)
    if alpha is None:
        nonzero = (valid & (scores != 0)).sum(dtype=torch.float64)
        scale = valid.sum(dtype=torch.float64) / nonzero.clamp(min=1)
    else:
        scale = torch.tensor(check_scalar("alpha", alpha, 0.0), dtype=torch.float64, device=scores.device)
    advantages = broadcast_rows(_keep_valid(per_row * scale / f_norm, valid), mask, rewards.dtype)
    return advantages, advantages.clone()
