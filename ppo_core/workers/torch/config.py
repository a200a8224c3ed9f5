"""Configs of the torch workers: the PPO settings (:mod:`ppo_core.workers.config`) plus the device."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_core._checks import FieldValueError
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig

__all__ = ["TorchActorConfig", "TorchCriticConfig"]


@dataclass(kw_only=True)
class TorchActorConfig(PPOActorConfig):
    """Actor (policy update), rollout (sampling) and reference settings of :class:`TorchActorWorker`.

    Example:
        >>> TorchActorConfig.from_dict({"device": "cpu", "ppo_mini_batch_size": 2}).device
        'cpu'
    """

    device: str | None = None
    """Torch device; None picks ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    exact_log_probs: bool = False
    """Exact on-policy mode: every policy log-prob (``old_log_probs``, ``ref_log_probs``, the update's) takes the
    batch-invariant rollout's values bit for bit, so ``old_log_probs == rollout_log_probs`` and PPO's ratio is 1
    before the first optimiser step; gradients are the model forward's. Needs ``rollout.batch_invariant`` and a
    Llama-family Hugging Face model (:mod:`ppo_core.workers.torch.exact`, docs/semantics.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.exact_log_probs and not self.rollout.batch_invariant:
            raise FieldValueError(
                "exact_log_probs",
                "=True needs the batch-invariant sampler: set rollout.batch_invariant=True next to it (training "
                "reproduces that sampler's numerics; the default sampler's differ)",
            )
        if self.rollout.engine == "megatron":
            raise FieldValueError(
                "rollout.engine",
                "='megatron' samples with the megatron actor's policy: it needs the megatron workers (use auto, "
                "hf or reference with the torch workers)",
            )


@dataclass(kw_only=True)
class TorchCriticConfig(PPOCriticConfig):
    """Critic settings of :class:`TorchCriticWorker`."""

    device: str | None = None
    """Torch device; None picks ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
