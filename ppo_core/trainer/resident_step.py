"""One PPO training step over a resident batch (``trainer.resident_batches``): the generation stays in the actor's
workers; log-probs, reference log-probs and values are added in place; rewards, the in-reward KL penalty, the
rollout correction's weights and rejection, GAE and REINFORCE++ run on the ranks holding the rows; outcome advantages go out as ``[B]`` values; the data metrics come back as
per-rank partial sums, counts, minima and maxima.

What still crosses the controller (``docs/resident-batches.md``): the prompts (by value), the generation's keys a
controller-side reward reads (fetched once, counted), ``[B]`` columns (response lengths, row sums, per-row KL,
outcome advantages) and per-rank partials (whitening moments, metric parts). Everything a worker computes from
its own rows is bit-identical to the by-value step, and so is GAE's whitening (per-row float64 partials reduced
exactly: :mod:`ppo_core.masked_moments`); what is reduced over the batch in another order (the token-level
metrics) agrees within 1e-6 relative.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, is_non_tensor

from ppo_core.advantages import get_advantage_estimator
from ppo_core.batch import repeat_interleave
from ppo_core.keys import KEYS
from ppo_core.masked_moments import Moments, RowMoments, combine_moments, reduce_row_moments
from ppo_core.metrics import Timer
from ppo_core.metrics.rollout import reduce_rollout_probs_diff
from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.rollout_correction.partial import NORM_MIN, reduce_correction_parts
from ppo_core.trainer.config import check_resident_config
from ppo_core.trainer.reward import PendingReward, call_reward_fn
from ppo_core.trainer.steps import assign_uids, merge_generation, step_end_metrics
from ppo_core.trainer.worker_reward import WorkerReward, reward_reads
from ppo_core.workers.base import get_registration
from ppo_core.workers.resident_ops import (
    EXTRA_PREFIX,
    ROW_KL,
    ROW_LENGTH,
    ROW_REWARD_SUM,
    ROW_SCORE_SUM,
    ROW_SCORES,
    ROW_VALID,
)
from ppo_core.workers.traffic import controller_bytes_metrics

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from ppo_core.rollout_correction import RolloutCorrectionConfig
    from ppo_core.trainer.base import BasePPOTrainer
    from ppo_core.workers.group import WorkerGroup
    from ppo_core.workers.resident import BatchRef

__all__ = [
    "WHITENED_OUTCOME_ESTIMATORS",
    "check_resident_config",
    "opo_outcome_rows",
    "outcome_advantages",
    "repeat_labels",
    "resident_train_step",
    "whitened_outcome_rows",
]


def resident_train_step(trainer: BasePPOTrainer, batch: TensorDictBase, epoch: int) -> dict[str, float]:
    """:meth:`BasePPOTrainer.train_step` with the batch resident in the actor's workers (see the module docstring)."""
    check_resident_config(trainer.config)
    cfg, step, timer = trainer.config, trainer.global_steps, Timer()
    actor = trainer.actor_wg
    metrics: dict[str, float] = {}
    groups = (trainer.actor_wg, trainer.ref_wg, trainer.critic_wg)
    controller_bytes_metrics(*groups)
    with timer("step"):
        seeded = assign_uids(batch, str(step))
        prompts = repeat_interleave(seeded, cfg.rollout.n)
        # the rows' group ids and data sources, read per prompt (a non-tensor column's tolist costs per row)
        uids = repeat_labels(seeded.get(KEYS.uid).tolist(), cfg.rollout.n)
        sources = repeat_labels(_data_sources(seeded), cfg.rollout.n)
        with timer("gen"):
            source = _prompt_rows(trainer, batch, prompts, step)
            ref, _ = actor.dispatch_resident("generate_sequences", source, step=step)
            if KEYS.response_mask not in ref.key_names:
                ref, _ = actor.dispatch_resident("resident_response_mask", ref, into=ref)
        with timer("reward"):
            if isinstance(trainer.reward_fn, WorkerReward):
                ref, reward = _worker_reward(actor, ref, prompts, trainer.reward_fn)
            else:
                reward = _controller_reward(trainer, ref, prompts, step)
        if cfg.rollout.old_log_probs_from_rollout or cfg.algorithm.rollout_correction.bypass_mode:
            ref = _old_from_rollout(trainer, ref)  # no log-prob pass (and no timer, as by value)
        else:
            with timer("old_log_prob"):
                ref = _compute_into(actor, actor, "compute_log_prob", ref, KEYS.old_log_probs)
                metrics.update(_old_log_prob_metrics(actor, ref))
        correction = cfg.algorithm.rollout_correction
        if correction.enabled:  # weights and rejection at the ranks; the metrics from their parts
            ref, corr_metrics = _rollout_correction(actor, ref, correction)
            metrics.update(corr_metrics)
        if cfg.use_reference:
            with timer("ref"):
                ref = _compute_into(
                    actor, trainer._reference_group(), "compute_ref_log_prob", ref, KEYS.ref_log_probs
                )
        if cfg.use_critic:
            with timer("values"):
                ref = _compute_into(actor, trainer.critic_wg, "compute_values", ref, KEYS.values)
        with timer("reward_wait"):
            scores, extra = reward.result() if isinstance(reward, PendingReward) else reward
        with timer("adv"):
            ref, valid, adv_metrics = _rewards_and_advantages(trainer, ref, uids, scores)
            metrics.update(adv_metrics)
        if (
            scores is not None and scores.dim() == 1
        ):  # placed at the last valid token: a row without one has none
            scores = torch.where(valid, scores, torch.zeros((), dtype=scores.dtype))
        metrics.update(reward_metrics_by_source(sources, scores, extra))
        if cfg.use_critic:
            with timer("update_critic"):
                critic = trainer.critic_wg
                metrics.update(critic.update_critic(_held_by(critic, "update_critic", ref, actor)))
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                policy = ref
                if correction.rollout_rs is not None:  # the losses read the mask without the rejected tokens
                    policy, _ = actor.dispatch_resident("resident_policy_view", ref, step=step)
                metrics.update(actor.update_actor(policy))
        parts = actor.gather_resident("resident_data_metric_parts", ref, cfg.use_critic)
        _end_step(step, trainer.actor_wg, trainer.ref_wg, trainer.critic_wg)
    timing = timer.reset()
    metrics.update(
        step_end_metrics(prompts, timing, config=cfg, step=step, epoch=epoch, groups=groups, parts=parts)
    )
    return metrics


def _old_from_rollout(trainer: BasePPOTrainer, ref: BatchRef) -> BatchRef:
    """``ref`` with the rollout's log-probs kept as ``old_log_probs`` at the ranks (``rollout.old_log_probs_from_
    rollout`` or ``algorithm.rollout_correction.bypass_mode``): the by-value step's tensors, without the pass."""
    if KEYS.rollout_log_probs not in ref.key_names:
        setting = (
            "algorithm.rollout_correction.bypass_mode"
            if trainer.config.algorithm.rollout_correction.bypass_mode
            else "rollout.old_log_probs_from_rollout"
        )
        raise ValueError(
            f"{setting}=True, but generate_sequences returned no {KEYS.rollout_log_probs!r}; it returned "
            f"{sorted(ref.key_names)}"
        )
    ref, _ = trainer.actor_wg.dispatch_resident(
        "resident_copy", ref, {KEYS.old_log_probs: KEYS.rollout_log_probs}, into=ref
    )
    return ref


def _rollout_correction(
    actor: WorkerGroup, ref: BatchRef, config: RolloutCorrectionConfig
) -> tuple[BatchRef, dict[str, float]]:
    """``ref`` with the rollout correction's ``rollout_is_weights`` and policy mask (``POLICY_MASK``) computed at the
    ranks, and the ``rollout_corr/*`` metrics reduced from the ranks' parts; with ``rollout_is_batch_normalize``
    the ranks divide their weights by the batch's mean, reduced exactly from their parts (the by-value bits)."""
    if KEYS.rollout_log_probs not in ref.key_names:
        raise ValueError(
            "algorithm.rollout_correction asks for importance weights or rejection, which compare the old "
            f"log-probs with the rollout's, but generate_sequences returned no {KEYS.rollout_log_probs!r}; the "
            f"batch holds {sorted(ref.key_names)}"
        )
    ref, _ = actor.dispatch_resident("resident_rollout_correction", ref, config, into=ref)
    parts = actor.gather_resident("resident_rollout_correction_parts", ref, config)
    mean, metrics = reduce_correction_parts(parts, config)
    if mean is not None and mean > NORM_MIN:
        ref, _ = actor.dispatch_resident("resident_normalize_weights", ref, mean, into=ref)
    return ref, metrics


def _compute_into(actor: WorkerGroup, group: WorkerGroup, method: str, ref: BatchRef, key: str) -> BatchRef:
    """``ref`` with ``group.method``'s output keys added in place (``key`` must be among them).

    A group sharing the actor's processes and layout (the actor itself, a colocated role) computes straight into
    the batch; another group receives the keys the method reads by a worker-to-worker reshard, and its output
    comes back the same way.
    """
    if _holds(group, ref):
        ref, _ = group.dispatch_resident(method, ref, into=ref)
    else:
        moved = group.reshard(ref, source=actor, keys=_reads(group, method, ref))
        before = set(moved.key_names)
        moved, _ = group.dispatch_resident(method, moved, into=moved)
        new = [k for k in moved.key_names if k not in before]
        back = actor.reshard(moved, source=group, keys=new)
        ref, _ = actor.dispatch_resident("resident_update", ref, back, into=ref)
    if key not in ref.key_names:
        raise KeyError(f"{method} must return {key!r}; the batch holds {list(ref.key_names)}")
    return ref


def _holds(group: WorkerGroup, ref: BatchRef) -> bool:
    return group.resident_group_id == ref.placement.group and group.layout == ref.placement.layout


def _held_by(group: WorkerGroup, method: str, ref: BatchRef, source: WorkerGroup) -> BatchRef:
    """``ref`` as ``group`` reads it for ``method``: itself, or a reshard of the keys the method reads."""
    return ref if _holds(group, ref) else group.reshard(ref, source=source, keys=_reads(group, method, ref))


def _reads(group: WorkerGroup, method: str, ref: BatchRef) -> tuple[str, ...]:
    """The keys of ``ref`` that ``group``'s ``method`` declares it reads (every key when it declares none)."""
    reg = get_registration(getattr(group.worker_cls, method, None))
    if reg is None or reg.reads is None:
        return ref.key_names
    return tuple(k for k in ref.key_names if k in (*reg.reads, *reg.may_read))


def _end_step(step: int, *groups: WorkerGroup | None) -> None:
    seen = set()
    for group in groups:
        if group is not None and group.resident_group_id not in seen:
            seen.add(group.resident_group_id)
            group.end_resident_step(step)


def _old_log_prob_metrics(actor: WorkerGroup, ref: BatchRef) -> dict[str, float]:
    """``actor/entropy`` (the token-mean of the entropies, from per-rank moments) and, when the rollout returned
    log-probs, the rollout-vs-old probability metrics (from per-rank moments and maxima)."""
    metrics: dict[str, float] = {}
    if KEYS.entropies in ref.key_names:
        parts = actor.gather_resident("resident_moments", ref, KEYS.entropies, KEYS.response_mask)
        metrics["actor/entropy"] = combine_moments(parts).mean
    if KEYS.rollout_log_probs in ref.key_names:
        metrics.update(reduce_rollout_probs_diff(actor.gather_resident("resident_probs_diff_parts", ref)))
    return metrics


def _prompt_rows(trainer: BasePPOTrainer, batch: TensorDictBase, prompts: TensorDictBase, step: int) -> Any:
    """What ``generate_sequences`` reads: a resident batch of the prompt rows, built by the ranks from ``[B]``
    dataset indices (the training prompts sent once), or, when the batch did not come from the trainer's loader
    with the default collation, the prompts by value."""
    loader, actor = trainer.train_dataloader, trainer.actor_wg
    if trainer.collate_fn is not None or loader.last_batch is not batch or loader.last_indices is None:
        return prompts.select(KEYS.input_ids, KEYS.attention_mask)
    sent = trainer.__dict__.setdefault("_resident_prompt_groups", set())
    if actor.resident_group_id not in sent:
        table = [torch.as_tensor(item["input_ids"], dtype=torch.long).reshape(-1) for item in loader.dataset]
        actor.call_all("resident_set_prompts", table)
        sent.add(actor.resident_group_id)
    rows = int(prompts.batch_size[0])
    index = torch.as_tensor(loader.last_indices, dtype=torch.int32).repeat_interleave(rows // len(batch))
    width = int(batch[KEYS.input_ids].shape[1])
    source, _ = actor.dispatch_resident(
        "resident_prompts",
        TensorDict({"index": index}, batch_size=[rows]),
        width,
        trainer.pad_token_id,
        step=step,
    )
    return source


def _worker_reward(
    actor: WorkerGroup, ref: BatchRef, prompts: TensorDictBase, reward: WorkerReward
) -> tuple[BatchRef, tuple[None, dict[str, list]]]:
    """Run a :class:`WorkerReward` on the ranks holding the rows: the token-level scores stay there; ``[B]`` row
    sums and the numeric extra infos come back (strings and None as NaN: the metrics skip them alike)."""
    fields = prompts.select(*reward.fields) if reward.fields else None
    ref, _ = actor.dispatch_resident("resident_reward", ref, fields, reward, into=ref)
    wanted = [ROW_SCORE_SUM, *(k for k in ref.key_names if k.startswith(EXTRA_PREFIX))]
    got = actor.fetch_resident(ref, wanted)
    extra = {k[len(EXTRA_PREFIX) :]: got[k].tolist() for k in wanted[1:]}
    return ref, (got[ROW_SCORE_SUM], extra)


def _controller_reward(
    trainer: BasePPOTrainer, ref: BatchRef, prompts: TensorDictBase, step: int
) -> PendingReward:
    """Start a controller-side reward on the generation keys it declares (``reads``; every key when it declares
    none), fetched once; its scores stay unplaced (``[B]`` or ``[B, R]``) until the ranks place them."""
    actor, reads = trainer.actor_wg, reward_reads(trainer.reward_fn)
    keys = ref.key_names if reads is None else reads
    fetched = actor.fetch_resident(ref, keys)
    batch = merge_generation(prompts, fetched) if reads is None else _with_fields(fetched, prompts)
    width = ref.spec(KEYS.responses).shape[0]
    return call_reward_fn(trainer.reward_fn, batch, step, trainer._executor, width=width)


def _with_fields(fetched: TensorDictBase, prompts: TensorDictBase) -> TensorDictBase:
    for key, value in prompts.items():
        if is_non_tensor(value) and key not in fetched:
            fetched.set(key, value)
    return fetched


def _rewards_and_advantages(
    trainer: BasePPOTrainer, ref: BatchRef, uids: list[Any], scores: torch.Tensor | None
) -> tuple[BatchRef, torch.Tensor, dict[str, float]]:
    """Scatter the scores (``[B]`` sequence scores, ``[B, R]`` token-level ones, or None: a worker-side reward kept
    them), shape the rewards (in-reward KL) and compute the advantages at the workers; also the ``[B]`` row
    validity (rows with a valid response token)."""
    cfg, actor = trainer.config, trainer.actor_wg
    metrics: dict[str, float] = {}
    rows = len(uids)
    if scores is None:
        sent = None
    elif scores.dim() == 1:
        sent = TensorDict({ROW_SCORES: scores}, batch_size=[rows])
    else:
        sent = TensorDict({KEYS.token_level_scores: scores}, batch_size=[rows])
    beta = None if trainer.kl_ctrl is None else float(trainer.kl_ctrl.value)
    columns = (ROW_REWARD_SUM, ROW_VALID) + ((ROW_KL,) if beta is not None else ())
    if cfg.algorithm.adv_estimator in LENGTH_ESTIMATORS:
        columns += (ROW_LENGTH,)
    ref, cols = actor.dispatch_resident(
        "resident_rewards", ref, sent, beta, cfg.algorithm.kl_penalty, into=ref, columns=columns
    )
    valid = cols[ROW_VALID]
    if beta is not None:
        current_kl = float(cols[ROW_KL].mean()) if rows else 0.0
        trainer.kl_ctrl.update(current_kl, n_steps=rows)
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    if cfg.algorithm.adv_estimator in ("gae", "reinforce_plus_plus"):
        alg = cfg.algorithm
        # one dp rank holds every row: it whitens them as the by-value step does (the same bits)
        whole = ref.placement.dp_size == 1
        if alg.adv_estimator == "gae":
            ref, _ = actor.dispatch_resident("resident_gae", ref, alg.gamma, alg.lam, whole, into=ref)
        else:  # REINFORCE++: the discounted reward-to-go, whitened over the batch's valid tokens
            ref, _ = actor.dispatch_resident("resident_reinforce_pp", ref, alg.gamma, whole, into=ref)
        if whole:
            return ref, valid, metrics
        # the estimators' whitening: per-row float64 partials in dp (= row) order, reduced exactly (the same bits
        # as the by-value step's whitening of the whole batch, whatever the dp layout)
        moments = reduce_row_moments(
            actor.gather_resident("resident_row_moments", ref, KEYS.advantages, KEYS.response_mask)
        )
        ref, _ = actor.dispatch_resident(
            "resident_whiten", ref, KEYS.advantages, KEYS.response_mask, moments, into=ref
        )
        return ref, valid, metrics
    dtype = ref.spec(KEYS.token_level_rewards).dtype
    if cfg.algorithm.adv_estimator in WHITENED_OUTCOME_ESTIMATORS:
        # REINFORCE++-baseline: per-row values broadcast at the ranks, then whitened over the tokens with the
        # moments the rows' values and lengths give (what the ranks' row partials would be)
        per_row, moments = whitened_outcome_rows(
            cols[ROW_REWARD_SUM], cols[ROW_VALID], cols[ROW_LENGTH], uids, dtype
        )
        adv = TensorDict({KEYS.advantages: per_row}, batch_size=[rows])
        ref, _ = actor.dispatch_resident(
            "resident_broadcast_rows", ref, adv, KEYS.response_mask, dtype, into=ref
        )
        ref, _ = actor.dispatch_resident(
            "resident_whiten", ref, KEYS.advantages, KEYS.response_mask, moments, (KEYS.returns,), into=ref
        )
        return ref, valid, metrics
    if cfg.algorithm.adv_estimator == "opo":  # its group baseline weighs the rows by their lengths
        per_row = opo_outcome_rows(cols[ROW_REWARD_SUM], cols[ROW_VALID], cols[ROW_LENGTH], uids)
    else:
        per_row = outcome_advantages(cols[ROW_REWARD_SUM], cols[ROW_VALID], uids, cfg.algorithm)
    adv = TensorDict({KEYS.advantages: per_row}, batch_size=[rows])
    # the estimator's returns are a copy of its advantages: made at the ranks
    ref, _ = actor.dispatch_resident(
        "resident_broadcast_rows",
        ref,
        adv,
        KEYS.response_mask,
        dtype,
        {KEYS.returns: KEYS.advantages},
        into=ref,
    )
    return ref, valid, metrics


WHITENED_OUTCOME_ESTIMATORS = ("reinforce_plus_plus_baseline",)
"""Outcome estimators whose per-row values are whitened over the batch's valid tokens."""
LENGTH_ESTIMATORS = (*WHITENED_OUTCOME_ESTIMATORS, "opo")
"""Outcome estimators that read the ``[B]`` row lengths (a token-weighted whitening, OPO's length-weighted baseline)."""


def opo_outcome_rows(
    row_rewards: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, uids: list[Any] | None
) -> torch.Tensor:
    """OPO's ``[B]`` float64 per-row values (what the ranks broadcast over each row's valid tokens) from ``[B]``
    float64 row sums of the rewards, ``[B]`` bool row validity and ``[B]`` int row lengths
    (:func:`~ppo_core.advantages.group_outcome.opo_rows`, what the estimator computes on the whole batch)."""
    from ppo_core.advantages._common import prepare_outcome
    from ppo_core.advantages.group_outcome import opo_rows

    _, _, scores, valid, groups = prepare_outcome(
        row_rewards.to(torch.float64).unsqueeze(-1), valid.bool().unsqueeze(-1), uids
    )
    return opo_rows(scores, valid, lengths, groups)


def whitened_outcome_rows(
    row_rewards: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, uids: list[Any] | None, dtype: Any
) -> tuple[torch.Tensor, Moments]:
    """REINFORCE++-baseline's ``[B]`` per-row values in ``dtype`` (what the ranks broadcast over each row's valid
    tokens) and the whitening :class:`~ppo_core.masked_moments.Moments` of the broadcast ``[B, T]`` values.

    A row broadcast from one value ``v`` of ``length`` valid tokens has the row partials ``count = length``,
    ``ref = v`` (0 for an empty row), ``total = m2 = 0`` exactly: :func:`~ppo_core.masked_moments.row_moments`
    of the broadcast rows, without them. Reduced as the by-value whitening reduces its rows, the advantages are
    the by-value ones bit for bit.

    Args:
        row_rewards: ``[B]`` float64 row sums of the rewards; valid: ``[B]`` bool rows with a valid token;
        lengths: ``[B]`` int valid tokens a row; uids: the rows' group ids; dtype: the rewards' dtype.
    """
    from ppo_core.advantages._common import prepare_outcome
    from ppo_core.advantages.group_outcome import reinforce_pp_baseline_rows

    _, _, scores, valid, groups = prepare_outcome(
        row_rewards.to(torch.float64).unsqueeze(-1), valid.bool().unsqueeze(-1), uids
    )
    per_row = reinforce_pp_baseline_rows(scores, valid, groups).to(dtype)
    count = lengths.to(torch.int64)
    ref = torch.where(count > 0, per_row.to(torch.float64), torch.zeros((), dtype=torch.float64))
    zeros = torch.zeros(len(count), dtype=torch.float64)
    moments = reduce_row_moments([RowMoments(count=count, ref=ref, total=zeros, m2=zeros.clone())])
    return per_row, moments


def outcome_advantages(
    row_rewards: torch.Tensor, valid: torch.Tensor, uids: list[Any] | None, algorithm: Any
) -> torch.Tensor:
    """``[B]`` float64 per-row advantages of an outcome estimator (``algorithm.adv_estimator``), from ``[B]``
    float64 row sums of the rewards and ``[B]`` bool row validity (a row with a valid token).

    The estimator runs on ``[B, 1]`` rewards with each row's validity as its mask, which gives its own per-row
    values; broadcasting them over the valid tokens gives its ``[B, T]`` advantages.
    """
    fn = get_advantage_estimator(algorithm.adv_estimator)
    kwargs: dict[str, Any] = {
        "norm_by_std": algorithm.norm_adv_by_std_in_grpo,
        "epsilon": algorithm.adv_std_epsilon,
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
    }
    if uids is not None:
        kwargs["index"] = uids
    advantages, _ = fn(
        token_level_rewards=row_rewards.to(torch.float64).unsqueeze(-1),
        response_mask=valid.bool().unsqueeze(-1),
        **kwargs,
    )
    return advantages[:, 0]


def repeat_labels(labels: list[Any], n: int) -> list[Any]:
    """Each of the prompts' ``labels`` ``n`` times in a row: the rows' labels after ``repeat_interleave``."""
    return [label for label in labels for _ in range(n)]


def _data_sources(batch: TensorDictBase) -> list[str]:
    from ppo_core.trainer.base import _data_sources as sources

    return sources(batch)
