"""The actor and critic objectives of the PPO workers: pure functions from one micro-batch and the engine's
per-token outputs to that micro-batch's share of the mini-batch loss, and its named metrics.

``agg`` holds the mini-batch's global denominators (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``; see :func:`ppo_core.losses.agg_loss`), so the losses of all micro-batches on all
data-parallel ranks add up to the loss of the whole mini-batch; ratio metrics are divided by ``n_micro`` so that
they add up to the mean over micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.keys import KEYS
from ppo_core.kl import importance_weighted_kl, kl_penalty
from ppo_core.losses import agg_loss, compute_policy_loss, compute_value_loss
from ppo_core.masked import masked_mean
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES

__all__ = ["LossAndMetrics", "Objective", "actor_loss", "critic_loss"]

LossAndMetrics = tuple[torch.Tensor, dict[str, torch.Tensor]]
Objective = Callable[..., LossAndMetrics]
"""``objective(micro, outputs, *, agg, n_micro) -> (loss, metrics)``: :func:`actor_loss`, :func:`critic_loss`."""


def actor_loss(
    micro: TensorDictBase,
    outputs: Mapping[str, torch.Tensor],
    *,
    config: PPOActorConfig,
    agg: Mapping[str, Any],
    n_micro: int = 1,
) -> LossAndMetrics:
    """One micro-batch's share of the actor loss ``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl``.

    The policy loss is ``config.policy_loss`` (registry); the entropy and the KL (``kl_loss_type`` between the
    policy and the reference, times ``pi / pi_old`` with ``kl_loss_importance_weighted``) are aggregated with its
    ``loss_agg_mode``; ``agg`` holds the mini-batch's global
    denominators (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``).

    Args:
        micro: ``old_log_probs``, ``advantages``, ``response_mask`` ``[b, R]`` (and ``ref_log_probs`` with
            ``config.use_kl_loss``; ``rollout_is_weights``, when present, multiply the per-token policy loss).
        outputs: the policy engine's ``log_probs [b, R]`` (differentiated) and, when ``config.entropy_coeff > 0``,
            ``entropy [b, R]``.
        config: the actor's settings.
        agg: ``agg_loss`` keywords of the mini-batch.
        n_micro: micro-batches in the mini-batch (ratio metrics are divided by it).

    Returns:
        ``(loss, metrics)``: detached scalar metrics that add up over the micro-batches of a mini-batch:
        ``actor/pg_loss``, the policy loss's metrics as ``actor/<name>`` (``pg_clipfrac``, ``ppo_kl``...),
        ``actor/update_entropy`` when ``entropy_coeff > 0``, ``actor/kl_loss`` with the KL loss.
    """
    mode = config.policy_loss.loss_agg_mode
    log_probs, mask = outputs[LOG_PROBS], micro[KEYS.response_mask]
    weights = micro.get(KEYS.rollout_is_weights) if KEYS.rollout_is_weights in micro else None
    pg_loss, pg_metrics = compute_policy_loss(
        micro[KEYS.old_log_probs],
        log_probs,
        micro[KEYS.advantages],
        mask,
        config=config.policy_loss,
        rollout_is_weights=weights,
        **agg,
    )
    loss = pg_loss
    metrics = {"actor/pg_loss": pg_loss.detach()}
    if config.entropy_coeff:
        if ENTROPY not in outputs:
            raise ValueError(f"entropy_coeff={config.entropy_coeff} needs the engine's {ENTROPY!r} output")
        entropy = agg_loss(outputs[ENTROPY], mask, mode, **agg)
        loss = loss - config.entropy_coeff * entropy
        metrics["actor/update_entropy"] = entropy.detach()
    if config.use_kl_loss:
        per_token = kl_penalty(log_probs, micro[KEYS.ref_log_probs], config.kl_loss_type)
        if config.kl_loss_importance_weighted:
            per_token = importance_weighted_kl(per_token, log_probs, micro[KEYS.old_log_probs])
        kl = agg_loss(per_token, mask, mode, **agg)
        loss = loss + config.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    for name, value in pg_metrics.items():
        metrics[f"actor/{name}"] = value.detach() / n_micro
    return loss, metrics


def critic_loss(
    micro: TensorDictBase,
    outputs: Mapping[str, torch.Tensor],
    *,
    config: PPOCriticConfig,
    agg: Mapping[str, Any],
    n_micro: int = 1,
) -> LossAndMetrics:
    """One micro-batch's share of the clipped value loss (``cliprange_value`` around the rollout ``values``).

    Args:
        micro: rollout-time ``values``, regression targets ``returns`` and ``response_mask``, all ``[b, R]``.
        outputs: the value engine's ``values [b, R]`` (the predictions, differentiated).
        config: the critic's settings (``cliprange_value``, ``loss_agg_mode``).
        agg: ``agg_loss`` keywords of the mini-batch.
        n_micro: micro-batches in the mini-batch (ratio metrics are divided by it).

    Returns:
        ``(loss, metrics)`` with ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``.
    """
    vpreds, mask = outputs[VALUES], micro[KEYS.response_mask]
    vf_loss, clipfrac = compute_value_loss(
        vpreds,
        micro[KEYS.returns],
        micro[KEYS.values],
        mask,
        config.cliprange_value,
        config.loss_agg_mode,
        **agg,
    )
    return vf_loss, {
        "critic/vf_loss": vf_loss.detach(),
        "critic/vf_clipfrac": clipfrac / n_micro,
        "critic/vpred_mean": masked_mean(vpreds.detach(), mask) / n_micro,
    }
