"""Typed rollout-engine configs: each engine's build-time settings as a dataclass that checks itself once and builds
its engine.

A :class:`RolloutEngineConfig` subclass is an engine's settings (``kv_bucket``, ``cuda_graphs``...: what its
constructor fixes), checked when the config is built (``__post_init__``; an error names the dotted key, e.g.
``rollout.engine_config.kv_bucket must be >= 1``), and its :meth:`RolloutEngineConfig.build` returns the engine
for a model. The registry (:mod:`~ppo_core.rollout.registry`) maps an engine's name to its config class;
``SamplingConfig(engine=name, engine_config={...})`` holds an instance of it, and an actor worker calls
:meth:`~ppo_core.rollout.sampling.SamplingConfig.build_engine` once and reuses the engine for every step.

Built-in config classes: :class:`ReferenceEngineConfig` (here), ``HFEngineConfig``
(:mod:`ppo_core_decode.config`) and ``MegatronEngineConfig`` (:mod:`ppo_core.workers.megatron.rollout_config`);
the modules with the engines themselves are imported by ``build`` only.

This module imports nothing of the engines, so a config is checked without ``transformers`` or ``megatron``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from ppo_core._config_base import ConfigBase

if TYPE_CHECKING:
    from ppo_core.rollout.engine import RolloutEngine
    from ppo_core.rollout.sampling import SamplingConfig

__all__ = ["ReferenceEngineConfig", "RolloutEngineConfig"]


@dataclass(kw_only=True)
class RolloutEngineConfig(ConfigBase):
    """The build-time settings of one rollout engine (a subclass per engine; this base has none).

    A subclass adds its settings as typed fields (each with a docstring: ``ppo-core config`` prints them), checks
    their ranges in ``__post_init__`` (under the field's name: the enclosing config prefixes the dotted path) and
    implements :meth:`build`. Register it with :func:`~ppo_core.rollout.registry.register_rollout_engine`.
    """

    name: ClassVar[str] = ""
    """The registered name (set by :func:`~ppo_core.rollout.registry.register_rollout_engine`)."""

    def build(self, model: nn.Module, sampling: SamplingConfig) -> RolloutEngine:
        """The engine for ``model`` (the actor's policy module, or the megatron actor's policy view), built once
        and then called for every batch: it must read the model's current weights on every call (or receive them
        through ``update_weights``). ``sampling`` is the sampling config it is built for: the settings an engine
        fixes at build time (``batch_invariant``) are read there; the others come with every call."""
        raise NotImplementedError(f"{type(self).__name__} must implement build(model, sampling)")

    def build_checked(self, model: nn.Module, sampling: SamplingConfig) -> RolloutEngine:
        """:meth:`build`, refusing by name what has no ``generate`` (a ``build`` that forgot its ``return``): what
        ``generate()`` and the actor workers call."""
        engine = self.build(model, sampling)
        if not callable(getattr(engine, "generate", None)):
            raise TypeError(
                f"rollout engine {self.name or type(self).__name__!r}: {type(self).__name__}.build(model, sampling) "
                f"returned {type(engine).__name__}, not a RolloutEngine (an object with "
                "generate(prompts, prompt_mask, config, *, generator))"
            )
        return engine


@dataclass(kw_only=True)
class ReferenceEngineConfig(RolloutEngineConfig):
    """``reference``: :class:`~ppo_core.rollout.engine.ModelRolloutEngine`, the simple loop of
    :func:`~ppo_core.rollout.generate.generate` (full recomputation, or the model's own ``new_cache()``). No
    settings."""

    def build(self, model: nn.Module, sampling: SamplingConfig) -> Any:
        """A :class:`~ppo_core.rollout.engine.ModelRolloutEngine` on ``model``."""
        from ppo_core.rollout.engine import ModelRolloutEngine

        return ModelRolloutEngine(model)
