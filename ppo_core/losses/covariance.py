"""Covariance-based entropy control (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

Both losses score each valid token by ``cov = (A − mean A)·(log_prob − mean log_prob)`` (means over valid tokens,
detached) and treat the high-covariance tokens, which drive entropy collapse, specially: ``clip_cov`` detaches the
gradient of a random subset of them, ``kl_cov`` adds a ``|Δ|`` penalty to the top ones.
"""

from __future__ import annotations

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss
from ppo_core.masked import _mean

__all__ = ["clip_cov_policy_loss", "kl_cov_policy_loss"]


def _token_covariance(inp: _LossInputs) -> torch.Tensor:
    """``[B, T]`` per-token ``(A − mean A)·(log_prob − mean log_prob)``, means over valid tokens, in float64.

    Each quantity is centred about its first valid token's value before its mean is taken
    (``x − mean x = (x − x₀) − mean(x − x₀)``): a constant advantage or log-prob then gives a covariance of exactly
    0 in any dtype, where the mean of ``n`` equal values is in general not that value (rounding noise of either
    sign, and that sign alone would decide whether a token is a candidate when a bound is 0, and ``kl_cov``'s
    order). float32 on MPS, which has no float64.
    """
    dtype = torch.float32 if inp.adv.device.type == "mps" else torch.float64
    if inp.mask.numel() == 0:
        return torch.zeros(inp.mask.shape, dtype=dtype, device=inp.adv.device)
    first = inp.mask.flatten().to(torch.uint8).argmax()  # the first valid token (index 0 when none is valid)

    def centred(values: torch.Tensor) -> torch.Tensor:
        shifted = values - values.flatten()[first]
        return shifted - _mean(shifted, inp.mask)

    return centred(inp.adv.detach().to(dtype)) * centred(inp.new.detach().to(dtype))


def _num_selected(ratio: float, n_valid: int) -> int:
    """verl's ``max(int(ratio·n), 1)``, but 0 when nothing is valid or the ratio is 0 (the feature is off)."""
    return 0 if ratio == 0 or n_valid == 0 else max(int(ratio * n_valid), 1)


@_policy_loss("clip_cov")
def clip_cov_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: the PPO clipped surrogate (no dual clip) with the gradient of random high-covariance tokens cut.

    Candidates are valid, not PPO-clipped tokens with ``clip_cov_lb < cov < clip_cov_ub``. With
    ``k = max(int(clip_cov_ratio · n_valid), 1)``, the detached tokens are the candidates (listed in row-major order)
    at ``torch.randperm(n_candidates, generator=generator)[:k]``; their loss is multiplied by 0.

    ``generator`` is **required** (verl draws from the global torch RNG). The same seed gives the same
    selection, which :func:`ppo_core.testing.loss_oracles.clip_cov_policy_loss_oracle` reproduces. The log-ratio is clamped at
    ±20 (verl does not clamp here). Metrics: ``pg_clipfrac`` is the fraction of valid tokens whose
    gradient was detached by the covariance rule (not PPO clipping, as in verl), ``ppo_kl``.

    Example:
        >>> lp = torch.zeros(1, 2)
        >>> loss, m = clip_cov_policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2),
        ...                                generator=torch.Generator().manual_seed(0))
        >>> loss
        tensor(-1.)
    """
    generator = inp.generator
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "generator must be a torch.Generator: clip_cov selects tokens at random and never uses the global RNG"
        )
    cfg, adv, mask = inp.config, inp.adv, inp.mask
    ratio = torch.exp(inp.log_ratio())
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    cov = _token_covariance(inp)
    candidates = mask & ~(loss2 > loss1) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    positions = candidates.flatten().nonzero().squeeze(-1)
    k = _num_selected(cfg.clip_cov_ratio, int(mask.sum()))
    keep = torch.ones(mask.numel(), dtype=torch.bool, device=mask.device)
    if k and positions.numel():
        perm = torch.randperm(positions.numel(), generator=generator, device=generator.device)
        keep[positions[perm[:k].to(positions.device)]] = False
    keep = keep.view_as(mask)
    per_token = torch.where(keep, torch.maximum(loss1, loss2), torch.zeros_like(loss1))
    return inp.aggregate(per_token), {"pg_clipfrac": inp.mean(~keep), "ppo_kl": inp.ppo_kl()}


@_policy_loss("kl_cov")
def kl_cov_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate ``−A·r`` plus ``ppo_kl_coef·|Δ|`` on the top-covariance tokens.

    ``r = exp(Δ)`` with ``Δ = clamp(log_prob − old_log_prob, ±20)`` (verl does not clamp here). The
    ``k = max(int(kl_cov_ratio · n_valid), 1)`` valid tokens of largest ``cov`` are penalised; ties go to the
    earlier token in row-major order (deterministic). No valid token, or ``kl_cov_ratio = 0``: no penalty.

    Metrics (a deviation from verl): ``ppo_kl`` is the signed ``mean(−Δ)`` as for every other
    loss; verl's ``ppo_kl`` here, ``mean(|Δ|)``, is reported as ``ppo_kl_abs``. ``ppo_kl_coef`` defaults to 0.1
    (verl's config default; its code fallback 1.0 does not exist here).

    Example:
        >>> lp = torch.zeros(1, 2)
        >>> loss, m = kl_cov_policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> loss
        tensor(-1.)
    """
    cfg, mask = inp.config, inp.mask
    log_ratio = inp.log_ratio()
    per_token = -inp.adv * torch.exp(log_ratio)
    k = _num_selected(cfg.kl_cov_ratio, int(mask.sum()))
    if k:
        cov = _token_covariance(inp)
        cov = torch.where(mask, cov, torch.full_like(cov, -torch.inf)).flatten()
        order = torch.sort(cov, descending=True, stable=True).indices
        penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        penalised[order[:k]] = True
        penalty = cfg.ppo_kl_coef * log_ratio.abs()
        per_token = torch.where(penalised.view_as(mask), per_token + penalty, per_token)
    metrics = {"ppo_kl": inp.ppo_kl(), "ppo_kl_abs": inp.mean(log_ratio.abs())}
    return inp.aggregate(per_token), metrics
