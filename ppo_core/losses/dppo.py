"""DPPO (arXiv 2602.04879): trust regions on the token probability, total variation (``dppo_tv``) or KL (``dppo_kl``).

Both compute ``L = −A · sg(min(r, c)) · log_prob · sg(valid)`` with ``r = exp(clamp(Δ, ±20))`` and
``c = config.clip_ratio_c`` (3.0 by default; verl's 20.0 fallback only applies to configs without the
key; None: no truncation, ``c = ∞``), where ``valid`` says the token is still inside the trust region (``ε_lo``/``ε_hi`` are divergence thresholds
here, not ratio bounds). ``A = 0`` uses the negative-advantage branch. The loss *value* is ``−A r̃ log p``, not a
surrogate of ``r``. Metrics: ``pg_clipfrac = mean(1 − valid)``, ``pg_clipfrac_lower = mean([r > c] ∧ valid)``,
``ppo_kl``.
"""

from __future__ import annotations

import math

import torch

from ppo_core.losses._common import _LossInputs, _policy_loss

__all__ = ["dppo_kl_policy_loss", "dppo_tv_policy_loss"]

_BINARY_KL_EPS = 1e-8
"""Keeps ``log((1 − p_old) / (1 − p))`` finite when a probability is 1 (verl's value)."""


def _dppo_loss(inp: _LossInputs, valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inp.log_ratio()).detach()
    c = math.inf if inp.config.clip_ratio_c is None else inp.config.clip_ratio_c
    truncated = ratio.clamp(max=c)
    per_token = -inp.adv * truncated * inp.new * valid.to(inp.new.dtype)
    metrics = {
        "pg_clipfrac": inp.mean(~valid),
        "pg_clipfrac_lower": inp.mean((ratio > c) & valid),
        "ppo_kl": inp.ppo_kl(),
    }
    return inp.aggregate(per_token), metrics


@_policy_loss("dppo_tv")
def dppo_tv_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO with a total-variation trust region: ``valid = p − p_old ≤ ε_hi`` if ``A > 0`` else ``≥ −ε_lo``.

    ``p = exp(log_prob)``, ``p_old = exp(old_log_prob)``; see the module docstring for the loss.

    Example:
        >>> old = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> new = torch.log(torch.tensor([[0.6, 0.9]]))  # the second token left the region (0.4 > 0.2)
        >>> loss, m = dppo_tv_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2))
        >>> m["pg_clipfrac"]
        tensor(0.5000)
    """
    diff = (torch.exp(inp.new) - torch.exp(inp.old)).detach()
    valid = torch.where(inp.adv > 0, diff <= inp.config.eps_high, diff >= -inp.config.eps_low)
    return _dppo_loss(inp, valid)


@_policy_loss("dppo_kl")
def dppo_kl_policy_loss(inp: _LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO with a binary-KL trust region on the sampled token's probability.

    ``D = p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8))``;
    ``valid = (D ≤ ε_hi) ∨ (p ≤ p_old)`` if ``A > 0`` else ``(D ≤ ε_lo) ∨ (p ≥ p_old)``: moving back towards the
    old policy is always allowed. See the module docstring for the loss.

    Example:
        >>> old = torch.log(torch.tensor([[0.5]]))
        >>> loss, m = dppo_kl_policy_loss(old, torch.log(torch.tensor([[0.99]])), torch.ones(1, 1), torch.ones(1, 1))
        >>> m["pg_clipfrac"]  # D ≈ 1.27 > 0.2
        tensor(1.)
    """
    new = inp.new.detach()
    p, p_old = torch.exp(new), torch.exp(inp.old)
    div = p_old * (inp.old - new) + (1 - p_old) * torch.log(
        (1 - p_old + _BINARY_KL_EPS) / (1 - p + _BINARY_KL_EPS)
    )
    cfg = inp.config
    valid = torch.where(
        inp.adv > 0, (div <= cfg.eps_high) | (p <= p_old), (div <= cfg.eps_low) | (p >= p_old)
    )
    return _dppo_loss(inp, valid)
