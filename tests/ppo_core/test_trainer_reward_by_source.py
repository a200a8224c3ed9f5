"""Training steps log the reward per data source with the reward function's numeric extra infos, and time the wait
for an asynchronous reward apart from the advantages (``timing_s/reward_wait``)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from tensordict import TensorDict

import ppo_core.trainer.base as trainer_base
from ppo_core.backends import LocalWorkerGroup
from ppo_core.keys import KEYS
from ppo_core.metrics import Timer
from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers import Dispatch, Worker, WorkerSpec, register

R = 2


class FixedActor(Worker):
    """Answers ``[1, 2]`` to every prompt."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
        b = batch.batch_size[0]
        responses = torch.tensor([[1, 2]]).expand(b, R).clone()
        mask = torch.ones(b, R, dtype=torch.long)
        return TensorDict(
            {
                KEYS.prompts: batch[KEYS.input_ids],
                KEYS.responses: responses,
                KEYS.input_ids: torch.cat([batch[KEYS.input_ids], responses], -1),
                KEYS.attention_mask: torch.cat([batch[KEYS.attention_mask], mask], -1),
                KEYS.response_mask: mask,
            },
            batch_size=[b],
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        return TensorDict(
            {KEYS.old_log_probs: torch.zeros(batch.batch_size[0], R)}, batch_size=batch.batch_size
        )

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        return {}


class Trainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(WorkerSpec(FixedActor))


def _config(tmp_path, batch: int) -> PPOConfig:
    return PPOConfig.from_dict(
        {
            "data": {"train_batch_size": batch, "shuffle": False},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
            "rollout": {"n": 1},
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


def _fit(trainer: BasePPOTrainer) -> dict[str, float]:
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_step_metrics_hold_the_reward_of_each_data_source(tmp_path):
    sources = ["gsm8k", "math", "gsm8k", "gsm8k", "math", "other"]
    data = [{"input_ids": [3, 4], "data_source": s, "ground_truth": i} for i, s in enumerate(sources)]

    def reward(batch):
        truth = torch.tensor([float(t) for t in batch.get("ground_truth").tolist()])
        acc = [float(int(t) % 2 == 0) for t in truth.tolist()]
        return truth, {"acc": acc, "pred": [str(int(t)) for t in truth.tolist()]}  # pred is not a number

    metrics = _fit(Trainer(_config(tmp_path, 6), train_dataset=data, reward_fn=reward))
    # written out from the table above: ground truth i is the score, acc is "i is even"
    assert metrics["reward/gsm8k/count"] == 3 and metrics["reward/gsm8k/score/mean"] == pytest.approx(5 / 3)
    assert metrics["reward/gsm8k/acc/mean"] == pytest.approx(2 / 3)  # rows 0, 2, 3
    assert metrics["reward/math/score/mean"] == pytest.approx(2.5) and metrics["reward/math/acc/mean"] == 0.5
    assert metrics["reward/other/count"] == 1 and metrics["reward/other/acc/mean"] == 0.0
    assert not any(k.endswith("/pred/mean") for k in metrics)


def test_prompts_without_a_data_source_are_unknown(tmp_path):
    data = [{"input_ids": [3, 4], "ground_truth": 1} for _ in range(2)]
    metrics = _fit(Trainer(_config(tmp_path, 2), train_dataset=data, reward_fn=lambda b: torch.ones(2)))
    assert metrics["reward/unknown/count"] == 2 and metrics["reward/unknown/score/mean"] == 1.0


def test_an_asynchronous_reward_is_awaited_inside_reward_wait(tmp_path, monkeypatch):
    """The Future's result is taken while the ``reward_wait`` timer is open and no other stage's is."""
    seen: list[list[str]] = []

    class RecordingTimer(Timer):
        def __init__(self) -> None:
            super().__init__()
            timers.append(self)

    timers: list[RecordingTimer] = []
    monkeypatch.setattr(trainer_base, "Timer", RecordingTimer)

    class Pending(concurrent.futures.Future):
        def result(self, timeout=None):
            seen.append(list(timers[-1]._open))
            return super().result(timeout)

    def reward(batch):
        future = Pending()
        future.set_result(torch.ones(batch.batch_size[0]))
        return future

    data = [{"input_ids": [3, 4], "data_source": "x"} for _ in range(2)]
    metrics = _fit(Trainer(_config(tmp_path, 2), train_dataset=data, reward_fn=reward))
    assert seen == [["step", "reward_wait"]]
    assert "timing_s/reward_wait" in metrics and "timing_s/adv" in metrics
