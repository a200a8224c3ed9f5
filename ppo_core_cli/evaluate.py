"""``ppo-core eval``: a checkpoint's greedy validation on the job's validation prompts, exactly as training runs it.

The job's ``data.val_files``, validation settings (``rollout.val_*``, ``data.val_batch_size``), rollout length,
scorers, EOS and padding are read as ``ppo-core train`` reads them; ``model.path`` (or ``--model``) names the
checkpoint: the model a run starts from (a GGUF file is converted once, as for ``train``), or a run's export. Only
the actor is built, and its validation is the trainer's own (:meth:`BasePPOTrainer._validate`): the same engine,
batches and scoring, so the accuracy of a run's export equals what the run's last validation reported, and the
accuracy of the starting checkpoint equals its step-0 validation.

Returns the validation metrics (``val-core/{source}/acc/mean@N``, ``val-aux/{source}/format/mean@N``...) with their
means over the data sources (:func:`~ppo_core.trainer.plot.validation_mean`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppo_core.trainer.plot import validation_mean
from ppo_core_cli.config import JobConfig

__all__ = ["EvalResult", "evaluate_job"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EvalResult:
    """One evaluation: the checkpoint, the headline means and every validation metric."""

    model_dir: str
    """The Hugging Face checkpoint evaluated (after a GGUF conversion)."""
    num_prompts: int
    """Validation prompts scored."""
    accuracy: float | None
    """Mean of ``acc`` over the data sources (None: the scorers report no ``acc``)."""
    format_rate: float | None
    """Mean of ``format`` over the data sources (None: the scorers report no ``format``)."""
    reward: float | None
    """Mean reward over the data sources."""
    seconds: float
    """Wall time of the evaluation (model loading included)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Every validation metric, as ``metrics.jsonl`` records them."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)


class _AtLeast(Sequence):
    """``rows`` repeated up to at least ``n`` rows (a training set the trainer accepts; nothing trains on it)."""

    def __init__(self, rows: Sequence[Any], n: int) -> None:
        self._rows, self._n = rows, max(len(rows), n)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return self._rows[i % len(self._rows)]


def _actor_only(job: JobConfig) -> JobConfig:
    """The job without a critic (an evaluation needs the actor alone). No advantages are computed, but the config
    rules hold for any job: ``gae`` (which needs the critic) gives way to ``reinforce_plus_plus`` (no critic, no
    groups, so no start warning about ``rollout.n``). No step trains: ``trainer.total_training_steps`` is None,
    so its stand-in training set of one batch gives no start warning about the epochs either."""
    algorithm = job.algorithm
    if algorithm.adv_estimator == "gae":
        algorithm = dataclasses.replace(algorithm, adv_estimator="reinforce_plus_plus")
    return dataclasses.replace(
        job,
        algorithm=algorithm,
        critic=dataclasses.replace(job.critic, enable=False),
        trainer=dataclasses.replace(job.trainer, total_training_steps=None),
    )


def evaluate_job(job: JobConfig, *, scorers: Mapping[str, Any] | None = None) -> EvalResult:
    """Greedy validation of ``job.model.path`` on ``job.data.val_files`` (see the module docstring).

    Raises:
        ValueError: the job names no validation files.
    """
    from ppo_core_cli.job import (
        build_reward,
        build_trainer,
        check_data_sources,
        check_tokenizer_fits,
        complete_workers,
        load_prompts,
        load_tokenizer,
        resolve_model_dirs,
        resolve_scorers,
        special_tokens,
        worker_specs,
    )
    from ppo_core_cli.train import _absolute_paths

    if not job.data.val_files:
        raise ValueError("data.val_files must name the prompts to evaluate on (none given)")
    start = time.perf_counter()
    if scorers is None:
        scorers = resolve_scorers(job)
    job = resolve_model_dirs(_absolute_paths(_actor_only(job)))
    if job.torch_threads:
        import torch

        torch.set_num_threads(job.torch_threads)
    tokenizer = load_tokenizer(job)
    check_tokenizer_fits(job, tokenizer)
    tokens = special_tokens(job, tokenizer)
    val = load_prompts(job, tokenizer, job.data.val_files)
    actor_worker, critic_worker = complete_workers(job, tokenizer, job.model.path, tokens)
    ppo = job.ppo_config(actor_worker, critic_worker)
    reward = build_reward(job, tokenizer, scorers)
    try:
        check_data_sources(reward, {"data.val_files": val})
    except BaseException:
        reward.close()
        raise
    trainer = build_trainer(
        job,
        ppo,
        worker_specs(job, ppo, job.model.path),
        train_dataset=_AtLeast(val, job.data.train_batch_size),  # the trainer needs one batch; none is drawn
        val_dataset=val,
        reward_fn=reward,
        pad_token_id=tokens.pad_token_id,
        tokenizer=tokenizer,
    )
    try:
        trainer.init_workers()
        try:
            metrics = trainer._validate()
        finally:
            trainer._executor.shutdown(wait=False, cancel_futures=True)
    finally:
        trainer.shutdown()
        reward.close()
    return EvalResult(
        model_dir=job.model.path,
        num_prompts=len(val),
        accuracy=validation_mean(metrics, "acc"),
        format_rate=validation_mean(metrics, "format"),
        reward=validation_mean(metrics, "reward"),
        seconds=time.perf_counter() - start,
        metrics={k: float(v) for k, v in metrics.items()},
    )
