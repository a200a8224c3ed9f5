"""The megatron PPO workers with ``peak_memory`` and ``save_weights`` (see :mod:`ppo_core_cli.workers`); imports
megatron-core."""

from __future__ import annotations

from ppo_core.workers.megatron import MegatronActorWorker, MegatronCriticWorker
from ppo_core_cli.workers import CommandMethods

__all__ = ["MegatronActor", "MegatronCritic"]


class MegatronActor(CommandMethods, MegatronActorWorker):
    """:class:`~ppo_core.workers.megatron.MegatronActorWorker` with ``peak_memory`` and ``save_weights``."""


class MegatronCritic(CommandMethods, MegatronCriticWorker):
    """:class:`~ppo_core.workers.megatron.MegatronCriticWorker` with ``peak_memory`` and ``save_weights``."""
