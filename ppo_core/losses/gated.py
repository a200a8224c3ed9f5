"""Losses that gate or reweight the per-token policy gradient: SAPO (``sapo``) and CISPO (``cispo``)."""

from __future__ import annotations

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss

__all__ = ["cispo_policy_loss", "sapo_policy_loss"]


@_policy_loss("sapo")
def sapo_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a smooth sigmoid gate of the ratio instead of a hard clip.

    ``r = exp(clamp(Δ, ±20))``, ``τ = tau_pos`` where ``A > 0`` else ``tau_neg``,
    ``L = −A · σ(τ(r − 1)) · 4/τ`` (× rollout_is_weights) → agg_loss. At ``r = 1`` the gate's derivative is 1, as
    for the unclipped surrogate.

    Deviation from verl: ``loss_agg_mode`` is honoured (verl 0.9.1 forces ``seq-mean-token-mean``).
    Metrics: ``ppo_kl`` (no clipping, so no clip fraction).

    Example:
        >>> old = torch.zeros(1, 1)
        >>> loss, _ = sapo_policy_loss(old, old, torch.ones(1, 1), torch.ones(1, 1))
        >>> loss  # −σ(0)·4/τ_pos = −2
        tensor(-2.)
    """
    cfg, adv = inp.config, inp.adv
    ratio = torch.exp(inp.log_ratio())
    # scalars as kernel arguments: ``new_tensor`` would copy each from the host (a synchronisation on CUDA)
    tau = torch.full_like(ratio, cfg.tau_pos).where(adv > 0, cfg.tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return inp.aggregate(-adv * gate), {"ppo_kl": inp.ppo_kl()}


@_policy_loss("cispo")
def cispo_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, detached importance ratio.

    ``r = exp(clamp(Δ, ±20))``, ``r_c = sg(clip(r, 1 − ε_lo, 1 + ε_hi))``, ``L = −r_c · A · log_prob``
    (× rollout_is_weights) → agg_loss. Every token keeps a gradient (only its weight is clipped).
    Metrics: ``pg_clipfrac = mean([r ≠ r_c])``, ``ppo_kl``.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5]]))
        >>> loss, _ = cispo_policy_loss(lp, lp, torch.ones(1, 1), torch.ones(1, 1))
        >>> round(loss.item(), 4)  # −1·1·log 0.5
        0.6931
    """
    cfg = inp.config
    ratio = torch.exp(inp.log_ratio()).detach()
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    metrics = {"pg_clipfrac": inp.mean(ratio != clipped_ratio), "ppo_kl": inp.ppo_kl()}
    return inp.aggregate(-clipped_ratio * inp.adv * inp.new), metrics
