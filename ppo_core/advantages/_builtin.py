"""Registry adapters for the built-in estimators, under verl's names (see :mod:`ppo_core.advantages.registry`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppo_core.advantages.gae import compute_gae
from ppo_core.advantages.group_outcome import (
    compute_gpg_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_rloo_advantage,
)
from ppo_core.advantages.grpo import compute_grpo_advantage, compute_grpo_passk_advantage
from ppo_core.advantages.registry import AdvantageInputs, register_advantage_estimator
from ppo_core.advantages.returns import compute_reinforce_pp_advantage, compute_remax_advantage

__all__: list[str] = []

Pair = tuple[torch.Tensor, torch.Tensor]


def _register(name: str, call: Callable[[AdvantageInputs, str], Pair]) -> None:
    """Register ``call(inputs, name)`` under ``name`` with the keyword-only calling convention."""

    def estimator(**kwargs: object) -> Pair:
        return call(AdvantageInputs(**kwargs), name)  # type: ignore[arg-type]

    estimator.__name__ = estimator.__qualname__ = f"{name}_estimator"
    estimator.__doc__ = (
        f"Registry adapter for {name!r}: keyword arguments of AdvantageInputs -> (advantages, returns)."
    )
    register_advantage_estimator(name)(estimator)


_register(
    "gae",
    lambda x, n: compute_gae(
        x.token_level_rewards,
        x.require("values", n),
        x.response_mask,
        gamma=x.gamma,
        lam=x.lam,
        whiten=x.whiten,
    ),
)
for _name, _fn in (("grpo", compute_grpo_advantage), ("grpo_passk", compute_grpo_passk_advantage)):
    _register(
        _name,
        lambda x, n, fn=_fn: fn(
            x.token_level_rewards,
            x.response_mask,
            x.require("index", n),
            norm_by_std=x.norm_by_std,
            epsilon=x.epsilon,
        ),
    )
for _name, _fn in (
    ("rloo", compute_rloo_advantage),
    ("opo", compute_opo_advantage),
    ("reinforce_plus_plus_baseline", compute_reinforce_pp_baseline_advantage),
):
    _register(_name, lambda x, n, fn=_fn: fn(x.token_level_rewards, x.response_mask, x.require("index", n)))
del _name, _fn
_register(
    "gpg",
    lambda x, n: compute_gpg_advantage(
        x.token_level_rewards, x.response_mask, x.require("index", n), f_norm=x.f_norm, alpha=x.alpha
    ),
)
_register(
    "reinforce_plus_plus",
    lambda x, n: compute_reinforce_pp_advantage(x.token_level_rewards, x.response_mask, gamma=x.gamma),
)
_register(
    "remax",
    lambda x, n: compute_remax_advantage(
        x.token_level_rewards, x.require("reward_baselines", n), x.response_mask
    ),
)
