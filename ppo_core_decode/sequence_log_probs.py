"""The log-probabilities the rollout recorded, recomputed for whole sequences bit for bit (training's exact mode).

A batch-invariant rollout engine (:class:`~ppo_core_decode.hf.HFRolloutEngine` with ``batch_invariant=True``)
computes a row's logits with the same bits whatever else is in the batch, so a full forward of a generated sequence
through the engine's own layer loop (:meth:`~ppo_core_decode.decoding.CachedRolloutEngine.sequence_logits`) gives
at every response position the logits the prefill or decode step sampled that token from. What remains is the
rule that turned those logits into ``rollout_log_probs``, applied here to all positions at once:

- on CUDA, where the decoder samples with the fused Triton rule (no top-k/top-p truncation):
  :func:`~ppo_core_decode.fused_sampling.fused_token_log_probs`, the same kernels reading the token instead of
  drawing it;
- elsewhere (the CPU): :func:`~ppo_core.rollout.sampling.sampling_log_probs`, ``log_softmax(logits / T)`` in fp32
  at the token, which is :func:`~ppo_core.rollout.sampling.sample_tokens`'s log-prob (each row reduced on its own).

CUDA with top-k/top-p truncation samples through a compiled PyTorch function whose reductions may depend on the
number of rows; :func:`sampler_log_probs` refuses it rather than return values that are only close.

Example:
    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> sampler_log_probs(logits, torch.tensor([1]), temperature=0.0)  # greedy scores at temperature 1
    tensor([-0.4076])
"""

from __future__ import annotations

import torch

from ppo_core.rollout.sampling import sampling_log_probs
from ppo_core_decode.decoding import CachedRolloutEngine
from ppo_core_decode.fused_sampling import fused_sampling_available, fused_token_log_probs

__all__ = ["sampler_log_probs", "sequence_log_probs"]


def sampler_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The log-prob the decoder records for each of ``tokens`` drawn from the matching row of ``logits`` (see the
    module docstring), each row's bits independent of the other rows.

    Args:
        logits: ``[N, V]`` next-token logits (the model dtype).
        tokens: ``[N]`` int64 token ids.
        temperature: the sampling temperature (0: greedy, scored at ``T = 1``).
        top_k, top_p: the sampling truncation (which rule sampled on CUDA; the log-prob is before truncation).

    Returns:
        ``[N]`` fp32 log-probabilities.

    Raises:
        ValueError: CUDA logits with top-k/top-p truncation (no bit-exact rule, see the module docstring).
    """
    if logits.is_cuda:
        if not fused_sampling_available(logits, top_k, top_p):
            raise ValueError(
                f"exact rollout log-probs on CUDA need the fused sampler: top_k=0 and top_p=1 and fp32/bf16/fp16 "
                f"logits with Triton (got top_k={top_k}, top_p={top_p}, {logits.dtype})"
            )
        return fused_token_log_probs(logits, tokens, temperature)
    return sampling_log_probs(logits, tokens, temperature=temperature)


@torch.no_grad()
def sequence_log_probs(
    engine: CachedRolloutEngine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``responses`` through ``engine``'s own full forward and its sampler's rule: with a
    batch-invariant engine, the ``rollout_log_probs`` it recorded when it generated them, bit for bit, whatever
    rows are computed together.

    Args:
        engine: the rollout engine (its layer loop: :meth:`~CachedRolloutEngine.sequence_logits`).
        input_ids: ``[B, P + R]`` the generated sequences (left-padded prompts, then responses).
        attention_mask: ``[B, P + R]``.
        responses: ``[B, R]`` the response tokens (the last ``R`` columns of ``input_ids``).
        temperature, top_k, top_p: the sampling settings (:func:`sampler_log_probs`).

    Returns:
        ``[B, R]`` fp32 log-probs (values at padding positions are of no use: mask them).
    """
    b, r = responses.shape
    logits = engine.sequence_logits(input_ids, attention_mask, r + 1)[:, :r]  # [B, R, V]
    flat = sampler_log_probs(
        logits.reshape(b * r, -1), responses.reshape(-1), temperature=temperature, top_k=top_k, top_p=top_p
    )
    return flat.view(b, r)
