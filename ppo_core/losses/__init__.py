"""Losses: aggregation, the policy-loss registry (every verl loss), the value loss and the entropy bonus.

Importing this package registers the built-in policy losses: ``vanilla``, ``gspo``, ``sapo``, ``gpg``,
``clip_cov``, ``kl_cov``, ``geo_mean``, ``cispo``, ``dppo_tv``, ``dppo_kl``, ``dro``. verl's ``bypass_mode`` is not a
loss of its own and is not registered: it is ``vanilla`` with the rollout engine's log-probs as ``old_log_prob``
(its ``ppo_clip`` type) or ``gpg`` with ``rollout_is_weights`` (its ``reinforce`` type), plus importance weights and
rejection masks computed from the rollout log-probs, which ppo-core leaves to the caller (``docs/semantics.md``).

Example:
    >>> from ppo_core.losses import PolicyLossConfig, compute_policy_loss
    >>> lp = torch.zeros(2, 3)
    >>> loss, metrics = compute_policy_loss(lp, lp, torch.ones(2, 3), torch.ones(2, 3), config=PolicyLossConfig())
"""

from __future__ import annotations

from ppo_core.losses._common import LOG_RATIO_CLAMP
from ppo_core.losses.aggregation import LOSS_AGG_MODES, agg_loss
from ppo_core.losses.config import PolicyLossConfig
from ppo_core.losses.covariance import clip_cov_policy_loss, kl_cov_policy_loss
from ppo_core.losses.dppo import dppo_kl_policy_loss, dppo_tv_policy_loss
from ppo_core.losses.dro import dro_policy_loss
from ppo_core.losses.entropy import compute_entropy_loss
from ppo_core.losses.gated import cispo_policy_loss, sapo_policy_loss
from ppo_core.losses.ppo_clip import gpg_policy_loss, vanilla_policy_loss
from ppo_core.losses.registry import (
    PolicyLossFn,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from ppo_core.losses.sequence_level import geo_mean_policy_loss, gspo_policy_loss
from ppo_core.losses.value import compute_value_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "agg_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "compute_entropy_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "get_policy_loss",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "policy_loss_names",
    "register_policy_loss",
    "sapo_policy_loss",
    "vanilla_policy_loss",
]
