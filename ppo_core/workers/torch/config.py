"""Configs of the torch workers: the PPO settings (:mod:`ppo_core.workers.config`) plus the device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ppo_core._checks import FieldValueError
from ppo_core.workers.config import ModelSource, PPOActorConfig, PPOCriticConfig

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
    hf_checkpoint: str | None = None
    """The checkpoint the run's models start from (the policy, and the frozen reference): set by the run
    (:meth:`resolved`), not by a job; the workers load their models through their model factory. It is part of the
    config a checkpoint saves, so that a resumed run whose ``model.path`` changed is refused
    (:data:`ppo_core.trainer.resume_config.MEANING_KEYS`): the actor's weights would come from the checkpoint and
    its KL reference from the other model."""

    RUN_KEYS: ClassVar[tuple[str, ...]] = ("hf_checkpoint",)

    def resolved(self, source: ModelSource) -> TorchActorConfig:
        """This config with ``hf_checkpoint`` set to ``source.checkpoint``."""
        return dataclasses.replace(self, hf_checkpoint=source.checkpoint)

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
    hf_checkpoint: str | None = None
    """The checkpoint the critic starts from (its body; set by the run, compared on resume as the actor's)."""

    RUN_KEYS: ClassVar[tuple[str, ...]] = ("hf_checkpoint",)

    def resolved(self, source: ModelSource) -> TorchCriticConfig:
        """This config with ``hf_checkpoint`` set to ``source.checkpoint``."""
        return dataclasses.replace(self, hf_checkpoint=source.checkpoint)
