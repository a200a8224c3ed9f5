"""Pure pieces of a PPO step on TensorDict batches: uids, merging generations and worker outputs, advantages.

``BasePPOTrainer`` strings these together; they are separate so that each is tested, and reusable by users who
write their own loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensordict import NonTensorStack, TensorDictBase, is_non_tensor

from ppo_core.advantages import get_advantage_estimator
from ppo_core.batch._td import _field_values, _shallow_copy
from ppo_core.config import AlgorithmConfig
from ppo_core.keys import KEYS
from ppo_core.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from ppo_core.metrics.partial import DataMetricParts, lengths_of_parts, reduce_data_metric_parts
from ppo_core.workers.traffic import controller_bytes_metrics

if TYPE_CHECKING:
    from ppo_core.trainer.config import PPOConfig

__all__ = ["assign_uids", "compute_advantages", "merge_generation", "step_end_metrics", "take_outputs"]


def assign_uids(batch: TensorDictBase, prefix: str) -> TensorDictBase:
    """A copy of ``batch`` with a non-tensor ``uid`` per prompt: ``"{prefix}:{i}"``.

    Deterministic (unlike verl's uuid4), so a resumed run groups exactly like an uninterrupted one; unique as
    long as prefixes are (the trainer uses the step number).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> assign_uids(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), "7").get("uid").tolist()
        ['7:0', '7:1']
    """
    out = _shallow_copy(batch)
    out.set(KEYS.uid, NonTensorStack.from_list([f"{prefix}:{i}" for i in range(int(batch.batch_size[0]))]))
    return out


def merge_generation(prompts: TensorDictBase, generated: TensorDictBase) -> TensorDictBase:
    """The generated batch plus the prompts' non-tensor fields (``uid``, ``data_source``, ``ground_truth``...).

    Args:
        prompts: ``[B]`` prompt rows (already repeated ``n`` times), with non-tensor fields.
        generated: ``[B]`` output of ``generate_sequences``: ``prompts`` [B, P], ``responses`` [B, R],
            ``input_ids`` [B, P+R], ``attention_mask`` [B, P+R], and ``response_mask`` [B, R] (computed from
            ``attention_mask[:, -R:]`` when missing, verl's fallback).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> p = assign_uids(TensorDict({"input_ids": torch.ones(1, 2)}, batch_size=[1]), "0")
        >>> g = TensorDict({"responses": torch.ones(1, 3), "attention_mask": torch.ones(1, 5)}, batch_size=[1])
        >>> sorted(merge_generation(p, g).keys())
        ['attention_mask', 'response_mask', 'responses', 'uid']
    """
    size = int(prompts.batch_size[0])
    if int(generated.batch_size[0]) != size:
        raise ValueError(
            f"generate_sequences returned {int(generated.batch_size[0])} rows for {size} prompts"
        )
    for key in (KEYS.responses, KEYS.attention_mask):
        if key not in generated:
            raise KeyError(f"generate_sequences output has no {key!r}; it has {sorted(generated.keys())}")
    out = _shallow_copy(generated)
    if KEYS.response_mask not in out:
        # slice from P = total - R, not from -R: with R = 0, [:, -0:] would be the whole attention mask
        start = out[KEYS.attention_mask].shape[-1] - out[KEYS.responses].shape[-1]
        out.set(KEYS.response_mask, out[KEYS.attention_mask][:, start:].clone())
    for key, value in prompts.items():
        if is_non_tensor(value) and key not in out:
            out.set(key, value)
    return out


def take_outputs(
    batch: TensorDictBase, output: TensorDictBase, keys: Sequence[str], method: str
) -> TensorDictBase:
    """``batch`` with ``keys`` copied from a worker ``output``; ``KeyError`` naming ``method`` if one is missing.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> b = TensorDict({}, batch_size=[2])
        >>> o = TensorDict({"values": torch.ones(2, 3), "other": torch.zeros(2)}, batch_size=[2])
        >>> sorted(take_outputs(b, o, ["values"], "compute_values").keys())
        ['values']
    """
    if int(output.batch_size[0]) != int(batch.batch_size[0]):
        raise ValueError(f"{method} returned {int(output.batch_size[0])} rows for {int(batch.batch_size[0])}")
    out = _shallow_copy(batch)
    for key in keys:
        if key not in output:
            raise KeyError(f"{method} must return {key!r}; it returned {sorted(output.keys())}")
        out.set(key, output.get(key))
    return out


def compute_advantages(batch: TensorDictBase, algorithm: AlgorithmConfig) -> TensorDictBase:
    """``batch`` with ``advantages`` and ``returns`` [B, R] from the registry estimator ``algorithm.adv_estimator``.

    Reads ``token_level_rewards``, ``response_mask``, ``uid`` (group index), and ``values`` /
    ``reward_baselines`` when present.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"token_level_rewards": torch.tensor([[1.0], [0.0]]), "response_mask": torch.ones(2, 1),
        ...                 "uid": NonTensorStack("g", "g")}, batch_size=[2])
        >>> compute_advantages(b, AlgorithmConfig(adv_estimator="grpo"))["advantages"].flatten()
        tensor([ 0.7071, -0.7071])
    """
    fn = get_advantage_estimator(algorithm.adv_estimator)
    kwargs = {
        "token_level_rewards": batch[KEYS.token_level_rewards],
        "response_mask": batch[KEYS.response_mask],
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
        "norm_by_std": algorithm.norm_adv_by_std_in_grpo,
        "epsilon": algorithm.adv_std_epsilon,
    }
    if KEYS.uid in batch:
        kwargs["index"] = list(batch.get(KEYS.uid).tolist())
    for arg, key in (("values", KEYS.values), ("reward_baselines", KEYS.reward_baselines)):
        if key in batch:
            kwargs[arg] = batch[key]
    advantages, returns = fn(**kwargs)
    out = _shallow_copy(batch)
    out.set(KEYS.advantages, advantages)
    out.set(KEYS.returns, returns)
    return out


def step_end_metrics(
    batch: TensorDictBase | None,
    timing: dict[str, float],
    *,
    config: PPOConfig,
    step: int,
    epoch: int,
    groups: Sequence[Any],
    parts: Sequence[DataMetricParts] | None = None,
) -> dict[str, float]:
    """The metrics every training step ends with (the by-value and the resident step alike): ``training/global_step``
    and ``training/epoch``, the batch's data metrics, the stage timings and throughput of ``timing`` (``{stage:
    seconds}``), and the controller bytes the worker ``groups`` (None entries skipped) moved since the step began.

    Args:
        batch: the step's ``[B, ...]`` batch, responses and what the step added (scores, advantages, ...).
        timing: seconds per stage (``Timer.reset()``).
        config: the run's config (whether a critic runs, the actor's world size for throughput).
        step: the global step; epoch: the epoch.
        groups: the worker groups whose traffic counters the step started (``controller_bytes_metrics``).
        parts: instead of ``batch``, the data-parallel ranks' :class:`~ppo_core.metrics.partial.DataMetricParts`
            in dp order (a resident step); ``batch`` may then be None or hold the prompts' fields only.
    """
    metrics = {"training/global_step": float(step), "training/epoch": float(epoch)}
    n_gpus = config.actor.world_size
    if parts is None:
        metrics.update(
            compute_data_metrics(
                batch, use_critic=config.use_critic, max_prompt_length=config.data.max_prompt_length
            )
        )
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughput_metrics(batch, timing, n_gpus=n_gpus))
    else:
        lengths = lengths_of_parts(parts)
        metrics.update(
            reduce_data_metric_parts(
                parts, use_critic=config.use_critic, max_prompt_length=config.data.max_prompt_length
            )
        )
        if batch is not None and KEYS.num_turns in batch:
            metrics.update(_num_turns_metrics(batch))
        metrics.update(compute_timing_metrics(None, timing, lengths=lengths))
        metrics.update(compute_throughput_metrics(None, timing, n_gpus=n_gpus, lengths=lengths))
    metrics.update(controller_bytes_metrics(*groups))
    return metrics


def _num_turns_metrics(batch: TensorDictBase) -> dict[str, float]:
    """``num_turns/{min,max,mean}`` of a batch's ``__num_turns__`` field, as the data metrics give them."""
    import torch

    from ppo_core.metrics.data import _stats

    turns = torch.tensor([float(t) for t in _field_values(batch, KEYS.num_turns)], dtype=torch.float64)
    stats = _stats("num_turns", turns, torch.ones_like(turns, dtype=torch.bool))
    return {k: stats[k] for k in ("num_turns/min", "num_turns/max", "num_turns/mean")}
