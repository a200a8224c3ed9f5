"""Slow, obviously-correct float64 oracles for log-probs, entropies and KL estimators (plain Python loops).

They follow the documented conventions of :mod:`ppo_core.logprobs` and :mod:`ppo_core.kl`: ``0 · log 0 = 0``,
verl's clamps for k3. Use them to check a fast implementation on small inputs.

Example:
    >>> import torch
    >>> entropy_oracle(torch.tensor([[0.0, 0.0, float("-inf")]]))
    tensor([0.6931], dtype=torch.float64)
"""

from __future__ import annotations

import math

import torch

__all__ = ["entropy_oracle", "full_kl_oracle", "kl_penalty_oracle", "logprobs_oracle"]


def _log_softmax_row(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return [z - lse for z in row]


def _rows(logits: torch.Tensor) -> list[list[float]]:
    return logits.detach().to(torch.float64).reshape(-1, logits.shape[-1]).tolist()


def logprobs_oracle(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[..., V]``, ``[...]`` -> ``[...]`` float64 ``log softmax(logits)[label]``, one row at a time."""
    flat = labels.reshape(-1).tolist()
    out = [_log_softmax_row(row)[y] for row, y in zip(_rows(logits), flat, strict=True)]
    return torch.tensor(out, dtype=torch.float64).reshape(labels.shape)


def entropy_oracle(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``[...]`` float64 entropy ``-sum p log p`` with ``0 log 0 = 0``."""
    out = []
    for row in _rows(logits):
        out.append(-sum(math.exp(lp) * lp for lp in _log_softmax_row(row) if lp != -math.inf))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def full_kl_oracle(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` x2 -> ``[...]`` float64 ``KL(softmax(logits) || softmax(ref_logits))`` (``0 log 0/q = 0``)."""
    out = []
    for row, ref_row in zip(_rows(logits), _rows(ref_logits), strict=True):
        logp, logq = _log_softmax_row(row), _log_softmax_row(ref_row)
        out.append(sum(math.exp(a) * (a - b) for a, b in zip(logp, logq, strict=True) if a != -math.inf))
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def _k3(d: float) -> float:
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


_ORACLES = {
    "kl": lambda d: d,
    "k1": lambda d: d,
    "abs": abs,
    "mse": lambda d: 0.5 * d * d,
    "k2": lambda d: 0.5 * d * d,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty_oracle(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Element-wise float64 value of a sampled-token KL estimator (``"+"`` variants have the base's value)."""
    fn = _ORACLES[estimator.removesuffix("+")]
    pairs = zip(logprob.detach().reshape(-1).tolist(), ref_logprob.detach().reshape(-1).tolist(), strict=True)
    out = [fn(a - b) for a, b in pairs]
    return torch.tensor(out, dtype=torch.float64).reshape(logprob.shape)
