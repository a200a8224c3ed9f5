"""The PPO trainer written once: ``BasePPOTrainer`` (subclasses implement ``init_workers()``), its typed
``PPOConfig`` and its algorithm presets, checkpoints, metric tracking and a stateful prompt loader."""

from __future__ import annotations

from ppo_core.trainer.base import BasePPOTrainer
from ppo_core.trainer.checkpoint import find_intact_checkpoint, find_latest_checkpoint
from ppo_core.trainer.config import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    PPOConfig,
    RolloutConfig,
    TrainerConfig,
    start_warnings,
)
from ppo_core.trainer.data import PromptDataLoader, collate_prompts
from ppo_core.trainer.manifest import CheckpointCorruptError
from ppo_core.trainer.plot import plot_run, validation_mean, validation_reward
from ppo_core.trainer.presets import PRESETS, apply_preset
from ppo_core.trainer.resume_config import ResumeConfigError
from ppo_core.trainer.reward import RewardFunctionError, scores_to_token_level
from ppo_core.trainer.steps import assign_uids, compute_advantages, merge_generation
from ppo_core.trainer.tracking import Tracker, read_metrics_jsonl, usable_loggers
from ppo_core.trainer.worker_reward import WorkerReward

__all__ = [
    "PRESETS",
    "ActorConfig",
    "BasePPOTrainer",
    "CheckpointCorruptError",
    "CriticConfig",
    "DataConfig",
    "PPOConfig",
    "PromptDataLoader",
    "ResumeConfigError",
    "RewardFunctionError",
    "RolloutConfig",
    "Tracker",
    "TrainerConfig",
    "WorkerReward",
    "apply_preset",
    "assign_uids",
    "collate_prompts",
    "compute_advantages",
    "find_intact_checkpoint",
    "find_latest_checkpoint",
    "merge_generation",
    "plot_run",
    "read_metrics_jsonl",
    "scores_to_token_level",
    "start_warnings",
    "usable_loggers",
    "validation_mean",
    "validation_reward",
]
