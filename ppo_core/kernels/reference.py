"""Per-timestep loop implementations of the masked scans: the semantics every fast path must match."""

from __future__ import annotations

import torch

__all__ = ["masked_discounted_return_scan", "masked_gae_scan"]


def masked_gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Raw (unwhitened) GAE advantages with masked tokens skipped.

    For ``t = T-1 .. 0``, with ``nextv`` and ``lastgae`` starting at 0::

        delta   = r_t + gamma * nextv - V_t
        g       = delta + gamma * lam * lastgae
        nextv   = V_t if m_t else nextv
        lastgae = g   if m_t else lastgae
        A_t     = lastgae

    Args:
        rewards, values: ``[B, T]`` floating tensors.
        mask: ``[B, T]`` bool tensor.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``[B, T]`` raw advantages (at a masked position: the value carried from the right).
    """
    batch, length = rewards.shape
    nextv = rewards.new_zeros(batch)
    lastgae = rewards.new_zeros(batch)
    out = torch.empty_like(rewards)
    for t in range(length - 1, -1, -1):
        delta = rewards[:, t] + gamma * nextv - values[:, t]
        g = delta + gamma * lam * lastgae
        m = mask[:, t]
        nextv = torch.where(m, values[:, t], nextv)
        lastgae = torch.where(m, g, lastgae)
        out[:, t] = lastgae
    return out


def masked_discounted_return_scan(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go with masked tokens skipped, zero at masked positions.

    For ``t = T-1 .. 0``, with ``run`` starting at 0::

        new = r_t + gamma * run
        G_t = new if m_t else 0
        run = new if m_t else run

    Args:
        rewards: ``[B, T]`` floating tensor.
        mask: ``[B, T]`` bool tensor.
        gamma: discount.

    Returns:
        ``[B, T]`` returns ``G`` (0 at masked positions).
    """
    batch, length = rewards.shape
    run = rewards.new_zeros(batch)
    out = torch.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        m = mask[:, t]
        new = rewards[:, t] + gamma * run
        run = torch.where(m, new, run)
        out[:, t] = torch.where(m, new, torch.zeros_like(new))
    return out
