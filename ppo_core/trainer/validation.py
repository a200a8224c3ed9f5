"""Validation for ``BasePPOTrainer``: generate on the validation prompts, score, reduce with verl's metric names.

An empty (or missing) validation set, a reward function without extra infos, or a metric computation that yields
nothing all mean "nothing to log": the result is ``{}`` and training goes on (the seed PR asserted a non-empty
dict and crashed).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING

from ppo_core.batch import repeat_interleave
from ppo_core.metrics import flatten_validation_metrics, process_validation_metrics
from ppo_core.trainer.data import PromptDataLoader
from ppo_core.trainer.reward import call_reward_fn
from ppo_core.trainer.steps import assign_uids, merge_generation

if TYPE_CHECKING:
    from ppo_core.trainer.base import BasePPOTrainer

__all__ = ["run_validation"]

logger = logging.getLogger(__name__)


def run_validation(trainer: BasePPOTrainer, executor: concurrent.futures.Executor) -> dict[str, float]:
    """``val-core/...`` and ``val-aux/...`` metrics of the trainer's validation set (``{}`` when there is none).

    Every prompt is answered ``rollout.val_n`` times (greedy unless ``rollout.val_do_sample``); the variable
    ``reward`` is each response's summed token scores, plus every extra info the reward function returns.
    """
    dataset = trainer.val_dataset
    if dataset is None or len(dataset) == 0:
        return {}
    cfg = trainer.config
    loader = PromptDataLoader(
        dataset,
        cfg.data.val_batch_size or len(dataset),
        shuffle=False,
        drop_last=False,
        pad_token_id=trainer.pad_token_id,
        collate_fn=trainer.collate_fn,
    )
    step = trainer.global_steps
    sources: list[str] = []
    uids: list[str] = []
    infos: dict[str, list] = {"reward": []}
    extra_counts: dict[str, int] = {}
    for i, batch in enumerate(loader):
        prompts = repeat_interleave(assign_uids(batch, f"val{step}.{i}"), cfg.rollout.val_n)
        generated = trainer.actor_wg.generate_sequences(
            prompts.select("input_ids", "attention_mask"), do_sample=cfg.rollout.val_do_sample
        )
        batch = merge_generation(prompts, generated)
        scores, extra = call_reward_fn(trainer.val_reward_fn, batch, step, executor).result()
        size = int(batch.batch_size[0])
        offset = len(uids)
        sources += [str(s) for s in batch.get("data_source").tolist()]
        uids += list(batch.get("uid").tolist())
        infos["reward"] += scores.sum(-1).tolist()
        for key, values in extra.items():
            if key == "reward":
                raise ValueError("the reward function's extra infos must not be named 'reward' (reserved)")
            column = infos.setdefault(key, [None] * offset)
            column += values
            extra_counts[key] = extra_counts.get(key, 0) + size
    partial = [k for k, n in extra_counts.items() if n != len(uids)]
    for key in partial:
        logger.warning("validation extra info %r was returned for only some batches; not logged", key)
        del infos[key]
    return flatten_validation_metrics(process_validation_metrics(sources, uids, infos, seed=cfg.trainer.seed))
