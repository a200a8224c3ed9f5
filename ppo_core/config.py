"""``AlgorithmConfig``: advantage estimator, discounting, in-reward KL and rollout correction settings (verl's
``algorithm`` section).

Defaults are verl's (``gamma = lam = 1``: undiscounted returns over a response, the usual choice for LLM
post-training, not the 0.99 / 0.95 of control tasks). The policy-loss knobs live in
:class:`ppo_core.losses.PolicyLossConfig` and the KL controller's in :class:`ppo_core.kl_control.KLConfig`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from ppo_core._checks import check_choice, check_positive, check_unit_interval
from ppo_core._config_base import ConfigBase
from ppo_core.kl_control import KLConfig
from ppo_core.rollout_correction.config import RolloutCorrectionConfig

__all__ = ["IN_REWARD_KL_ESTIMATORS", "AlgorithmConfig", "InRewardKLEstimator"]

InRewardKLEstimator = Literal[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
]
"""KL estimators usable for the in-reward penalty: every :data:`ppo_core.kl.KL_ESTIMATORS` name but ``full``
and ``full+``, because the penalty only sees the log-probs of the sampled tokens, not the full logits."""

IN_REWARD_KL_ESTIMATORS: tuple[str, ...] = typing.get_args(InRewardKLEstimator)
"""The values of :data:`InRewardKLEstimator` as a tuple."""


@dataclass(kw_only=True)
class AlgorithmConfig(ConfigBase):
    """Algorithm-level settings: which advantage estimator, its discounting, and the KL penalty in the reward.

    Example:
        >>> cfg = AlgorithmConfig.from_dict({"adv_estimator": "grpo", "kl_ctrl": {"type": "adaptive"}})
        >>> cfg.kl_ctrl.type, cfg.gamma
        ('adaptive', 1.0)
        >>> AlgorithmConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    adv_estimator: str = "gae"
    """Advantage estimator name in the registry (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ...)."""
    gamma: float = 1.0
    """Discount factor in [0, 1] (GAE and REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda in [0, 1] (bias/variance trade-off of the advantage)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group standard deviation; False gives Dr.GRPO (mean-centred only)."""
    adv_std_epsilon: float = 1e-6
    """Added to the group standard deviation by ``grpo`` / ``grpo_passk`` (verl's 1e-6; TRL's GRPOTrainer uses
    1e-4)."""
    use_kl_in_reward: bool = False
    """Subtract ``beta * KL(pi_old || pi_ref)`` from the token rewards (:func:`ppo_core.kl_control.apply_kl_penalty`)."""
    kl_penalty: InRewardKLEstimator = "kl"
    """KL estimator for the in-reward penalty, one of :data:`IN_REWARD_KL_ESTIMATORS` (verl's default: k1)."""
    kl_ctrl: KLConfig = field(default_factory=KLConfig)
    """Controller of the in-reward KL coefficient beta (fixed or adaptive)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection against the rollout/training mismatch (off by default; ``docs/semantics.md``,
    "Rollout correction")."""

    def __post_init__(self) -> None:
        # (field types are checked by ConfigBase before this runs)
        # imported lazily, so that ppo_core.advantages may import this module without a cycle
        from ppo_core.advantages import advantage_estimator_names

        check_choice("adv_estimator", self.adv_estimator, advantage_estimator_names())
        check_unit_interval("gamma", self.gamma)
        check_unit_interval("lam", self.lam)
        check_positive("adv_std_epsilon", self.adv_std_epsilon, allow_zero=True)
