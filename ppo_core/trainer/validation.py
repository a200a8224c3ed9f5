"""Validation: generate on the validation prompts, score, reduce with verl's metric names.

Every response contributes the variables ``reward`` (its summed token scores), ``response_length`` (tokens) and
``response_clipped`` (1 when it hit the length cap instead of ending; the mean is the training steps'
``response_length/clip_ratio``), plus the reward function's extra infos; each is reported per data source:
``val-core/{source}/acc/mean@N`` is the held-out accuracy (greedy by default), ``val-aux/{source}/format/mean@N``
the GSM8K format rate (when the scorer returns ``format``), ``val-aux/{source}/response_length/mean@N`` the mean
length. With a tokenizer, a few completions are logged as text (:mod:`ppo_core.trainer.completions`).

An empty (or missing) validation set, a reward function without extra infos, or a metric computation that yields
nothing all mean "nothing to log": the result is ``{}`` and training goes on.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensordict import TensorDictBase

from ppo_core.batch import repeat_interleave
from ppo_core.keys import KEYS
from ppo_core.metrics import flatten_validation_metrics, process_validation_metrics
from ppo_core.trainer.completions import (
    append_completions,
    completion_indices,
    completion_records,
    log_completions,
)
from ppo_core.trainer.config import RolloutConfig
from ppo_core.trainer.data import PromptDataLoader
from ppo_core.trainer.reward import RewardFn, call_reward_fn
from ppo_core.trainer.steps import assign_uids, merge_generation
from ppo_core.workers.group import WorkerGroup

__all__ = ["run_validation"]

_OWN_INFOS = ("reward", "response_length", "response_clipped")

logger = logging.getLogger(__name__)


def run_validation(
    actor_wg: WorkerGroup,
    dataset: Sequence[Mapping[str, Any]] | None,
    reward_fn: RewardFn,
    *,
    rollout: RolloutConfig,
    batch_size: int | None,
    step: int,
    seed: int,
    pad_token_id: int,
    collate_fn: Callable[[Sequence[Mapping[str, Any]]], TensorDictBase] | None,
    executor: concurrent.futures.Executor,
    tokenizer: Any = None,
    num_completions: int = 0,
    completions_file: str | None = None,
) -> dict[str, float]:
    """``val-core/...`` and ``val-aux/...`` metrics of ``dataset`` (``{}`` when there is none).

    Every prompt is answered ``rollout.val_n`` times (greedy unless ``rollout.val_do_sample``); the variable
    ``reward`` is each response's summed token scores, ``response_length`` and ``response_clipped`` its length and
    whether it hit the cap, plus every extra info the reward function returns (which must not use these names).

    Args:
        actor_wg: the group whose ``generate_sequences`` answers.
        dataset: validation prompts (mappings with ``input_ids``, ``data_source``...); None or empty: no metrics.
        reward_fn: scores the answers (see :mod:`ppo_core.trainer.reward`).
        rollout: ``val_n`` and ``val_do_sample``.
        batch_size: prompts per generation call; None: the whole dataset at once.
        step: the training step (names the uids and the reward calls).
        seed: seeds the bootstrap of the N-sample metrics.
        pad_token_id: left padding of the prompts.
        collate_fn: replaces :func:`ppo_core.trainer.data.collate_prompts`.
        executor: runs coroutine reward functions.
        tokenizer: decodes the logged completions (None: none are logged).
        num_completions: how many completions to log (the first response to each of this many fixed prompts).
        completions_file: the JSONL file the completions are appended to (None: logged only).
    """
    if dataset is None or len(dataset) == 0:
        return {}
    loader = PromptDataLoader(
        dataset,
        batch_size or len(dataset),
        shuffle=False,
        drop_last=False,
        pad_token_id=pad_token_id,
        collate_fn=collate_fn,
    )
    sources: list[str] = []
    uids: list[str] = []
    infos: dict[str, list] = {name: [] for name in _OWN_INFOS}
    extra_counts: dict[str, int] = {}
    shown = completion_indices(len(dataset), num_completions) if tokenizer is not None else []
    completions: list[dict[str, Any]] = []
    first_prompt = 0
    for i, batch in enumerate(loader):
        prompts = repeat_interleave(assign_uids(batch, f"val{step}.{i}"), rollout.val_n)
        generated = actor_wg.generate_sequences(
            prompts.select(KEYS.input_ids, KEYS.attention_mask), do_sample=rollout.val_do_sample
        )
        batch = merge_generation(prompts, generated)
        scores, extra = call_reward_fn(reward_fn, batch, step, executor).result()
        size = int(batch.batch_size[0])
        offset = len(uids)
        response_mask = batch.get(KEYS.response_mask)
        row_lengths = response_mask.sum(-1)
        infos["response_length"] += row_lengths.tolist()
        infos["response_clipped"] += (row_lengths == response_mask.shape[-1]).float().tolist()
        n_prompts = size // rollout.val_n
        here = [j for j in shown if first_prompt <= j < first_prompt + n_prompts]
        if here:
            completions += completion_records(
                batch,
                [(j - first_prompt) * rollout.val_n for j in here],
                tokenizer=tokenizer,
                step=step,
                scores=scores.sum(-1),
                extra=extra,
                indices=here,
            )
        first_prompt += n_prompts
        sources += [str(s) for s in batch.get(KEYS.data_source).tolist()]
        uids += list(batch.get(KEYS.uid).tolist())
        infos["reward"] += scores.sum(-1).tolist()
        for key, values in extra.items():
            if key in _OWN_INFOS:
                raise ValueError(f"the reward function's extra infos must not be named {key!r} (reserved)")
            column = infos.setdefault(key, [None] * offset)
            column += values
            extra_counts[key] = extra_counts.get(key, 0) + size
    partial = [k for k, n in extra_counts.items() if n != len(uids)]
    for key in partial:
        logger.warning("validation extra info %r was returned for only some batches; not logged", key)
        del infos[key]
    log_completions(completions)
    if completions and completions_file is not None:
        append_completions(completions_file, completions)
    return flatten_validation_metrics(process_validation_metrics(sources, uids, infos, seed=seed))
