"""Sequence-level importance ratios: GSPO (``gspo``) and GMPO's geometric mean (``geo_mean``)."""

from __future__ import annotations

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss
from ppo_core.losses.aggregation import _aggregate

__all__ = ["geo_mean_policy_loss", "gspo_policy_loss"]


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over valid tokens, ``[B, T] -> [B, 1]`` (0 on an all-masked row); masked entries are 0."""
    return values.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).to(values.dtype).clamp(min=1)


@_policy_loss("gspo")
def gspo_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO clipping of the length-normalised sequence ratio.

    With ``Δ̄_i`` the mean over valid tokens of row ``i`` of ``clamp(log_prob − old_log_prob, ±20)``::

        s_{i,t} = exp(log_prob_t − sg(log_prob_t) + sg(Δ̄_i))   # value: sequence ratio; gradient: ∇log_prob_t
        L = max(−A·s, −A·clip(s, 1 − ε_lo, 1 + ε_hi))        (× rollout_is_weights) → agg_loss

    ``loss_agg_mode`` is honoured, as in verl 0.9.1 (pass ``seq-mean-token-mean`` for the paper's sequence-level
    objective, which is also the default of verl's function). Deviation from verl: the sequence
    log-ratio is bounded by the ±20 token clamp (verl clamps it at +10 only). Metrics: ``pg_clipfrac``, ``ppo_kl``.

    Example:
        >>> old = torch.zeros(1, 2)
        >>> loss, m = gspo_policy_loss(old, old + 0.3, torch.ones(1, 2), torch.ones(1, 2),
        ...                            loss_agg_mode="seq-mean-token-mean")
        >>> loss  # exp(0.3) > 1.2 is clipped: −1.2
        tensor(-1.2000)
    """
    cfg, adv = inp.config, inp.adv
    seq_log_ratio = _row_mean(inp.log_ratio().detach(), inp.mask)
    ratio = torch.exp(inp.new - inp.new.detach() + seq_log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    metrics = {"pg_clipfrac": inp.mean(loss2 > loss1), "ppo_kl": inp.ppo_kl()}
    return inp.aggregate(torch.maximum(loss1, loss2)), metrics


@_policy_loss("geo_mean", forced_agg_mode="seq-mean-token-sum")
def geo_mean_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): geometric mean of token-clipped ratios per sequence.

    With ``Δ = clamp(log_prob − old_log_prob, ±20)``, ``Δ* = min(Δ, ε_hi)`` where ``A > 0``, ``max(Δ, −ε_lo)``
    where ``A < 0`` and 0 where ``A = 0``; per row ``i`` with ``n_i`` valid tokens::

        L_i = −mean_t(A) · exp(mean_t(Δ*)) · exp(mean_t(log(w + 1e-10)))   (w: rollout_is_weights, default 1)
        loss = Σ_i L_i / G · dp_size      (G = global_batch_size, default: rows with a valid token)

    ``loss_agg_mode``, ``batch_num_tokens`` and ``loss_scale_factor`` are ignored: the objective is a mean over
    sequences (as in verl, which also ignores them). Unlike verl, ``dp_size`` and ``global_batch_size``
    are honoured, so micro-batch losses sum to the mini-batch loss, and locally all-masked rows do not count in
    ``G`` (verl takes the plain mean over all rows). Metrics: ``pg_clipfrac`` (``Δ`` outside ``[−ε_lo, ε_hi]``
    with ``A > 0``), ``pg_clipfrac_lower`` (same with ``A < 0``), ``ppo_kl``.

    Example:
        >>> old = torch.zeros(1, 2)
        >>> loss, _ = geo_mean_policy_loss(old, old + torch.tensor([[0.1, 0.5]]), torch.ones(1, 2),
        ...                                torch.ones(1, 2))
        >>> round(loss.item(), 4)  # −exp((0.1 + 0.2) / 2)
        -1.1618
    """
    cfg, adv, mask = inp.config, inp.adv, inp.mask
    log_ratio = inp.log_ratio()
    clipped_log_ratio = torch.where(
        adv > 0,
        log_ratio.clamp(max=cfg.eps_high),
        torch.where(adv < 0, log_ratio.clamp(min=-cfg.eps_low), torch.zeros_like(log_ratio)),
    )
    log_seq_ratio = _row_mean(clipped_log_ratio, mask)
    if inp.is_weights is not None:
        log_w = torch.where(mask, torch.log(inp.is_weights + 1e-10), torch.zeros_like(inp.is_weights))
        log_seq_ratio = log_seq_ratio + _row_mean(log_w, mask)
    seq_loss = -_row_mean(adv, mask) * torch.exp(log_seq_ratio)
    # Spread L_i over its n_i valid tokens so that agg_loss's seq-mean-token-sum gives Σ_i L_i / G with the same
    # global-denominator semantics as every other loss.
    per_token = seq_loss / mask.sum(dim=-1, keepdim=True).to(seq_loss.dtype).clamp(min=1)
    per_token = torch.where(mask, per_token.expand_as(log_ratio), torch.zeros_like(log_ratio))
    loss = _aggregate(per_token, mask, **inp.agg)  # seq-mean-token-sum (forced above)
    outside = (log_ratio < -cfg.eps_low) | (log_ratio > cfg.eps_high)
    metrics = {
        "pg_clipfrac": inp.mean(outside & (adv > 0)),
        "pg_clipfrac_lower": inp.mean(outside & (adv < 0)),
        "ppo_kl": inp.ppo_kl(),
    }
    return loss, metrics
