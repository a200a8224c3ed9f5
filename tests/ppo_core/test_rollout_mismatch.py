"""The rollout/training mismatch metrics, and ``rollout.old_log_probs_from_rollout`` in the trainer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from test_trainer_loop import ToyActor, ToyCritic, make_config, run

from ppo_core.backends import LocalWorkerGroup
from ppo_core.metrics import rollout_probs_diff_metrics
from ppo_core.trainer import BasePPOTrainer
from ppo_core.trainer.tracking import read_metrics_jsonl
from ppo_core.workers import Dispatch, WorkerSpec, register


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 9))
def test_metrics_match_a_loop_over_valid_tokens(seed, rows, width):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 5
    old = rollout + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.1
    mask = torch.rand(rows, width, generator=g) > 0.3
    rollout[~mask] = float("nan")  # padding may hold anything
    diffs = [
        abs(math.exp(rollout[i, j]) - math.exp(old[i, j]))
        for i in range(rows)
        for j in range(width)
        if mask[i, j]
    ]
    got = rollout_probs_diff_metrics(rollout, old, mask)
    if not diffs:
        assert got == {f"training/rollout_probs_diff_{k}": 0.0 for k in ("max", "mean", "std")}
        return
    mean = sum(diffs) / len(diffs)
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) if len(diffs) > 1 else 0.0
    assert got["training/rollout_probs_diff_max"] == pytest.approx(max(diffs), abs=1e-12)
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(mean, abs=1e-12)
    assert got["training/rollout_probs_diff_std"] == pytest.approx(std, abs=1e-12)


def test_identical_engines_give_zero_and_half_precision_is_accepted():
    lp = -torch.rand(3, 4)
    got = rollout_probs_diff_metrics(lp.half(), lp.half(), torch.ones(3, 4))
    assert set(got.values()) == {0.0}


def test_a_non_finite_valid_position_is_named():
    lp = -torch.rand(2, 3)
    bad = lp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="old_log_probs is not finite"):
        rollout_probs_diff_metrics(lp, bad, torch.ones(2, 3))
    with pytest.raises(ValueError, match="must match"):
        rollout_probs_diff_metrics(lp, lp[:, :2], torch.ones(2, 3))


class RolloutLogProbActor(ToyActor):
    """The toy actor whose rollout reports the log-probs of its samples, off by ``offset`` (a numerical gap
    between the two engines), and counts its log-prob passes."""

    offset = 0.01
    log_prob_calls = 0  # over every instance (the groups run in this process)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
        out = super().generate_sequences(batch, do_sample)
        logp = self._log_probs(self.logits.detach(), out["responses"]) + self.offset
        out.set("rollout_log_probs", logp * out["response_mask"])
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        RolloutLogProbActor.log_prob_calls += 1
        return super().compute_log_prob(batch)


class MismatchTrainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(WorkerSpec(RolloutLogProbActor), 1)
        self.critic_wg = LocalWorkerGroup(WorkerSpec(ToyCritic), 1)


def test_trainer_logs_the_gap_between_rollout_and_training_probabilities(tmp_path):
    RolloutLogProbActor.log_prob_calls = 0
    run(MismatchTrainer, make_config(tmp_path, trainer={"total_epochs": 1}))
    records = read_metrics_jsonl(tmp_path)
    steps = [r for r in records if "training/rollout_probs_diff_mean" in r]
    assert len(steps) == 3
    for r in steps:
        # p * (e^0.01 - 1) for probabilities p below 1: positive, and at most e^0.01 - 1
        assert 0 < r["training/rollout_probs_diff_mean"] <= r["training/rollout_probs_diff_max"]
        assert r["training/rollout_probs_diff_max"] <= math.expm1(0.01) + 1e-6
    assert RolloutLogProbActor.log_prob_calls == 3


def test_old_log_probs_from_rollout_skip_the_log_prob_pass(tmp_path):
    RolloutLogProbActor.log_prob_calls = 0
    cfg = make_config(tmp_path, trainer={"total_epochs": 1}, rollout={"old_log_probs_from_rollout": True})
    run(MismatchTrainer, cfg)
    assert RolloutLogProbActor.log_prob_calls == 0
    records = read_metrics_jsonl(tmp_path)
    assert all("training/rollout_probs_diff_mean" not in r and "actor/entropy" not in r for r in records)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records if "actor/pg_loss" in r)


def test_old_log_probs_from_rollout_need_rollout_log_probs(tmp_path):
    class PlainTrainer(BasePPOTrainer):
        def init_workers(self) -> None:
            self.actor_wg = LocalWorkerGroup(WorkerSpec(ToyActor), 1)
            self.critic_wg = LocalWorkerGroup(WorkerSpec(ToyCritic), 1)

    cfg = make_config(tmp_path, rollout={"old_log_probs_from_rollout": True})
    with pytest.raises(
        ValueError, match="old_log_probs_from_rollout=True, but generate_sequences returned no"
    ):
        run(PlainTrainer, cfg)
