"""Sampling settings and the per-step sampling rule: temperature, nucleus (top-p), greedy decoding.

Example:
    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> sample_from_logits(logits, temperature=0, generator=None)
    tensor([1])
    >>> sampling_log_probs(logits, torch.tensor([1]), temperature=0)  # greedy scores at temperature 1
    tensor([-0.4076])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_core._checks import FieldValueError, check_int, check_positive, check_unit_interval
from ppo_core._config_base import ConfigBase

__all__ = ["SamplingConfig", "logits_of", "sample_from_logits", "sampling_log_probs", "top_p_filter"]


@dataclass(kw_only=True)
class SamplingConfig(ConfigBase):
    """How to sample responses."""

    max_new_tokens: int = 16
    """Response length ``R``: tokens sampled per prompt (responses are padded to it)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (1 keeps all)."""
    eos_token_id: int | None = None
    """Token that ends a response (kept, with mask 1); None means every response has ``max_new_tokens`` tokens."""
    pad_token_id: int = 0
    """Token written after EOS (mask 0)."""
    use_cache: bool = True
    """Decode incrementally with the model's KV cache when it has ``new_cache()``."""

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_positive("temperature", self.temperature, allow_zero=True)
        check_unit_interval("top_p", self.top_p)
        if self.top_p == 0:
            raise FieldValueError("top_p", " must be > 0 (use temperature=0 for greedy decoding)")


def logits_of(output: object) -> torch.Tensor:
    """The logits tensor of a model output: the output itself, or its ``.logits`` (Hugging Face style)."""
    return output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]


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


def sample_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]``: greedy when ``temperature == 0``, else sampled.

    Args:
        logits: ``[B, V]`` next-token logits.
        temperature: divides the logits; 0 picks the argmax.
        top_p: nucleus mass (see :func:`top_p_filter`).
        generator: RNG on ``logits.device``; required unless decoding greedily.

    Returns:
        ``[B]`` int64 token ids.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> sample_from_logits(torch.tensor([[0.0, 9.0]]), temperature=0, generator=None)
        tensor([1])
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    if generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    probs = top_p_filter(logits.float() / temperature, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_log_probs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Log-prob of ``tokens`` under the sampling distribution ``log_softmax(logits / T)``, in fp32 or fp64.

    ``T = temperature``, except that greedy decoding (``T = 0``) scores at ``T = 1``, as ``compute_log_prob`` does.
    Top-p truncation is not applied: this is the probability the training engine computes for the same token.

    Args:
        logits: ``[B, V]`` next-token logits.
        tokens: ``[B]`` int64 token ids.
        temperature: the sampling temperature (>= 0).

    Returns:
        ``[B]`` log-probabilities (fp64 for fp64 logits, else fp32).
    """
    t = temperature if temperature > 0 else 1.0
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_p = torch.log_softmax(logits.to(dtype) / t, dim=-1)
    return log_p.gather(-1, tokens[:, None]).squeeze(-1)
