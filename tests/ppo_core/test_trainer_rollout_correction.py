"""algorithm.rollout_correction in BasePPOTrainer with the torch workers on a tiny TinyGPT (CPU): the weights and
the rejected tokens reach the actor's loss, the rest of the step keeps the full mask, off changes nothing, bypass."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from _tiny_lm import EOS, LM, PAD
from tensordict import TensorDict

from ppo_core import compute_rollout_correction
from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers import Dispatch, WorkerSpec, register
from ppo_core.workers.torch import TorchActorWorker

NOISE = 0.5


class MismatchedActor(TorchActorWorker):
    """The torch actor whose sampler reports log-probs off by deterministic noise (a stand-in for the kernels of
    a fast rollout engine); records every batch ``update_actor`` and ``compute_log_prob`` receive."""

    updates: ClassVar[list[TensorDict]] = []
    log_prob_calls: ClassVar[int] = 0
    drop_rollout_log_probs: ClassVar[bool] = False

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True, **kwargs) -> TensorDict:
        out = super().generate_sequences(batch, do_sample, **kwargs)
        g = torch.Generator().manual_seed(int(out["responses"].sum()) + out["responses"].numel())
        noise = NOISE * torch.randn(out["rollout_log_probs"].shape, generator=g)
        out["rollout_log_probs"] = (out["rollout_log_probs"] + noise) * out["response_mask"]
        if MismatchedActor.drop_rollout_log_probs:
            del out["rollout_log_probs"]
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        MismatchedActor.log_prob_calls += 1
        return super().compute_log_prob(batch)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        MismatchedActor.updates.append(batch.clone())
        return super().update_actor(batch)


class Trainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(WorkerSpec(MismatchedActor, (LM, self.config.actor.worker)))


def _dataset(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(1, EOS, (1 + i % 3,), generator=g).tolist(), "ground_truth": i % 3}
            for i in range(n)]  # fmt: skip


def _reward(batch: TensorDict) -> torch.Tensor:
    return (batch["responses"][:, 0] % 3 == torch.tensor(batch.get("ground_truth").tolist())).float()


def _fit(tmp_path, correction: dict | None = None, steps: int = 1) -> dict[str, float]:
    MismatchedActor.updates, MismatchedActor.log_prob_calls = [], 0
    algorithm = {"adv_estimator": "grpo"}
    if correction is not None:
        algorithm["rollout_correction"] = correction
    cfg = PPOConfig.from_dict({
        "data": {"train_batch_size": 2, "seed": 1},
        "rollout": {"n": 4},
        "algorithm": algorithm,
        "actor": {"worker": {
            "rollout": {"max_new_tokens": 4, "eos_token_id": EOS, "pad_token_id": PAD},
            "ppo_mini_batch_size": 8, "micro_batch_size": 3, "device": "cpu", "optim": {"lr": 1e-2},
        }},
        "trainer": {"total_epochs": 1, "total_training_steps": steps, "save_freq": 0, "test_freq": 0,
                    "default_local_dir": str(tmp_path), "progress_bar": False, "loggers": []},
    })  # fmt: skip
    trainer = Trainer(cfg, train_dataset=_dataset(), reward_fn=_reward)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


CORRECTION = {
    "rollout_is": "token",
    "rollout_is_threshold": 1.2,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": 1.5,
}


def test_weights_and_rejection_reach_the_actor_loss(tmp_path) -> None:
    metrics = _fit(tmp_path, CORRECTION)
    (batch,) = MismatchedActor.updates
    old, rollout, full_mask = (
        batch["old_log_probs"],
        batch["rollout_log_probs"],
        batch["attention_mask"][:, -4:],
    )
    weights, kept, expected = compute_rollout_correction(old, rollout, full_mask, CORRECTION)
    # the actor's mask is the rejected one; the weights are the truncated ratios
    torch.testing.assert_close(batch["response_mask"], kept, rtol=0, atol=0)
    torch.testing.assert_close(batch["rollout_is_weights"], weights, rtol=0, atol=0)
    n_kept, n_valid = int(kept.sum()), int(full_mask.sum())
    assert 0 < n_kept < n_valid  # the noise rejects some tokens, not all
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - n_kept / n_valid)
    assert {k: metrics[k] for k in expected} == expected
    log_ratio = (old - rollout)[kept.bool()]
    assert bool((log_ratio.abs() <= math.log(1.5) + 1e-6).all())
    # pg_loss of the single optimiser step, by hand: at the first step the policy is pi_old (ratio 1), so the
    # vanilla PPO loss is -sum(A * w) over the kept tokens divided by their number, across the 3 micro-batches
    manual = -(batch["advantages"] * weights * kept).sum() / kept.sum()
    assert metrics["actor/pg_loss"] == pytest.approx(float(manual), rel=1e-5, abs=1e-6)
    # the rest of the step counts every valid token
    assert metrics["response_length/mean"] == pytest.approx(float(full_mask.sum(-1).float().mean()))


def test_without_weights_the_loss_only_drops_rejected_tokens(tmp_path) -> None:
    metrics = _fit(tmp_path, {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.1})
    (batch,) = MismatchedActor.updates
    assert "rollout_is_weights" not in batch
    kept = batch["response_mask"]
    full = batch["attention_mask"][:, -4:]
    assert bool(((kept == full).all(-1) | (kept == 0).all(-1)).all())  # whole rows kept or rejected
    manual = -(batch["advantages"] * kept).sum() / kept.sum().clamp(min=1)
    assert metrics["actor/pg_loss"] == pytest.approx(float(manual), rel=1e-5, abs=1e-6)


def test_off_by_default_sends_the_actor_today_s_batch(tmp_path) -> None:
    default = _fit(tmp_path / "a", None, steps=2)
    batches = MismatchedActor.updates
    explicit = _fit(tmp_path / "b", {"rollout_is": None, "rollout_rs": None, "bypass_mode": False}, steps=2)
    timing = ("timing_s/", "timing_per_token_ms/", "perf/")
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(timing)}  # noqa: E731
    assert strip(default) == strip(explicit)
    assert not any(k.startswith("rollout_corr/") for k in default)
    for batch in batches:
        assert "rollout_is_weights" not in batch
        torch.testing.assert_close(batch["response_mask"], batch["attention_mask"][:, -4:], rtol=0, atol=0)
    assert MismatchedActor.log_prob_calls == 2


def test_bypass_mode_uses_the_rollout_log_probs_as_old(tmp_path) -> None:
    _fit(tmp_path, {"bypass_mode": True})
    (batch,) = MismatchedActor.updates
    assert MismatchedActor.log_prob_calls == 0
    torch.testing.assert_close(batch["old_log_probs"], batch["rollout_log_probs"], rtol=0, atol=0)


def test_correction_without_rollout_log_probs_is_a_clear_error(tmp_path) -> None:
    MismatchedActor.drop_rollout_log_probs = True
    try:
        with pytest.raises(ValueError, match=r"algorithm\.rollout_correction .*rollout_log_probs"):
            _fit(tmp_path, CORRECTION)
        with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.bypass_mode=True"):
            _fit(tmp_path, {"bypass_mode": True})
    finally:
        MismatchedActor.drop_rollout_log_probs = False
