"""``BasePPOTrainer``: the PPO loop written once, for any backend; subclasses only implement ``init_workers()``.

One step, in verl's order (:meth:`BasePPOTrainer.train_step`): sample ``n`` responses per prompt (one ``uid`` per
prompt) -> start the reward (sync, or a Future/awaitable awaited later) -> old log-probs -> rollout correction
(``algorithm.rollout_correction``: importance weights, and the rejected tokens that leave the actor's losses) ->
reference log-probs -> values -> in-reward KL (``apply_kl_penalty``) -> advantages (registry) -> critic update -> actor update
(after ``critic_warmup`` steps) -> metrics -> validation (every ``test_freq`` steps and at the end) ->
checkpoint (every ``save_freq`` steps and at the end) -> log. The step's metrics include the reward per data
source with the reward function's numeric extra infos (``reward/{source}/score/mean``, ``reward/{source}/acc/mean``:
:func:`~ppo_core.rewards.reward_metrics_by_source`) and the time of every stage (``timing_s/gen``, ...,
``timing_s/reward_wait``: how long the reward still ran once the log-prob and value passes were done).

Differences from verl, on purpose: validation runs *before* the checkpoint of a step, so a resumed run continues
from the state an uninterrupted one had; the controller state (KL coefficient, RNGs, dataloader position) is
saved too, and a dataloader state taken at the end of an epoch resumes at the start of the next one;
``val_before_train`` applies to a fresh start only; ``critic_warmup = k`` means exactly ``k`` critic-only steps
(verl skips ``k - 1``); an empty validation set or an empty metric dict is "nothing to log", never an error.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ppo_core.batch import repeat_interleave
from ppo_core.batch._td import _shallow_copy
from ppo_core.keys import KEYS
from ppo_core.kl_control import apply_kl_penalty, build_kl_controller
from ppo_core.losses import agg_loss
from ppo_core.metrics import (
    Timer,
    rollout_probs_diff_metrics,
)
from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from ppo_core.trainer import checkpoint as ckpt
from ppo_core.trainer.completions import COMPLETIONS_FILE, reset_completions
from ppo_core.trainer.config import PPOConfig, start_warnings
from ppo_core.trainer.data import PromptDataLoader
from ppo_core.trainer.resident_step import resident_train_step
from ppo_core.trainer.resume_config import check_resume_config, rescale_loader_state
from ppo_core.trainer.reward import RewardFn, call_reward_fn
from ppo_core.trainer.steps import (
    assign_uids,
    compute_advantages,
    merge_generation,
    step_end_metrics,
    take_outputs,
)
from ppo_core.trainer.tracking import Tracker
from ppo_core.trainer.validation import run_validation
from ppo_core.workers.group import WorkerGroup
from ppo_core.workers.traffic import controller_bytes_metrics

__all__ = ["BasePPOTrainer"]

logger = logging.getLogger(__name__)


class BasePPOTrainer(abc.ABC):
    """The single-controller PPO trainer. Subclasses set ``self.actor_wg`` (and ``ref_wg``, ``critic_wg``) in
    :meth:`init_workers`, with any backend; everything else is here.

    ``fit()`` seeds the controller's torch/numpy/python RNGs from ``trainer.seed`` at the start of a fresh run and
    restores them on resume (the only global RNG side effect in the library, and the documented job of a trainer).

    Args:
        config: a :class:`PPOConfig` or a dict of its fields.
        train_dataset: a sequence of prompt mappings (``input_ids``, ``ground_truth``, ``data_source``...).
        reward_fn: see :mod:`ppo_core.trainer.reward` (sync result, Future or awaitable).
        val_dataset: validation prompts (None or empty: no validation).
        val_reward_fn: reward for validation (default ``reward_fn``).
        pad_token_id: id used to left-pad prompts.
        collate_fn: replaces :func:`ppo_core.trainer.data.collate_prompts` for both datasets.
        tokenizer: decodes the completions validation logs as text (``trainer.log_val_generations``); None: no
            completions are logged.

    Example:
        >>> class MyTrainer(BasePPOTrainer):
        ...     def init_workers(self):
        ...         self.actor_wg = LocalWorkerGroup(WorkerSpec(MyActor, args=(self.config.actor.worker,)))
        ...         self.critic_wg = LocalWorkerGroup(WorkerSpec(MyCritic, args=(self.config.critic.worker,)))
        >>> MyTrainer(cfg, train_dataset=prompts, reward_fn=score).fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        config: PPOConfig | Mapping[str, Any],
        *,
        train_dataset: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn,
        val_dataset: Sequence[Mapping[str, Any]] | None = None,
        val_reward_fn: RewardFn | None = None,
        pad_token_id: int = 0,
        collate_fn: Callable[[Sequence[Mapping[str, Any]]], TensorDictBase] | None = None,
        tokenizer: Any = None,
    ) -> None:
        config = PPOConfig.coerce(config)
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        self.config = config
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn or reward_fn
        self.val_dataset = val_dataset
        self.pad_token_id = pad_token_id
        self.collate_fn = collate_fn
        self.tokenizer = tokenizer
        self._completions_file: str | None = None
        data = config.data
        self.train_dataloader = PromptDataLoader(
            train_dataset,
            data.train_batch_size,
            shuffle=data.shuffle,
            seed=data.seed,
            pad_token_id=pad_token_id,
            collate_fn=collate_fn,
        )
        if len(self.train_dataloader) == 0:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} prompts, fewer than data.train_batch_size="
                f"{data.train_batch_size}: no training step is possible"
            )
        alg = config.algorithm
        self.kl_ctrl = build_kl_controller(alg.kl_ctrl) if alg.use_kl_in_reward else None
        self.global_steps = 0
        self.start_step = 0
        """The step ``fit()`` started from (the resumed checkpoint's; 0 on a fresh start)."""
        self.finished_steps = 0
        """Steps whose metrics, validation and checkpoint are done (``global_steps - 1`` while a step runs)."""
        for warning in start_warnings(config, steps_per_epoch=len(self.train_dataloader)):
            logger.warning("%s", warning)
        self.actor_wg: WorkerGroup | None = None
        self.ref_wg: WorkerGroup | None = None
        self.critic_wg: WorkerGroup | None = None
        # runs coroutine reward functions concurrently with the controller; replaced at each fit()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppo-reward")

    @abc.abstractmethod
    def init_workers(self) -> None:
        """Create the worker groups: set ``self.actor_wg`` and, as the config needs them, ``self.critic_wg``
        and ``self.ref_wg`` (default: the actor group serves ``compute_ref_log_prob``)."""

    # ----- set-up ---------------------------------------------------------------------------------------------
    @property
    def total_training_steps(self) -> int:
        """``len(train_dataloader) * total_epochs``, capped by ``trainer.total_training_steps``."""
        cfg = self.config.trainer
        available = len(self.train_dataloader) * cfg.total_epochs
        return available if cfg.total_training_steps is None else min(available, cfg.total_training_steps)

    def _reference_group(self) -> WorkerGroup:
        group = self.ref_wg or self.actor_wg
        if not hasattr(group, "compute_ref_log_prob"):
            raise ValueError(
                "the config needs reference log-probs (use_kl_in_reward or actor.use_kl_loss) but neither ref_wg "
                "nor actor_wg has a registered compute_ref_log_prob"
            )
        return group  # type: ignore[return-value]

    def _check_workers(self) -> None:
        if self.actor_wg is None:
            raise ValueError(f"{type(self).__name__}.init_workers() must set self.actor_wg")
        if self.config.use_critic and self.critic_wg is None:
            raise ValueError(
                f"the critic is enabled (adv_estimator={self.config.algorithm.adv_estimator!r}, "
                f"critic.enable={self.config.critic.enable}) but init_workers() did not set self.critic_wg"
            )
        if self.config.use_reference:
            self._reference_group()
        checkpoints = self.config.trainer.save_freq > 0 or self.config.trainer.resume_mode != "disable"
        needed = [("actor_wg", self.actor_wg, ["generate_sequences", "compute_log_prob", "update_actor"])]
        if self.config.use_critic:
            needed.append(("critic_wg", self.critic_wg, ["compute_values", "update_critic"]))
        for name, group, methods in needed:
            methods = methods + (["save_checkpoint", "load_checkpoint"] if checkpoints else [])
            missing = [m for m in methods if not callable(getattr(group, m, None))]
            if missing:
                raise ValueError(
                    f"{name} ({group.worker_cls.__name__}) lacks the @register-ed method(s) {missing} the trainer "
                    "calls (see docs/backends.md)"
                )
        self._warn_default_mini_batches(needed)

    def _warn_default_mini_batches(self, groups: list[tuple[str, Any, list[str]]]) -> None:
        """A library PPO worker (:class:`~ppo_core.workers.ppo.PPOWorkerBase`) whose section of the config is a
        mapping without ``ppo_mini_batch_size`` takes the worker config's default (256), which the config's own
        check cannot see; where it would not divide a step's responses, say so before the first rollout (a
        warning: the worker may have been given other settings than the config's) instead of at the first
        update."""
        from ppo_core.workers.config import PPOWorkerConfig
        from ppo_core.workers.ppo import PPOWorkerBase

        cfg = self.config
        rows = cfg.data.train_batch_size * cfg.rollout.n
        default = PPOWorkerConfig.ppo_mini_batch_size
        for name, group, _ in groups:
            role = "actor" if name == "actor_wg" else "critic"
            section = getattr(cfg, role).worker
            worker_cls = getattr(group, "worker_cls", None)
            if (
                isinstance(section, Mapping)
                and "ppo_mini_batch_size" not in section
                and isinstance(worker_cls, type)
                and issubclass(worker_cls, PPOWorkerBase)
                and rows % default
            ):
                logger.warning(
                    "%s.worker.ppo_mini_batch_size is not set, and %s's default (%d) does not divide the responses "
                    "of a step, data.train_batch_size x rollout.n = %d x %d = %d: its first update will stop "
                    "there. Set %s.worker.ppo_mini_batch_size to a divisor of %d.",
                    role,
                    worker_cls.__name__,
                    default,
                    cfg.data.train_batch_size,
                    cfg.rollout.n,
                    rows,
                    role,
                    rows,
                )

    def shutdown(self) -> None:
        """Shut down every worker group (idempotent)."""
        for group in (self.actor_wg, self.ref_wg, self.critic_wg):
            if group is not None:
                group.shutdown()

    # ----- the loop ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train until ``total_training_steps``; returns the last step's metrics."""
        if self.actor_wg is None:
            self.init_workers()
        self._check_workers()
        cfg = self.config.trainer
        resumed = self._load_checkpoint()
        self.start_step = self.finished_steps = self.global_steps
        tracker = Tracker(
            cfg.loggers,
            cfg.log_dir or cfg.default_local_dir,
            console_every=cfg.console_every,
            resume_step=self.global_steps if resumed else None,
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppo-reward")
        self._completions_file = None
        if cfg.log_val_generations > 0 and self.tokenizer is not None:
            self._completions_file = os.path.join(cfg.log_dir or cfg.default_local_dir, COMPLETIONS_FILE)
            reset_completions(self._completions_file, self.global_steps if resumed else None)
        total = self.total_training_steps
        bar = _progress_bar(cfg.progress_bar, initial=self.global_steps, total=total)
        last: dict[str, float] = {}
        try:
            if cfg.val_before_train and self.global_steps == 0:
                tracker.log(self._validate(), step=0)
                tracker.flush()
            batches = self._train_batches()
            while self.global_steps < total:
                try:
                    epoch, batch = next(batches)
                except StopIteration:  # total_epochs reached first (a resumed run with a smaller config)
                    break
                self.global_steps += 1
                step = self.global_steps
                is_last = step >= total
                metrics = self.train_step(batch, epoch)
                if self._due(cfg.test_freq, step, is_last, at_end_when_off=True):
                    metrics.update(self._validate())
                if self._due(cfg.save_freq, step, is_last, at_end_when_off=False):
                    self.save_checkpoint()
                tracker.log(metrics, step=step)
                tracker.flush(step)
                self.finished_steps = step
                last = metrics
                if bar is not None:
                    bar.update(1)
        finally:
            tracker.close()
            self._executor.shutdown(wait=False, cancel_futures=True)
            if bar is not None:
                bar.close()
        return last

    @staticmethod
    def _due(freq: int, step: int, is_last: bool, at_end_when_off: bool) -> bool:
        if freq > 0:
            return is_last or step % freq == 0
        return is_last and at_end_when_off

    def _train_batches(self) -> Iterator[tuple[int, TensorDictBase]]:
        loader = self.train_dataloader
        while loader.epoch < self.config.trainer.total_epochs:
            epoch = loader.epoch
            for batch in loader:
                yield epoch, batch

    def train_step(self, batch: TensorDictBase, epoch: int) -> dict[str, float]:
        """One PPO step on a batch of prompts (``self.global_steps`` already counts it); returns its metrics."""
        if self.config.trainer.resident_batches:
            return resident_train_step(self, batch, epoch)
        cfg, step, timer = self.config, self.global_steps, Timer()
        metrics: dict[str, float] = {}
        groups = (self.actor_wg, self.ref_wg, self.critic_wg)
        controller_bytes_metrics(*groups)  # start counting at this step (validation is not part of it)
        with timer("step"):
            prompts = repeat_interleave(assign_uids(batch, str(step)), cfg.rollout.n)
            with timer("gen"):
                generated = self.actor_wg.generate_sequences(
                    prompts.select(KEYS.input_ids, KEYS.attention_mask)
                )
            batch = merge_generation(prompts, generated)
            with timer("reward"):
                reward = call_reward_fn(self.reward_fn, batch, step, self._executor)
            correction = cfg.algorithm.rollout_correction
            if cfg.rollout.old_log_probs_from_rollout or correction.bypass_mode:
                if KEYS.rollout_log_probs not in batch:
                    setting = (
                        "algorithm.rollout_correction.bypass_mode"
                        if correction.bypass_mode
                        else "rollout.old_log_probs_from_rollout"
                    )
                    raise ValueError(
                        f"{setting}=True, but generate_sequences returned no {KEYS.rollout_log_probs!r}; it "
                        f"returned {sorted(generated.keys())}"
                    )
                batch.set(KEYS.old_log_probs, batch[KEYS.rollout_log_probs])
            else:
                with timer("old_log_prob"):
                    out = self.actor_wg.compute_log_prob(batch)
                    batch = take_outputs(batch, out, [KEYS.old_log_probs], "compute_log_prob")
                    if KEYS.entropies in out:
                        # the pre-update policy on the rollout batch; the update's own entropy term is
                        # actor/update_entropy, logged by the worker
                        entropy = agg_loss(out[KEYS.entropies], batch[KEYS.response_mask], "token-mean")
                        metrics["actor/entropy"] = float(entropy)
                if KEYS.rollout_log_probs in batch:
                    metrics.update(
                        rollout_probs_diff_metrics(
                            batch[KEYS.rollout_log_probs],
                            batch[KEYS.old_log_probs],
                            batch[KEYS.response_mask],
                        )
                    )
            policy_mask = None  # the response mask of the actor's losses, when the rollout correction rejects
            if correction.enabled:
                batch, policy_mask, corr_metrics = _rollout_correction(batch, correction, generated)
                metrics.update(corr_metrics)
            if cfg.use_reference:
                with timer("ref"):
                    out = self._reference_group().compute_ref_log_prob(batch)
                    batch = take_outputs(batch, out, [KEYS.ref_log_probs], "compute_ref_log_prob")
            if cfg.use_critic:
                with timer("values"):
                    batch = take_outputs(
                        batch, self.critic_wg.compute_values(batch), [KEYS.values], "compute_values"
                    )
            with timer("reward_wait"):  # what the reward still needed after the passes above
                scores, extra = reward.result()
            metrics.update(reward_metrics_by_source(_data_sources(batch), scores, extra))
            with timer("adv"):
                batch.set(KEYS.token_level_scores, scores.to(batch[KEYS.response_mask].device))
                if self.kl_ctrl is not None:
                    batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    batch.set(KEYS.token_level_rewards, batch[KEYS.token_level_scores])
                batch = compute_advantages(batch, cfg.algorithm)
            if cfg.use_critic:
                with timer("update_critic"):
                    metrics.update(self.critic_wg.update_critic(batch))
            if step > cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    actor_batch = batch
                    if policy_mask is not None:
                        actor_batch = _shallow_copy(batch)
                        actor_batch.set(KEYS.response_mask, policy_mask)
                    metrics.update(self.actor_wg.update_actor(actor_batch))
        timing = timer.reset()
        metrics.update(step_end_metrics(batch, timing, config=cfg, step=step, epoch=epoch, groups=groups))
        return metrics

    def _validate(self) -> dict[str, float]:
        cfg = self.config
        return run_validation(
            self.actor_wg,
            self.val_dataset,
            self.val_reward_fn,
            rollout=cfg.rollout,
            batch_size=cfg.data.val_batch_size,
            step=self.global_steps,
            seed=cfg.trainer.seed,
            pad_token_id=self.pad_token_id,
            collate_fn=self.collate_fn,
            executor=self._executor,
            tokenizer=self.tokenizer,
            num_completions=cfg.trainer.log_val_generations,
            completions_file=self._completions_file,
        )

    # ----- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Write ``global_step_{k}`` (workers, controller state, RNGs, manifest) and publish it atomically; then
        keep the newest ``trainer.max_ckpt_to_keep`` checkpoints."""
        cfg = self.config.trainer
        root, step = cfg.default_local_dir, self.global_steps
        ckpt.remove_stale_saves(root)
        tmp = ckpt.checkpoint_dir(root, step) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self.actor_wg.save_checkpoint(os.path.join(tmp, "actor"), step)
        if self.config.use_critic:
            self.critic_wg.save_checkpoint(os.path.join(tmp, "critic"), step)
        state = {
            "global_steps": step,
            "dataloader": self.train_dataloader.state_dict(),
            "kl_ctrl": None if self.kl_ctrl is None else self.kl_ctrl.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "config": self.config.to_dict(),
        }
        ckpt.save_trainer_state(tmp, state)
        path = ckpt.publish_checkpoint(tmp, root, step)
        ckpt.prune_checkpoints(root, cfg.max_ckpt_to_keep, newest=step)
        logger.info("saved checkpoint %s", path)
        return path

    def _load_checkpoint(self) -> bool:
        """Resume from the configured checkpoint: verify it whole, compare its config, then load the workers."""
        cfg = self.config.trainer
        found: tuple[str, dict[str, Any]] | None = None
        if cfg.resume_mode == "auto":
            ckpt.remove_stale_saves(cfg.default_local_dir)  # also restores a step whose re-save was cut short
            found = ckpt.find_intact_checkpoint(cfg.default_local_dir)
        elif cfg.resume_mode == "path":
            path = cfg.resume_from_path
            if not os.path.isdir(path):
                raise FileNotFoundError(f"trainer.resume_from_path {path!r} does not exist")
            found = path, ckpt.open_checkpoint(path)
        if found is None:
            self._seed(cfg.seed)
            return False
        path, state = found
        changes = check_resume_config(
            state.get("config"), self.config, checkpoint=path, allow=cfg.resume_allow_changes
        )
        loader_state = state["dataloader"]
        old_size = changes.get("data.train_batch_size", (None,))[0]
        if isinstance(old_size, int):  # an allowed change: the saved position counts batches of the old size
            loader_state = rescale_loader_state(loader_state, old_size, self.config.data.train_batch_size)
        self.actor_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.config.use_critic:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        self.train_dataloader.load_state_dict(loader_state)
        if self.kl_ctrl is not None and state.get("kl_ctrl") is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        ckpt.restore_rng_state(state["rng"])
        self.global_steps = int(state["global_steps"])
        logger.info("resumed from %s (step %d)", path, self.global_steps)
        return True

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def _rollout_correction(
    batch: TensorDictBase, config: RolloutCorrectionConfig, generated: TensorDictBase
) -> tuple[TensorDictBase, torch.Tensor | None, dict[str, float]]:
    """``batch`` with ``rollout_is_weights`` (when asked for), the actor's response mask without the rejected
    tokens (None without rejection) and the ``rollout_corr/*`` metrics."""
    if KEYS.rollout_log_probs not in batch:
        raise ValueError(
            "algorithm.rollout_correction asks for importance weights or rejection, which compare the old "
            f"log-probs with the rollout's, but generate_sequences returned no {KEYS.rollout_log_probs!r}; it "
            f"returned {sorted(generated.keys())}"
        )
    weights, mask, metrics = compute_rollout_correction(
        batch[KEYS.old_log_probs], batch[KEYS.rollout_log_probs], batch[KEYS.response_mask], config
    )
    if weights is not None:
        batch = _shallow_copy(batch)
        batch.set(KEYS.rollout_is_weights, weights)
    return batch, (mask if config.rollout_rs is not None else None), metrics


def _data_sources(batch: TensorDictBase) -> list[str]:
    """The ``data_source`` of every row (``"unknown"`` when the batch has none)."""
    size = int(batch.batch_size[0])
    if KEYS.data_source not in batch:
        return ["unknown"] * size
    values = batch.get(KEYS.data_source)
    values = values.tolist() if hasattr(values, "tolist") else values
    if isinstance(values, str) or not isinstance(values, list):  # one value shared by every row
        values = [values] * size
    return [str(v) for v in values]


def _progress_bar(enabled: bool, initial: int, total: int) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="ppo steps", dynamic_ncols=True)
