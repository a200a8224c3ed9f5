"""Advantage estimators: each returns ``(advantages, returns)`` of shape ``[B, T]``, under ``torch.no_grad``.

Token-level: :func:`compute_gae`, :func:`compute_reinforce_pp_advantage`, :func:`compute_remax_advantage`.
Group outcome (need ``index``): :func:`compute_grpo_advantage` (and Dr.GRPO), :func:`compute_rloo_advantage`,
:func:`compute_reinforce_pp_baseline_advantage`, :func:`compute_opo_advantage`, :func:`compute_gpg_advantage`,
:func:`compute_grpo_passk_advantage`. By name: :func:`get_advantage_estimator` with verl's names, one calling
convention (:class:`AdvantageInputs`). Slow reference versions live in :mod:`ppo_core.testing.advantage_oracles`.
"""

from __future__ import annotations

from ppo_core.advantages import _builtin  # noqa: F401  (registers the built-in estimators)
from ppo_core.advantages.gae import compute_gae
from ppo_core.advantages.group_outcome import (
    compute_gpg_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_rloo_advantage,
)
from ppo_core.advantages.grpo import compute_grpo_advantage, compute_grpo_passk_advantage
from ppo_core.advantages.registry import (
    AdvantageInputs,
    advantage_estimator_names,
    get_advantage_estimator,
    register_advantage_estimator,
)
from ppo_core.advantages.returns import compute_reinforce_pp_advantage, compute_remax_advantage

__all__ = [
    "AdvantageInputs",
    "advantage_estimator_names",
    "compute_gae",
    "compute_gpg_advantage",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_opo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "get_advantage_estimator",
    "register_advantage_estimator",
]
