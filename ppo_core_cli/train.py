"""``ppo-core train``: prompts, reward and workers from a job, ``fit()``, then the export, the plot and a summary.

One run:

1. the scorers of ``reward.scorers`` imported (before any model loads), the model directory (a GGUF file
   converted once, or a random-init one written when ``model.init_shape`` asks), the tokenizer (checked against
   the model's vocabulary size), the EOS and padding tokens (:mod:`ppo_core_cli.tokens`), the prompts;
2. the worker settings completed from the tokenizer and the checkpoint (:func:`~ppo_core_cli.job.complete_workers`),
   the job written to ``{checkpoints}/job.yaml`` and ``{run_dir}/job.yaml``;
3. ``BasePPOTrainer.fit()`` on the local or Monarch backend: progress bar, logs (console, TensorBoard, W&B as
   configured, and always ``metrics.jsonl``: the run's record, which the summary, the plot and the timings read),
   checkpoints every ``trainer.save_freq`` steps, resume from the newest checkpoint (``trainer.resume_mode=auto``);
   Ctrl-C shuts the workers down and raises :class:`TrainInterrupted` (the step, the newest checkpoint);
4. the actor's weights (``save_weights``: no optimizer state) exported as a Hugging Face directory, its
   ``generation_config.json`` carrying the run's EOS and padding ids;
5. ``reward_kl.png`` (reward, validation accuracy and format rate, response length, entropy, KL, rollout/training
   mismatch: :func:`~ppo_core.trainer.plot.plot_run`; none when nothing was logged) and, on request, the step-time
   breakdown JSON (:mod:`ppo_core_cli.timings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_core.trainer import checkpoint as ckpt
from ppo_core.trainer import read_metrics_jsonl
from ppo_core.trainer.manifest import CheckpointCorruptError
from ppo_core.trainer.plot import plot_run, validation_mean
from ppo_core.trainer.resume_config import ResumeConfigError
from ppo_core.trainer.reward import RewardFunctionError
from ppo_core.trainer.tracking import usable_loggers
from ppo_core.workers.errors import WorkerCallError
from ppo_core_cli.config import JobConfig
from ppo_core_cli.export import JOB_FILE, export_actor_weights, write_generation_ids
from ppo_core_cli.failures import reward_failure_message, weight_mismatch, write_traceback
from ppo_core_cli.job import (
    build_reward,
    build_trainer,
    check_data_sources,
    check_tokenizer_fits,
    complete_workers,
    load_datasets,
    load_tokenizer,
    resolve_model_dirs,
    resolve_scorers,
    special_tokens,
    worker_specs,
)
from ppo_core_cli.loading import dump_job_config
from ppo_core_cli.timings import step_time_breakdown

__all__ = ["JobInputError", "TrainInterrupted", "TrainResult", "run_loggers", "run_train"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainResult:
    """Where a run's outputs are, and its headline numbers."""

    run_dir: str
    metrics_file: str
    checkpoint: str | None = None
    export_dir: str | None = None
    plot: str | None = None
    timings_json: str | None = None
    steps: int = 0
    """The last step trained (this run's or an earlier one's)."""
    start_step: int = 0
    """The step this invocation started from (a resumed checkpoint's; 0 on a fresh start)."""
    step_limit: str = ""
    """What ends the run, as keys and values (``trainer.total_training_steps=200``, or the epochs' cap)."""
    total_steps: int = 0
    """The step the run was to end at (``trainer.total_training_steps``, capped by the epochs)."""
    limit_key: str = ""
    """The key to raise to train on (``trainer.total_training_steps`` or ``trainer.total_epochs``)."""
    initial_val_reward: float | None = None
    final_val_reward: float | None = None
    initial_val_accuracy: float | None = None
    """Validation accuracy (``acc``, mean over the data sources) of the first validation; None without one."""
    final_val_accuracy: float | None = None
    initial_val_format: float | None = None
    """Validation format rate (``format``: a number after ``####``) of the first validation; None without one."""
    final_val_format: float | None = None
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class JobInputError(ValueError):
    """The job's inputs (prompt files, batch size against the prompts...) cannot make a run: found while setting
    it up, before any model loads, or (a rerun whose keys change what the checkpoint's run means) when ``fit``
    resumes; the command prints it as a ``ppo-core: error:`` message, no traceback."""


@contextlib.contextmanager
def _input_errors() -> Iterator[None]:
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise JobInputError(str(exc)) from exc


LOCK_FILE = ".ppo-core.lock"
"""In a run folder while a ``train`` writes to it: a second run into the same folder is refused."""


def _lock_run_dir(run_dir: str) -> Any:
    """Take a run folder's lock (an exclusive ``flock`` on :data:`LOCK_FILE`, released when its file closes or
    the process ends, a crash included): two runs writing one folder's checkpoints and metrics would corrupt each
    other. ``JobInputError`` naming the holder's pid when another run has it. Where ``fcntl`` does not exist
    (Windows), no lock."""
    try:
        import fcntl
    except ImportError:
        return None
    os.makedirs(run_dir, exist_ok=True)
    f = open(os.path.join(run_dir, LOCK_FILE), "a+", encoding="utf-8")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise JobInputError(
            f"another ppo-core run (pid {holder}) is writing to {run_dir}; wait for it, or give this run another "
            "run_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _warn_fresh_start_over_a_run(job: JobConfig) -> None:
    """``trainer.resume_mode=disable`` into a run folder holding an earlier run's checkpoints: that run's metrics
    file is replaced and its checkpoints overwritten as this one saves; said once, before anything is written."""
    if job.trainer.resume_mode != "disable":
        return
    latest = ckpt.find_latest_checkpoint(job.checkpoint_dir)
    if latest:
        logger.warning(
            "trainer.resume_mode=disable: a new run in %s, which holds an earlier run's checkpoints (newest: %s); "
            "its metrics.jsonl is replaced and its checkpoints are overwritten as this run saves (another run_dir "
            "keeps them)",
            job.run_dir,
            latest,
        )


class TrainInterrupted(Exception):
    """The run was interrupted (Ctrl-C) and its workers shut down: where it stopped and how to go on."""

    def __init__(
        self, *, step: int, finished: int, start_step: int, checkpoint: str | None, resume_mode: str
    ):
        self.step = step
        """The step under way when the interrupt came (``finished`` when it came between steps)."""
        self.finished = finished
        """The last step whose metrics and checkpoint (when due) were written."""
        self.start_step = start_step
        self.checkpoint = checkpoint
        """The newest checkpoint folder (None: none saved)."""
        self.resume_mode = resume_mode
        super().__init__(f"interrupted during step {step}")


def run_loggers(loggers: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The sinks a command's run uses: ``loggers`` whose package is installed (one warning for each other) plus
    ``jsonl``, always: ``metrics.jsonl`` is the run's record, read by the summary, the plot and the timings."""
    kept = usable_loggers(loggers)
    return kept if "jsonl" in kept else (*kept, "jsonl")


def _step_limit(trainer: Any) -> tuple[str, str]:
    """``(what ends the run, the key to raise to train on)``."""
    cfg = trainer.config.trainer
    per_epoch = len(trainer.train_dataloader)
    if cfg.total_training_steps is not None and cfg.total_training_steps <= per_epoch * cfg.total_epochs:
        return f"trainer.total_training_steps={cfg.total_training_steps}", "trainer.total_training_steps"
    return f"trainer.total_epochs={cfg.total_epochs} x {per_epoch} steps per epoch", "trainer.total_epochs"


def _absolute_paths(job: JobConfig) -> JobConfig:
    """The job with its directories absolute: worker processes may not share this process's working directory."""
    trainer = job.trainer
    return JobConfig.from_dict(
        {
            **job.to_dict(),
            "run_dir": os.path.abspath(job.run_dir),
            "model": {
                **job.model.to_dict(),
                "path": os.path.abspath(job.model.path) if job.model.path else "",
                **{
                    k: os.path.abspath(v)
                    for k in ("tokenizer_path", "critic_path")
                    if (v := getattr(job.model, k))
                },
            },
            "trainer": {
                **trainer.to_dict(),
                "default_local_dir": os.path.abspath(job.checkpoint_dir),
                "log_dir": os.path.abspath(job.log_dir),
            },
            "export_dir": os.path.abspath(job.export_path),
        }
    )


def run_train(
    job: JobConfig,
    *,
    scorers: Mapping[str, Any] | None = None,
    timings_json: str | None = None,
    warmup_steps: int = 1,
) -> TrainResult:
    """Run the job (see the module docstring) and return where everything is.

    The run holds its folders' lock (:func:`_lock_run_dir`: ``run_dir``, and the checkpoint folder where it lies
    elsewhere) from before it writes anything until it returns or raises.

    Args:
        job: the job.
        scorers: ``reward.scorers`` already resolved (:func:`~ppo_core_cli.job.resolve_scorers`); None: resolve
            them here, first, before any model loads.
        timings_json: also write the step-time breakdown, tokens/s and peak memory to this file.
        warmup_steps: steps left out of the breakdown's means (one-time costs).
    """
    with contextlib.ExitStack() as locks:
        return _run_train(job, locks, scorers=scorers, timings_json=timings_json, warmup_steps=warmup_steps)


def _run_train(
    job: JobConfig,
    locks: contextlib.ExitStack,
    *,
    scorers: Mapping[str, Any] | None,
    timings_json: str | None,
    warmup_steps: int,
) -> TrainResult:
    """:func:`run_train`'s body; the folders' locks are entered on ``locks`` (closed by the caller)."""
    start = time.perf_counter()
    if scorers is None:
        scorers = resolve_scorers(job)
    job = _absolute_paths(job)
    loggers = run_loggers(job.trainer.loggers)  # warns about a missing package now, not after the models load
    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)
    job = resolve_model_dirs(job)
    model_dir = job.model.path
    with _input_errors():  # the tokenizer and its special tokens (model.eos_token...) named in one line
        tokenizer = load_tokenizer(job)
        check_tokenizer_fits(job, tokenizer)
        tokens = special_tokens(job, tokenizer)
    with _input_errors():
        train, val = load_datasets(job, tokenizer)
    actor_worker, critic_worker = complete_workers(job, tokenizer, model_dir, tokens)
    ppo = job.ppo_config(actor_worker, critic_worker)
    ppo = dataclasses.replace(ppo, trainer=dataclasses.replace(ppo.trainer, loggers=loggers))
    folders = [job.run_dir]
    checkpoints = os.path.abspath(job.checkpoint_dir)
    if not checkpoints.startswith(os.path.abspath(job.run_dir).rstrip(os.sep) + os.sep):
        folders.append(checkpoints)  # a checkpoint folder elsewhere: two runs would share it
    for folder in folders:
        lock = _lock_run_dir(folder)
        if lock is not None:
            locks.callback(lock.close)
    _warn_fresh_start_over_a_run(job)
    for folder in (job.run_dir, job.checkpoint_dir):
        dump_job_config(job, os.path.join(folder, JOB_FILE))
    reward = build_reward(job, tokenizer, scorers)
    try:
        with _input_errors():  # a data_source without a scorer: named now, not at the first step
            check_data_sources(reward, {"data.train_files": train, "data.val_files": val})
    except BaseException:
        reward.close()
        raise
    try:
        with _input_errors():  # the trainer checks the prompts against the batch size
            trainer = build_trainer(
                job,
                ppo,
                worker_specs(job, ppo, model_dir),
                train_dataset=train,
                val_dataset=val,
                reward_fn=reward,
                pad_token_id=tokens.pad_token_id,
                tokenizer=tokenizer,
            )
    except BaseException:
        reward.close()
        raise
    result = TrainResult(run_dir=job.run_dir, metrics_file=os.path.join(job.log_dir, "metrics.jsonl"))
    weights = os.path.join(job.run_dir, "final_actor")
    interrupted = False
    try:
        try:  # the workers, built from the job here (an engine setting their model does not support...): one line
            trainer.init_workers()
        except (ValueError, TypeError) as exc:
            trace = write_traceback(exc, os.path.join(job.run_dir, "worker_error.txt"))
            where = f" (traceback: {trace})" if trace else ""
            raise JobInputError(f"the workers cannot be built from this job: {exc}{where}") from exc
        trainer.fit()
        result.steps = trainer.global_steps
        result.start_step = trainer.start_step
        result.step_limit, result.limit_key = _step_limit(trainer)
        result.total_steps = trainer.total_training_steps
        result.checkpoint = ckpt.find_latest_checkpoint(job.checkpoint_dir)
        if trainer.global_steps > 0:
            shutil.rmtree(weights, ignore_errors=True)
            trainer.actor_wg.save_weights(weights)
        if timings_json:
            result.extra["peak_memory_gib"] = _peak_memory(trainer)
    except KeyboardInterrupt:
        interrupted = True
    except CheckpointCorruptError as exc:  # nothing intact to resume from: what to do, no traceback
        raise JobInputError(str(exc)) from exc
    except WorkerCallError as exc:
        # a worker could not load the checkpoint's weights into its model: a resume given a model of another shape
        detail = weight_mismatch(exc.message) if exc.method.rsplit(".", 1)[-1] == "load_checkpoint" else None
        if detail is None:
            raise
        raise JobInputError(
            f"the checkpoint's weights do not fit the model of model.path={model_dir!r} (another shape or "
            f"architecture: {detail[:240]}); resume with the model the run started from, or start a new run "
            "(trainer.resume_mode=disable, or another run_dir)"
        ) from exc
    except ResumeConfigError as exc:  # a rerun changing the run: printed by the command, no traceback
        message = str(exc)
        if any(key.endswith("worker.hf_checkpoint") for key in exc.differences):
            message += (
                "\n(actor.worker.hf_checkpoint and critic.worker.hf_checkpoint are the job's model.path and "
                "model.critic_path: the checkpoint's weights would train against another model's KL reference; "
                "trainer.resume_allow_changes: [model.path] allows it)"
            )
        raise JobInputError(message) from exc
    except RewardFunctionError as exc:  # the user's scorer failed: one message, the traceback in a file
        trace = write_traceback(exc, os.path.join(job.run_dir, "reward_error.txt"))
        latest = ckpt.find_latest_checkpoint(job.checkpoint_dir)
        resume = f"; a rerun resumes from {latest}" if latest else ""
        raise JobInputError(reward_failure_message(exc, trace) + resume) from exc
    finally:
        trainer.shutdown()
        reward.close()
    if interrupted:
        raise TrainInterrupted(
            step=trainer.global_steps,
            finished=trainer.finished_steps,
            start_step=trainer.start_step,
            checkpoint=ckpt.find_latest_checkpoint(job.checkpoint_dir),
            resume_mode=job.trainer.resume_mode,
        )
    if result.steps > 0:
        result.export_dir = export_actor_weights(
            weights,
            job.export_path,
            actor_worker=actor_worker.to_dict(),
            model_dir=model_dir,
            dtype=job.export_dtype,
        )
        write_generation_ids(result.export_dir, tokens)
        shutil.rmtree(weights, ignore_errors=True)
    records = read_metrics_jsonl(job.log_dir)
    _set_validation_ends(result, records)
    result.wall_seconds = time.perf_counter() - start
    algo = (
        "PPO (GAE + critic)" if job.algorithm.adv_estimator == "gae" else job.algorithm.adv_estimator.upper()
    )
    title = f"{algo} on {os.path.basename(model_dir)} ({result.wall_seconds:.0f} s)"
    result.plot = plot_run(records, os.path.join(job.log_dir, "reward_kl.png"), title)
    if timings_json:
        result.timings_json = _write_timings(timings_json, job, records, result, warmup_steps)
    return result


def _set_validation_ends(result: TrainResult, records: list[dict[str, Any]]) -> None:
    """Set ``result``'s first and last validation means (reward, accuracy, format rate) from the run's metric
    records; a run that validated once has a last one only (nothing to compare it with)."""
    for variable, first, last in (
        ("reward", "initial_val_reward", "final_val_reward"),
        ("acc", "initial_val_accuracy", "final_val_accuracy"),
        ("format", "initial_val_format", "final_val_format"),
    ):
        vals = [v for r in records if (v := validation_mean(r, variable)) is not None]
        if vals:
            setattr(result, last, vals[-1])
        if len(vals) > 1:
            setattr(result, first, vals[0])


def _peak_memory(trainer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, group in (("actor", trainer.actor_wg), ("critic", trainer.critic_wg)):
        if group is not None and callable(getattr(group, "peak_memory", None)):
            out[role] = group.peak_memory()
    return out


def _write_timings(path: str, job: JobConfig, records: list, result: TrainResult, warmup_steps: int) -> str:
    rows = job.data.train_batch_size * job.rollout.n
    report = {
        "job": {
            "model": job.model.init_shape or job.model.path,
            "workers": job.workers,
            "backend": job.backend,
            "adv_estimator": job.algorithm.adv_estimator,
            "prompts_per_step": job.data.train_batch_size,
            "n": job.rollout.n,
            "max_prompt_length": job.data.max_prompt_length,
            "max_new_tokens": job.rollout.max_new_tokens,
            "dtype": job.model.dtype,
            "gpus": job.actor.world_size,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        },
        **step_time_breakdown(records, warmup_steps=warmup_steps, num_responses=rows),
        "peak_memory_gib": result.extra.get("peak_memory_gib", {}),
        "prompt_length_mean": _mean_of(records, "prompt_length/mean"),
        "response_length_mean": _mean_of(records, "response_length/mean"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return path


def _mean_of(records: list, key: str) -> float | None:
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None
