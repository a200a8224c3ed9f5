"""Drawing the next token from logits and uniform noise: greedy, temperature, top-k, top-p (nucleus).

Sampling is the Gumbel-max trick: ``argmax(filtered_logits / T - log(-log u))`` with ``u ~ U[0, 1)`` per vocabulary
entry is an exact draw from ``softmax(filtered_logits / T)``. The noise is an input, filled by the caller from its
``torch.Generator`` (``noise.uniform_(generator=g)``), so that

- the draw is reproducible from the generator alone (no global RNG),
- the same function runs inside a captured CUDA graph (no RNG state in the graph: the noise buffer is refilled
  before each replay),
- every decoding path (full recomputation, KV-cached, graph-captured) draws the same tokens from the same logits
  and the same generator.

The log-probability returned with each token (``rollout_log_probs``) is ``log_softmax(logits / T)`` at the drawn
token, *before* top-k/top-p truncation: what :meth:`compute_log_prob` of the actor computes for the same token,
so comparing the two measures the numerical mismatch between the engines only. Greedy decoding (``T = 0``)
scores at ``T = 1``.

Example:
    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> tok, logp = sample_tokens(logits, None, temperature=0.0)
    >>> tok.tolist(), round(float(logp), 4)
    ([1], -0.4076)
    >>> g = torch.Generator().manual_seed(0)
    >>> tok, _ = sample_tokens(logits, torch.rand(1, 3, generator=g), temperature=1.0, top_k=1)
    >>> tok.tolist()
    [1]
"""

from __future__ import annotations

import torch

from ppo_core.kernels.compiled import cuda_compiled

__all__ = ["sample_tokens", "top_k_filter", "top_p_filter"]


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set to ``-inf`` every logit below the ``top_k``-th largest of its row (ties at the boundary are kept).

    Args:
        logits: ``[..., V]``.
        top_k: tokens to keep; 0 (or >= V) keeps all.

    Example:
        >>> top_k_filter(torch.tensor([1.0, 3.0, 2.0]), 2)
        tensor([-inf, 3., 2.])
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to ``-inf`` the logits outside the nucleus: the most likely tokens whose probability mass reaches ``top_p``.

    A token is kept when the mass of the strictly more likely tokens is below ``top_p``, so the most likely
    token is always kept.

    Args:
        logits: ``[..., V]``.
        top_p: in (0, 1]; 1 returns ``logits`` unchanged.

    Example:
        >>> top_p_filter(torch.tensor([2.0, 1.0, 0.0]).log(), 0.5)
        tensor([0.6931,   -inf,   -inf])
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@cuda_compiled
def _draw(
    logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature
    log_probs = scaled.log_softmax(dim=-1)
    if temperature == 0:
        tokens = scaled.argmax(dim=-1)
    else:
        filtered = top_p_filter(top_k_filter(scaled, top_k), top_p)
        gumbel = -torch.log(-torch.log(noise.float()))
        tokens = (filtered + gumbel).argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` and its log-probability at the sampling temperature.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; the maths is fp32).
        noise: ``[B, V]`` uniform noise in ``[0, 1)``; ignored (may be None) when ``temperature == 0``.
        temperature: divides the logits; 0 decodes greedily.
        top_k: keep the ``top_k`` most likely tokens (0: all).
        top_p: nucleus mass in (0, 1] (1: all).

    Returns:
        ``(tokens [B] int64, log_probs [B] float32)``; ``log_probs`` is ``log_softmax(logits / T)`` at the token
        (``T = 1`` when greedy), before truncation.

    Raises:
        ValueError: ``noise`` is missing or not ``[B, V]`` while sampling.
    """
    if temperature > 0 and (noise is None or noise.shape != logits.shape):
        got = None if noise is None else tuple(noise.shape)
        raise ValueError(f"noise must be a [B, V] = {tuple(logits.shape)} tensor when sampling, got {got}")
    return _draw(logits, noise, float(temperature), int(top_k), float(top_p))
