"""``AlgorithmConfig``: advantage estimator, discounting and in-reward KL settings (verl's ``algorithm`` section).

Defaults are verl's (``gamma = lam = 1``: undiscounted returns over a response, the usual choice for LLM
post-training, not the 0.99 / 0.95 of control tasks). The policy-loss knobs live in
:class:`ppo_core.losses.PolicyLossConfig` and the KL controller's in :class:`ppo_core.kl_control.KLConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ppo_core._checks import check_choice
from ppo_core._config_base import ConfigBase
from ppo_core.kl import KL_ESTIMATORS
from ppo_core.kl_control import KLConfig

__all__ = ["IN_REWARD_KL_ESTIMATORS", "AlgorithmConfig"]

IN_REWARD_KL_ESTIMATORS: tuple[str, ...] = tuple(
    name for name in KL_ESTIMATORS if not name.startswith("full")
)
"""Estimators usable for the in-reward penalty, which only sees sampled-token log-probs (no ``"full"``)."""


def _check_adv_estimator(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"adv_estimator must be a str, got {type(name).__name__}")
    # imported lazily, so that ppo_core.advantages may import this module without a cycle
    from ppo_core.advantages import advantage_estimator_names

    check_choice("adv_estimator", name, advantage_estimator_names())


def _check_bool(name: str, value: object) -> None:
    # a YAML string such as "false" would otherwise be truthy
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_unit(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value}")


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
    use_kl_in_reward: bool = False
    """Subtract ``beta * KL(pi_old || pi_ref)`` from the token rewards (:func:`ppo_core.kl_control.apply_kl_penalty`)."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty, one of :data:`IN_REWARD_KL_ESTIMATORS` (verl's default: k1)."""
    kl_ctrl: KLConfig = field(default_factory=KLConfig)
    """Controller of the in-reward KL coefficient beta (fixed or adaptive)."""

    def __post_init__(self) -> None:
        _check_adv_estimator(self.adv_estimator)
        _check_unit("gamma", self.gamma)
        _check_unit("lam", self.lam)
        _check_bool("norm_adv_by_std_in_grpo", self.norm_adv_by_std_in_grpo)
        _check_bool("use_kl_in_reward", self.use_kl_in_reward)
        if not isinstance(self.kl_penalty, str):
            raise TypeError(f"kl_penalty must be a str, got {type(self.kl_penalty).__name__}")
        check_choice("kl_penalty", self.kl_penalty, IN_REWARD_KL_ESTIMATORS)
        if isinstance(self.kl_ctrl, Mapping):
            self.kl_ctrl = KLConfig.from_dict(self.kl_ctrl)
        elif not isinstance(self.kl_ctrl, KLConfig):
            raise TypeError(f"kl_ctrl must be a KLConfig or a dict, got {type(self.kl_ctrl).__name__}")
