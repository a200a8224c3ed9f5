"""What the trainer does with the workers' outputs: ``actor/entropy`` (the log-prob pass) and
``actor/update_entropy`` (the update) are separate metrics, ``rollout_log_probs`` travel with the batch, and
``run_validation`` takes explicit arguments."""

from __future__ import annotations

import concurrent.futures
from typing import ClassVar

import pytest
import torch
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.keys import KEYS
from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.trainer.config import RolloutConfig
from ppo_core.trainer.validation import run_validation
from ppo_core.workers import Dispatch, Worker, WorkerSpec, register

R = 3


class EntropyActor(Worker):
    """Answers ``[1, 2, ...]`` with a mask of row-dependent length; its entropies are ``10 * row + t``."""

    seen: ClassVar[list[set[str]]] = []

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
        b = batch.batch_size[0]
        responses = torch.arange(1, R + 1).expand(b, R).clone()
        mask = (torch.arange(R)[None] < (torch.arange(b)[:, None] % R + 1)).long()
        return TensorDict(
            {
                KEYS.prompts: batch[KEYS.input_ids],
                KEYS.responses: responses,
                KEYS.input_ids: torch.cat([batch[KEYS.input_ids], responses], -1),
                KEYS.attention_mask: torch.cat([batch[KEYS.attention_mask], mask], -1),
                KEYS.response_mask: mask,
                KEYS.rollout_log_probs: -torch.ones(b, R) * mask,
            },
            batch_size=[b],
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        b = batch.batch_size[0]
        entropies = 10.0 * torch.arange(b)[:, None] + torch.arange(R)[None]
        return TensorDict({KEYS.old_log_probs: -torch.ones(b, R), KEYS.entropies: entropies}, batch_size=[b])

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        EntropyActor.seen.append(set(batch.keys()))
        return {"actor/update_entropy": 123.0, "actor/pg_loss": 0.0}


class Trainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(WorkerSpec(EntropyActor))


def _dataset(n: int) -> list[dict]:
    return [{"input_ids": [1 + i % 4, 2], "ground_truth": i, "data_source": f"src{i % 2}"} for i in range(n)]


def _reward(batch: TensorDict) -> torch.Tensor:
    return batch[KEYS.response_mask].sum(-1).float()


def test_log_prob_entropy_and_update_entropy_are_separate_metrics(tmp_path) -> None:
    config = PPOConfig.from_dict(
        {
            "data": {"train_batch_size": 4, "shuffle": False},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
            "rollout": {"n": 2},
            "trainer": {
                "total_training_steps": 1,
                "val_before_train": False,
                "resume_mode": "disable",
                "default_local_dir": str(tmp_path),
                "loggers": (),
                "progress_bar": False,
            },
        }
    )
    EntropyActor.seen = []
    trainer = Trainer(config, train_dataset=_dataset(4), reward_fn=_reward)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    rows = 8  # 4 prompts x n=2
    mask = (torch.arange(R)[None] < (torch.arange(rows)[:, None] % R + 1)).double()
    entropies = 10.0 * torch.arange(rows)[:, None] + torch.arange(R)[None]
    assert metrics["actor/entropy"] == pytest.approx(float((entropies * mask).sum() / mask.sum()), rel=1e-6)
    assert metrics["actor/update_entropy"] == 123.0
    (keys,) = EntropyActor.seen
    assert {KEYS.rollout_log_probs, KEYS.old_log_probs, KEYS.advantages} <= keys


def test_run_validation_takes_explicit_arguments() -> None:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    with LocalWorkerGroup(WorkerSpec(EntropyActor)) as group:
        kwargs = {
            "rollout": RolloutConfig(val_n=2),
            "batch_size": 2,
            "step": 5,
            "seed": 0,
            "pad_token_id": 0,
            "collate_fn": None,
            "executor": executor,
        }
        metrics = run_validation(group, _dataset(5), _reward, **kwargs)
        assert run_validation(group, [], _reward, **kwargs) == {}
        assert run_validation(group, None, _reward, **kwargs) == {}
    executor.shutdown()
    # rows of a batch of 2 prompts x 2 samples have response lengths 1, 2, 3, 1 (row % R + 1)
    assert metrics["val-core/src0/reward/mean@2"] > 0
    assert {k.split("/")[1] for k in metrics} == {"src0", "src1"}
