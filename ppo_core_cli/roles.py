"""A job's ``rollout``, ``actor`` and ``critic`` sections: the trainer's sections with typed worker configs and
the one place of every sampling setting.

- :class:`JobRolloutConfig`: the trainer's :class:`~ppo_core.trainer.RolloutConfig` (``n``, validation
  sampling, and the sampling of :class:`~ppo_core.rollout.sampling.SamplingConfig`: ``temperature``,
  ``max_new_tokens``, ``engine``...), one section. The actor worker's ``rollout`` is built from it
  (:meth:`JobRolloutConfig.sampling`: the checked values copied, not checked again); the EOS and padding ids come
  from the tokenizer unless set here.
- :class:`JobActorConfig` / :class:`JobCriticConfig`: ``worker`` is, once the job is built, an instance of the
  config class of the job's ``workers`` kind (:mod:`ppo_core_cli.worker_kinds`), e.g.
  :class:`~ppo_core.workers.torch.TorchActorConfig`.

Example:
    >>> JobRolloutConfig(temperature=0.7).sampling(eos_token_id=2, pad_token_id=0).temperature
    0.7
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ppo_core.rollout.sampling import SamplingConfig
from ppo_core.trainer.config import ActorConfig, CriticConfig, RolloutConfig
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig

__all__ = ["JobActorConfig", "JobCriticConfig", "JobRolloutConfig"]


@dataclass(kw_only=True)
class JobRolloutConfig(RolloutConfig):
    """Responses per prompt, validation sampling and the sampling itself: every rollout setting of a job (the
    trainer's :class:`~ppo_core.trainer.RolloutConfig`, with the EOS and padding ids from the tokenizer by
    default)."""

    eos_token_id: int | None = None
    """Token that ends a response; None: the one of ``model.eos_token`` (see :mod:`ppo_core_cli.tokens`)."""
    pad_token_id: int | None = None  # type: ignore[assignment]
    """Token written after EOS; None: the one of ``model.pad_token``."""

    def sampling(self, *, eos_token_id: int | None = None, pad_token_id: int | None = None) -> SamplingConfig:
        """The actor worker's sampling settings: this section's, with ``eos_token_id`` / ``pad_token_id`` (the
        run's, from the tokenizer) where the section leaves them None."""
        # checked once, when this section was built: the values are handed on, not checked again
        eos = eos_token_id if self.eos_token_id is None else self.eos_token_id
        pad = (
            self.pad_token_id
            if self.pad_token_id is not None
            else 0
            if pad_token_id is None
            else pad_token_id
        )
        return self.sampling_fields().with_special_tokens(eos_token_id=eos, pad_token_id=pad)

    def trainer_rollout(self, sampling: SamplingConfig | None = None) -> RolloutConfig:
        """The trainer's :class:`RolloutConfig`: this section with the sampling of ``sampling`` (the actor worker's,
        with the run's EOS and padding ids; None: :meth:`sampling` without them). Copied, not checked again."""
        out = object.__new__(RolloutConfig)
        for f in dataclasses.fields(RolloutConfig):
            object.__setattr__(out, f.name, getattr(self, f.name))
        return out.with_sampling(self.sampling() if sampling is None else sampling)


@dataclass(kw_only=True)
class JobActorConfig(ActorConfig):
    """The actor role: ranks, the KL-loss switch and the actor worker's config."""

    worker: dict[str, Any] | PPOActorConfig = field(default_factory=dict)  # type: ignore[assignment]
    """The actor worker's settings (the keys of the ``workers`` kind's actor config class: optimiser, mini-batches,
    loss...); a typed config once the job is built. Its sampling is the top-level ``rollout`` section and its
    ``use_kl_loss`` is ``actor.use_kl_loss``."""


@dataclass(kw_only=True)
class JobCriticConfig(CriticConfig):
    """The critic role: whether it runs, ranks and the critic worker's config."""

    worker: dict[str, Any] | PPOCriticConfig = field(default_factory=dict)  # type: ignore[assignment]
    """The critic worker's settings (the keys of the ``workers`` kind's critic config class); a typed config once
    the job is built."""
