"""Group-normalised outcome advantages: GRPO (Shao et al., 2024), Dr.GRPO and GRPO pass@k.

Shared group semantics (all estimators in :mod:`ppo_core.advantages.group_outcome` follow them too):

- the score of a row is the sum of its rewards over all ``T`` positions, masked ones included (as in verl's
  outcome estimators), so an outcome reward placed on a trailing observation token still counts;
- ``index`` is factorised without coercion: ``"01"`` and ``"1"`` are different groups (verl's vectorized GRPO
  merges them);
- rows without any valid token are left out of the group statistics and get advantage 0 (verl lets them into the
  mean and std), so a group's "size" below is its number of rows with a valid token;
- NaN/inf anywhere in ``rewards`` raises ``ValueError``; both outputs are exactly 0 on masked tokens.
"""

from __future__ import annotations

import torch

from ppo_core.advantages._common import IndexLike, broadcast_rows, check_scalar, no_grad, prepare_outcome
from ppo_core.advantages._groups import group_count, group_stats

__all__ = ["compute_grpo_advantage", "compute_grpo_passk_advantage"]


@no_grad
def compute_grpo_advantage(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages ``(s_i - mean_g) / (std_g + epsilon)``, or Dr.GRPO ``s_i - mean_g`` when not ``norm_by_std``.

    ``std_g`` is the unbiased (``n - 1``) standard deviation of the group's scores. A group of one row uses mean 0
    and std 1, as verl does: ``s / (1 + epsilon)``, or ``s`` for Dr.GRPO. A group of identical scores gives
    exactly 0, even with ``epsilon = 0``; statistics are float64 and centred, so ``(1, 1.00001)`` gives
    ``±0.7071`` with ``epsilon = 0`` (an uncentred float32 variance gives about ``±0.005``). The advantage is
    broadcast over the row's valid tokens; ``returns`` equals ``advantages`` (a separate tensor).

    Args:
        rewards: ``[B, T]`` floating token-level rewards (outcome score usually on the last valid token).
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row: 1-D integer tensor or a sequence of hashable ids (uuid strings...).
        norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        epsilon: added to the std, ``>= 0``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 5.0]])
        >>> adv, _ = compute_grpo_advantage(r, torch.ones(3, 2), ["a", "a", "b"], norm_by_std=False)
        >>> adv[:, -1]
        tensor([ 0.5000, -0.5000,  5.0000])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    epsilon = check_scalar("epsilon", epsilon, 0.0)
    stats = group_stats(scores, groups, valid)
    singleton = stats.count[groups.ids] == 1
    if norm_by_std:
        divisor = stats.std[groups.ids] + epsilon
        # std == 0 means every centred score is exactly 0; avoid 0/0 when epsilon is 0
        centred = stats.centred / torch.where(divisor > 0, divisor, torch.ones_like(divisor))
        per_row = torch.where(singleton, scores / (1.0 + epsilon), centred)
    else:
        per_row = torch.where(singleton, scores, stats.centred)
    advantages = broadcast_rows(torch.where(valid, per_row, torch.zeros_like(per_row)), mask, rewards.dtype)
    return advantages, advantages.clone()


@no_grad
def compute_grpo_passk_advantage(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: IndexLike,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO pass@k advantages: only the best row of each group learns, from its margin over the runner-up.

    Per group, the row with the strictly largest score gets ``(s_max - s_second) / (std_g + epsilon)`` (or the bare
    margin when not ``norm_by_std``); every other row gets 0, and a tie for the maximum gives 0 to everyone.

    Every group of ``index`` must have at least two rows (``ValueError`` otherwise, as in verl: pass@k needs
    ``n >= 2``). A group left with fewer than two rows *with a valid token* gets 0.

    Args:
        rewards: ``[B, T]`` floating token-level rewards.
        response_mask: ``[B, T]`` bool or 0/1 mask.
        index: ``[B]`` group label per row.
        norm_by_std: divide the margin by the group std.
        epsilon: added to the std, ``>= 0``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, dtype of ``rewards``.

    Example:
        >>> r = torch.tensor([[1.0], [0.0], [0.5]])
        >>> compute_grpo_passk_advantage(r, torch.ones(3, 1), [0, 0, 0], norm_by_std=False)[0]
        tensor([[0.5000],
                [0.0000],
                [0.0000]])
    """
    rewards, mask, scores, valid, groups = prepare_outcome(rewards, response_mask, index)
    epsilon = check_scalar("epsilon", epsilon, 0.0)
    rows_per_group = group_count(groups)
    if bool((rows_per_group < 2).any()):
        raise ValueError(
            "index: grpo_passk needs at least 2 rows per group (rollout n >= 2); smallest group has "
            f"{int(rows_per_group.min())} row(s)"
        )
    stats = group_stats(scores, groups, valid)
    ids = groups.ids
    neg_inf = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = torch.full((groups.num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best.scatter_reduce_(0, ids, torch.where(valid, scores, neg_inf), reduce="amax")
    is_best = valid & (scores == best[ids])
    n_best = group_count(groups, is_best)
    runner_up = torch.full_like(best, float("-inf"))
    runner_up.scatter_reduce_(0, ids, torch.where(valid & ~is_best, scores, neg_inf), reduce="amax")
    winner = is_best & (n_best[ids] == 1) & (stats.count[ids] >= 2)
    # a winner's group has a finite runner-up; elsewhere the margin is discarded
    margin = torch.where(
        winner, best[ids] - torch.where(winner, runner_up[ids], best[ids]), neg_inf.new_zeros(())
    )
    if norm_by_std:
        divisor = stats.std[ids] + epsilon
        margin = margin / torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    advantages = broadcast_rows(margin, mask, rewards.dtype)
    return advantages, advantages.clone()
