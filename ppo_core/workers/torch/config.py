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

    def __post_init__(self) -> None:
        super().__post_init__()
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
