"""One GRPO training step over a resident batch (``trainer.resident_batches``): the generation stays in the actor's
workers, log-probs are added in place, outcome advantages go out as ``[B]`` values.

What still crosses the controller (``docs/resident-batches.md``, "Not done yet"): the prompts (by value), the
generation's keys the controller-side reward and the data metrics read (fetched once, counted), and the entropy
metric's ``[B, R]`` entropies when the actor returns them. What no longer does: the batch sent back to
``compute_log_prob`` and ``update_actor``, the log-probs' way back, and the ``[B, R]`` advantages (``[B]`` float64
per-row values instead, broadcast over each row's valid tokens by the workers as the estimator does). The
result is bit-identical to the by-value step: the same worker calls see the same rows, and the per-row
advantages are the estimator's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from ppo_core.advantages import get_advantage_estimator
from ppo_core.advantages._common import broadcast_rows
from ppo_core.batch import repeat_interleave
from ppo_core.keys import KEYS
from ppo_core.losses import agg_loss
from ppo_core.metrics import (
    Timer,
    rollout_probs_diff_metrics,
)
from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.trainer.config import check_resident_config
from ppo_core.trainer.reward import call_reward_fn
from ppo_core.trainer.steps import assign_uids, merge_generation, step_end_metrics
from ppo_core.workers.traffic import controller_bytes_metrics

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from ppo_core.trainer.base import BasePPOTrainer

__all__ = ["check_resident_config", "resident_train_step"]


def resident_train_step(trainer: BasePPOTrainer, batch: TensorDictBase, epoch: int) -> dict[str, float]:
    """:meth:`BasePPOTrainer.train_step` with the batch resident in the actor's workers (see the module docstring)."""
    check_resident_config(trainer.config)
    cfg, step, timer = trainer.config, trainer.global_steps, Timer()
    actor = trainer.actor_wg
    metrics: dict[str, float] = {}
    groups = (trainer.actor_wg, trainer.ref_wg, trainer.critic_wg)
    controller_bytes_metrics(*groups)
    with timer("step"):
        prompts = repeat_interleave(assign_uids(batch, str(step)), cfg.rollout.n)
        with timer("gen"):
            ref, _ = actor.dispatch_resident(
                "generate_sequences", prompts.select(KEYS.input_ids, KEYS.attention_mask), step=step
            )
            batch = merge_generation(prompts, actor.fetch_resident(ref, ref.key_names))
        with timer("reward"):
            reward = call_reward_fn(trainer.reward_fn, batch, step, trainer._executor)
        with timer("old_log_prob"):
            ref, _ = actor.dispatch_resident("compute_log_prob", ref, into=ref)
            if KEYS.old_log_probs not in ref.key_names:
                raise KeyError(
                    f"compute_log_prob must return {KEYS.old_log_probs!r}; the batch holds {ref.key_names}"
                )
            wanted = [k for k in (KEYS.entropies,) if k in ref.key_names]
            if KEYS.rollout_log_probs in batch:
                wanted.append(KEYS.old_log_probs)
            fetched = actor.fetch_resident(ref, wanted) if wanted else None
            if fetched is not None and KEYS.entropies in fetched:
                entropy = agg_loss(fetched[KEYS.entropies], batch[KEYS.response_mask], "token-mean")
                metrics["actor/entropy"] = float(entropy)
            if KEYS.rollout_log_probs in batch:
                metrics.update(
                    rollout_probs_diff_metrics(
                        batch[KEYS.rollout_log_probs], fetched[KEYS.old_log_probs], batch[KEYS.response_mask]
                    )
                )
        with timer("reward_wait"):
            scores, extra = reward.result()
        metrics.update(reward_metrics_by_source(_data_sources(batch), scores, extra))
        with timer("adv"):
            batch.set(KEYS.token_level_scores, scores.to(batch[KEYS.response_mask].device))
            batch.set(KEYS.token_level_rewards, batch[KEYS.token_level_scores])
            per_row = outcome_advantages(batch, cfg.algorithm)
            rewards = batch[KEYS.token_level_rewards]
            advantages = broadcast_rows(per_row, batch[KEYS.response_mask].bool(), rewards.dtype)
            batch.set(KEYS.advantages, advantages)
            batch.set(KEYS.returns, advantages.clone())
            rows = TensorDict({KEYS.advantages: per_row}, batch_size=[per_row.shape[0]])
            ref, _ = actor.dispatch_resident(
                "resident_broadcast_rows", ref, rows, KEYS.response_mask, rewards.dtype, into=ref
            )
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(actor.update_actor(ref))
        actor.end_resident_step(step)
    timing = timer.reset()
    metrics.update(step_end_metrics(batch, timing, config=cfg, step=step, epoch=epoch, groups=groups))
    return metrics


def outcome_advantages(batch: TensorDictBase, algorithm) -> torch.Tensor:
    """``[B]`` float64 per-row advantages of an outcome estimator, from the rows' ``[B]`` scores.

    The estimator runs on ``[B, 1]`` rewards (each row's score) with each row's validity as its mask, which gives
    its own per-row values; broadcasting them over the valid tokens gives its ``[B, T]`` advantages.
    """
    fn = get_advantage_estimator(algorithm.adv_estimator)
    scores = batch[KEYS.token_level_rewards].to(torch.float64).sum(dim=-1, keepdim=True)
    valid = batch[KEYS.response_mask].bool().any(dim=-1, keepdim=True)
    kwargs = {
        "norm_by_std": algorithm.norm_adv_by_std_in_grpo,
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
    }
    if KEYS.uid in batch:
        kwargs["index"] = list(batch.get(KEYS.uid).tolist())
    advantages, _ = fn(token_level_rewards=scores, response_mask=valid, **kwargs)
    return advantages[:, 0]


def _data_sources(batch: TensorDictBase) -> list[str]:
    from ppo_core.trainer.base import _data_sources as sources

    return sources(batch)
