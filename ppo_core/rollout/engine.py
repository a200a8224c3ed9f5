"""The rollout-engine protocol the actor workers sample through, and its first implementation.

An actor worker holds one rollout engine (a constructor argument of the actor workers) and calls
:meth:`RolloutEngine.generate` from ``generate_sequences``. After every ``update_actor`` it calls the engine's
optional ``update_weights(named_tensors)`` hook, when the engine has one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict
from torch import nn

from ppo_core.rollout.generate import reference_generate
from ppo_core.rollout.sampling import SamplingConfig

__all__ = ["ModelRolloutEngine", "RolloutEngine", "WeightReceiver", "reference_engine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of prompts.

    ``generate(prompts, prompt_mask, config, *, generator)``:

    - ``prompts``: ``[B, P]`` int64 token ids, left-padded; ``prompt_mask``: ``[B, P]`` 1 on prompt tokens, 0 on
      the padding. The actor passes them on its training engine's device.
    - ``config``: the :class:`~ppo_core.rollout.sampling.SamplingConfig` of this call (temperature 0 = greedy).
    - ``generator``: the worker's RNG on that device, saved in its checkpoints; an engine that samples must draw
      from it (or from state derived from it) so that a resumed run samples the same tokens.

    Returns a ``TensorDict`` with ``batch_size=[B]`` and verl's layout, keys from :data:`ppo_core.keys.KEYS`:
    ``prompts [B, P]`` (left-padded: as given, or moved there by the engine), ``responses [B, R]``
    (right-padded with ``config.pad_token_id``), ``input_ids [B, P+R]``, ``attention_mask [B, P+R]``, ``response_mask [B, R]`` (1 up to and including the
    first EOS) and ``rollout_log_probs [B, R]``: the log-prob of each sampled token under the sampling
    distribution ``log_softmax(logits / T)`` (``T = 1`` when greedy), before top-p truncation, 0 on masked
    positions: the quantity ``compute_log_prob`` computes for the same tokens, up to the two engines' numerics.
    ``R`` may be less than ``config.max_new_tokens`` only if every response ended. An engine may leave
    ``rollout_log_probs`` out (the trainer then refuses only the settings that read them:
    ``rollout.old_log_probs_from_rollout``, the rollout correction's bypass mode). The actor checks the keys, shapes
    and dtypes of what it gets (:func:`~ppo_core.rollout.layout.check_rollout_output`) and names the engine when
    they are wrong.
    """

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: SamplingConfig,
        *,
        generator: torch.Generator | None,
    ) -> TensorDict: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout engine that keeps its own copy of the policy weights (an inference server: vLLM, SGLang...).

    ``update_weights(named_tensors)`` receives the training engine's ``named_parameters()`` (this rank's shard
    under the training engine's parameter names) after each actor update; the engine copies or converts them.
    """

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class ModelRolloutEngine:
    """The reference loop (:func:`~ppo_core.rollout.generate.reference_generate`) on an in-process causal LM that shares its weights with the
    training engine (so it needs no ``update_weights``): recomputes every step, or decodes incrementally through
    the model's ``new_cache()`` when it has one. The model is in eval mode while sampling, then put back.

    Args:
        model: called as ``model(input_ids, attention_mask=mask)`` and returning logits ``[B, S, V]``.

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> engine = ModelRolloutEngine(TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2)))
        >>> out = engine.generate(torch.tensor([[1, 2]]), torch.ones(1, 2), SamplingConfig(max_new_tokens=3,
        ...                       temperature=0), generator=None)
        >>> out["responses"].shape, isinstance(engine, RolloutEngine)
        (torch.Size([1, 3]), True)
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: SamplingConfig,
        *,
        generator: torch.Generator | None,
    ) -> TensorDict:
        """Sample one response per prompt (see :class:`RolloutEngine`)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return reference_generate(self.model, prompts, prompt_mask, config, generator=generator)
        finally:
            self.model.train(was_training)


def reference_engine(model: nn.Module, config: SamplingConfig) -> ModelRolloutEngine:
    """Deprecated (the registry's ``reference`` entry is :class:`~ppo_core.rollout.engine_config.ReferenceEngineConfig`):
    :class:`ModelRolloutEngine` on ``model`` (``config`` fixes nothing)."""
    return ModelRolloutEngine(model)
