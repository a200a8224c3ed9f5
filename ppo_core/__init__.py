"""ppo-core: composable, property-tested PPO building blocks for RL post-training of language models.

The math is pure functions on ``[B, T]`` tensors (``B`` responses, ``T`` response tokens); the trainer is written
once against a small backend protocol. Subpackages: ``advantages``, ``losses``, ``batch``, ``metrics``,
``workers``, ``rollout``, ``rollout_correction``, ``backends``, ``trainer``, ``models``, ``kernels``, ``testing``; batch key names in ``keys``;
with the ``hf`` extra, ``data`` (prompt datasets), ``rewards`` (rule-based scorers), ``models.hf`` (Hugging Face
checkpoints in and out) and ``examples`` (offline example data).
"""

from __future__ import annotations

from ppo_core.advantages import (
    AdvantageInputs,
    advantage_estimator_names,
    compute_gae,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
    register_advantage_estimator,
)
from ppo_core.backends import LocalWorkerGroup
from ppo_core.config import AlgorithmConfig
from ppo_core.keys import KEYS, BatchKeys
from ppo_core.kl import KL_ESTIMATORS, kl_penalty
from ppo_core.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
)
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from ppo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from ppo_core.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers import ColocatedWorker, Dispatch, Worker, WorkerGroup, WorkerSpec, register

__version__ = "0.1.0.dev0"

__all__ = [
    "KEYS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AlgorithmConfig",
    "BasePPOTrainer",
    "BatchKeys",
    "ColocatedWorker",
    "Dispatch",
    "FixedKLController",
    "KLConfig",
    "KLController",
    "LocalWorkerGroup",
    "PPOConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "__version__",
    "advantage_estimator_names",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_entropy_loss",
    "compute_gae",
    "compute_gpg_advantage",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_opo_advantage",
    "compute_policy_loss",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "compute_rollout_correction",
    "compute_value_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_names",
    "register",
    "register_advantage_estimator",
    "register_policy_loss",
]
