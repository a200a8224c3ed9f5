"""The PPO clipped surrogate with dual clip (``vanilla``), and the plain policy gradient (``gpg``)."""

from __future__ import annotations

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss

__all__ = ["gpg_policy_loss", "vanilla_policy_loss"]


@_policy_loss("vanilla")
def vanilla_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric bounds and dual clip (Schulman et al. 2017; Ye et al. 2020).

    With ``Δ = clamp(log_prob − old_log_prob, ±20)``, ``r = exp(Δ)``, ``ε_lo, ε_hi`` = ``config.eps_low/eps_high``
    and ``c = config.clip_ratio_c``::

        L1 = −A·r ;  L2 = −A·clip(r, 1 − ε_lo, 1 + ε_hi) ;  Lc = max(L1, L2)
        L  = min(Lc, −A·c) where A < 0, else Lc        (× rollout_is_weights) → agg_loss

    ``clip_ratio_c=None`` turns the dual clip off: ``L = Lc`` everywhere (the plain clipped surrogate of Schulman et
    al.; TRL's ``grpo``/``dapo``/... losses with ``delta=None``), and ``pg_clipfrac_lower`` is 0.

    The gradient is zero on tokens where the clipped branch or the dual-clip constant is active.
    Metrics: ``pg_clipfrac = mean([L2 > L1])``, ``pg_clipfrac_lower = mean([Lc > −A·c] ∧ [A < 0])``,
    ``ppo_kl = mean(−Δ)`` (the clamped log-ratio) over valid tokens.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[B, T]``; only ``log_prob`` is differentiated.
        config: :class:`PolicyLossConfig` (None: defaults). Other keywords: see :mod:`ppo_core.losses.registry`.

    Example:
        >>> old = torch.zeros(1, 2)
        >>> new = torch.log(torch.tensor([[5.0, 5.0]]))
        >>> loss, m = vanilla_policy_loss(old, new, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
        >>> loss  # (−1.2 + 3.0) / 2: upper clip, then the dual-clip constant
        tensor(0.9000)
    """
    cfg, adv = inp.config, inp.adv
    ratio = torch.exp(inp.log_ratio())
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    clipped = torch.maximum(loss1, loss2)
    if cfg.clip_ratio_c is None:
        per_token, dual_clipped = clipped, torch.zeros_like(inp.mask)
    else:
        loss3 = -adv * cfg.clip_ratio_c
        negative = adv < 0
        per_token = torch.where(negative, torch.minimum(clipped, loss3), clipped)
        dual_clipped = (clipped > loss3) & negative
    metrics = {
        "pg_clipfrac": inp.mean(loss2 > loss1),
        "pg_clipfrac_lower": inp.mean(dual_clipped),
        "ppo_kl": inp.ppo_kl(),
    }
    return inp.aggregate(per_token), metrics


@_policy_loss("gpg")
def gpg_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient of GPG (Chu et al. 2025): ``L = −A·log_prob`` (× rollout_is_weights) → agg_loss.

    ``old_log_prob`` only feeds the ``ppo_kl`` metric (verl returns no metric for this loss).

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> loss, _ = gpg_policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> round(loss.item(), 4)  # (log 2 + log 4) / 2
        1.0397
    """
    return inp.aggregate(-inp.adv * inp.new), {"ppo_kl": inp.ppo_kl()}
