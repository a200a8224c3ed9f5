"""Exact on-policy log-probs for the torch actor (``actor.worker.exact_log_probs``): the training forward's values
are the rollout's, bit for bit.

A fast rollout engine and the training forward compute the same function with other kernels, batch shapes and
roundings, so ``old_log_probs`` differ from ``rollout_log_probs`` in the last bits (bf16: in the third decimal)
and PPO's ratio is not 1 on the samples it treats as on-policy. In exact mode the values of every policy
log-prob the worker computes (``compute_log_prob``'s ``old_log_probs``, ``compute_ref_log_prob``'s
``ref_log_probs``, the update's ``log_prob``) come from the batch-invariant rollout engine's own full-sequence
forward and its sampler's log-prob rule (:func:`ppo_core_decode.sequence_log_probs.sequence_log_probs`), computed
on the micro-batch's padded rows as generated: a row's values depend on that row alone, not on the micro-batch,
its padding or packing. Hence ``old_log_probs == rollout_log_probs`` at every valid token, and at the update's
first optimiser step ``log_prob == old_log_probs``: the ratio is exactly 1.

The gradient is the model's own: the worker's usual differentiable forward runs too, and
:func:`substitute_values` puts the exact values in its place with the identity as backward (the gradient of the
plain forward's log-prob, which differs from the exact one's by the same last-bit roundings). The cost is one
batch-invariant forward per micro-batch on top of the usual ones, and the batch-invariant rollout.

Supported: Hugging Face Llama-family models (``llama``, ``mistral``, ``qwen2``, ``qwen3``) on the
:class:`~ppo_core_decode.hf.HFRolloutEngine` with ``batch_invariant=True``; on CUDA without top-k/top-p
truncation. Anything else raises ``ValueError`` naming ``actor.worker.exact_log_probs``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from ppo_core.keys import KEYS
from ppo_core.rollout.sampling import SamplingConfig

__all__ = ["LOGITS_PER_CHUNK", "ExactLogProbs", "substitute_values"]

_PATH = "actor.worker.exact_log_probs"

LOGITS_PER_CHUNK = 2**28
"""Most logits one exact forward materialises (``rows x (R + 1) x V``; 512 MiB in bf16): longer micro-batches
run as several forwards of fewer rows."""


class _Substitute(torch.autograd.Function):
    """Forward: ``values``; backward: the gradient passed to ``differentiable`` unchanged."""

    @staticmethod
    def forward(ctx: Any, differentiable: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ctx.dtype = differentiable.dtype
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def substitute_values(differentiable: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (bit for bit) with ``differentiable``'s gradient: the backward passes the incoming gradient to
    ``differentiable`` as if the output were it (a straight-through substitution; ``a + (b - a).detach()`` would
    round). Without autograd (no grad mode or nothing to differentiate) ``values`` itself.

    Args:
        differentiable: ``[...]`` the tensor whose graph receives the gradient.
        values: ``[...]`` the values to return (same shape).

    Returns:
        ``[...]`` with ``values``'s dtype and bits.

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = substitute_values(3 * x, torch.tensor([5.0, 7.0]))
        >>> y.sum().backward(); y.detach().tolist(), x.grad.tolist()
        ([5.0, 7.0], [3.0, 3.0])
    """
    if differentiable.shape != values.shape:
        raise ValueError(
            f"substitute_values: shapes differ, {tuple(differentiable.shape)} and {tuple(values.shape)}"
        )
    if not (torch.is_grad_enabled() and differentiable.requires_grad):
        return values
    return _Substitute.apply(differentiable, values)


def _unsupported(why: str) -> ValueError:
    return ValueError(f"{_PATH}=True {why}")


class ExactLogProbs:
    """The exact values of a policy engine's log-probs (see the module docstring), from a batch-invariant
    :class:`~ppo_core_decode.hf.HFRolloutEngine` on the same module.

    Args:
        rollout: the batch-invariant engine (the actor's own rollout engine, or one built on the reference model
            by :meth:`for_module`).
        sampling: the rollout's sampling settings (``rollout``): the temperature and truncation that
            decide how it computed its log-probs.

    Raises:
        ValueError: the engine is not a batch-invariant Llama-family ``HFRolloutEngine`` or the sampling settings
            have no bit-exact rule (the message names the config field).
    """

    def __init__(self, rollout: object, sampling: SamplingConfig) -> None:
        from ppo_core_decode.hf import HFRolloutEngine

        if not sampling.batch_invariant:
            raise _unsupported(
                "needs rollout.batch_invariant=True: training reproduces the batch-invariant "
                "sampler's numerics, and the default sampler's differ"
            )
        if not isinstance(rollout, HFRolloutEngine):
            raise _unsupported(
                f"needs the Hugging Face rollout engine (rollout.engine='hf' on a Llama-family "
                f"transformers model), got {type(rollout).__name__}"
            )
        if not (rollout.fast_path and rollout.batch_invariant):
            raise _unsupported(
                f"needs a Llama-family model ({type(rollout.model).__name__} is not one the engine evaluates "
                "batch-invariantly) and HFRolloutEngine(batch_invariant=True)"
            )
        if rollout.model.device.type == "cuda" and (sampling.top_k > 0 or sampling.top_p < 1.0):
            raise _unsupported(
                f"on CUDA needs rollout.top_k=0 and rollout.top_p=1.0 (got "
                f"{sampling.top_k} and {sampling.top_p}): truncated sampling has no bit-exact log-prob rule there"
            )
        self.rollout, self.sampling = rollout, sampling
        self.temperature = float(sampling.temperature)
        self.top_k, self.top_p = int(sampling.top_k), float(sampling.top_p)

    def for_module(self, module: nn.Module) -> ExactLogProbs:
        """Exact log-probs of another module of the same architecture (the frozen reference) through an engine of
        its own with this one's numerics (batch-invariant, the same projection fusion: the same GEMM shapes)."""
        from ppo_core_decode.hf import HFRolloutEngine

        fused = getattr(self.rollout._forward, "fuse_projections", True)
        try:
            engine = HFRolloutEngine(module, batch_invariant=True, fuse_projections=fused)
        except (TypeError, ValueError) as err:
            raise _unsupported(f"cannot score {type(module).__name__} exactly: {err}") from None
        return ExactLogProbs(engine, self.sampling)

    def values(self, micro: TensorDictBase) -> torch.Tensor:
        """The exact log-probs ``[b, R]`` (fp32, no gradient) of a micro-batch's ``responses`` given its
        ``input_ids``/``attention_mask`` ``[b, P + R]``: computed in chunks of rows whose ``[rows, R + 1, V]``
        logits hold at most :data:`LOGITS_PER_CHUNK` entries (each row's bits are its own, so chunking changes
        none)."""
        from ppo_core_decode.sequence_log_probs import sequence_log_probs

        ids, mask, responses = micro[KEYS.input_ids], micro[KEYS.attention_mask], micro[KEYS.responses]
        vocab = self.rollout.decoder.vocab_size
        rows = max(1, LOGITS_PER_CHUNK // ((responses.shape[1] + 1) * vocab))
        parts = [
            sequence_log_probs(
                self.rollout,
                ids[i : i + rows],
                mask[i : i + rows],
                responses[i : i + rows],
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
            )
            for i in range(0, responses.shape[0], rows)
        ]
        return torch.cat(parts) if parts else torch.zeros(responses.shape, device=responses.device)

    def __call__(self, micro: TensorDictBase, log_probs: torch.Tensor) -> torch.Tensor:
        """``log_probs [b, R]`` (the engine's differentiable ones) with the exact values in their place."""
        return substitute_values(log_probs, self.values(micro))
