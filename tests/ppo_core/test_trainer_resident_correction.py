"""``trainer.resident_batches`` with ``algorithm.rollout_correction``: the ranks compute the importance weights and
the rejection on their rows; the batch normalisation's mean and the ``rollout_corr/*`` metrics come from their
parts. Three GRPO steps on toy workers whose sampler's log-probs differ from the training forward's, against the
by-value run: the weights and the masks the actor's update reads, the advantages and the policy bit for bit, every
metric within 1e-6 relative."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from test_trainer_loop import R, ToyActor, deterministic, make_config, make_dataset, reward_first_token

from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import BasePPOTrainer, read_metrics_jsonl
from ppo_core.workers import Dispatch, WorkerSpec, register

RECORDS: list[tuple[int, str, torch.Tensor]] = []


class MismatchActor(ToyActor):
    """The toy policy whose sampler reports log-probs off by seeded noise (``rollout_log_probs``), and whose update
    applies the rollout correction's weights; records what its update read and its parameters after it."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
        out = super().generate_sequences(batch, do_sample)
        logp = self._log_probs(self.logits.detach(), out["responses"])
        noise = 0.4 * torch.randn(logp.shape, generator=self.gen)
        out.set("rollout_log_probs", torch.where(out["response_mask"].bool(), logp + noise, torch.nan))
        return out

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        for key in ("advantages", "response_mask", "rollout_is_weights"):
            if key in batch:
                RECORDS.append((self.rank, key, batch[key].clone()))
        mask = batch["response_mask"].float()
        logp = self._log_probs(self.logits, batch["responses"])
        ratio = torch.exp(logp - batch["old_log_probs"])
        adv = batch["advantages"]
        loss_mat = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        if "rollout_is_weights" in batch:
            loss_mat = loss_mat * batch["rollout_is_weights"]
        loss = (loss_mat * mask).sum() / mask.sum().clamp(min=1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        RECORDS.append((self.rank, "weight", self.logits.detach().clone()))
        return {"actor/pg_loss": loss.item()}


class MismatchTrainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(WorkerSpec(MismatchActor), self.config.actor.world_size)


CORRECTIONS = {
    "token-tis": {"rollout_is": "token", "rollout_is_threshold": 1.5},
    "sequence-mis-batch-normalized": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
    },
    "token-tis-batch-normalized-with-rejection": {
        "rollout_is": "token",
        "rollout_is_threshold": 1.3,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "2.0,0.05",
    },
    "sequence-rejection-only": {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.08},
}


def _run(path, resident: bool, world: int, correction: dict) -> tuple[list, dict]:
    RECORDS.clear()
    cfg = make_config(
        path,
        data={"train_batch_size": 4},
        rollout={"n": 2},
        algorithm={"adv_estimator": "grpo", "use_kl_in_reward": False, "rollout_correction": correction},
        actor={"world_size": world, "worker": {}},
        trainer={"total_epochs": 1, "save_freq": 0, "test_freq": 0, "resident_batches": resident},
    )
    trainer = MismatchTrainer(
        cfg, train_dataset=make_dataset(12), val_dataset=[], reward_fn=reward_first_token
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return list(RECORDS), deterministic(read_metrics_jsonl(path))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_resident_rollout_correction_equals_the_by_value_run(tmp_path, world, name) -> None:
    correction = CORRECTIONS[name]
    by_value, value_metrics = _run(tmp_path / "value", False, world, correction)
    resident, resident_metrics = _run(tmp_path / "resident", True, world, correction)
    kinds = [(rank, kind) for rank, kind, _ in by_value]
    assert kinds == [(rank, kind) for rank, kind, _ in resident]
    assert ("rollout_is_weights" in {k for _, k in kinds}) == ("rollout_is" in correction)
    for (rank, kind, a), (_, _, b) in zip(by_value, resident, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (rank, kind)
    masks = [m for _, k, m in by_value if k == "response_mask"]
    if "rollout_rs" in correction:  # some tokens rejected, not all: the update's mask is the policy mask
        rejected = [value_metrics[s]["rollout_corr/rollout_rs_masked_fraction"] for s in (1, 2, 3)]
        assert any(0 < r < 1 for r in rejected), rejected
    else:
        assert "rollout_corr/rollout_rs_masked_fraction" not in value_metrics[1]
    assert masks and all(m.shape[-1] == R for m in masks)
    if correction.get("rollout_is_batch_normalize"):
        factors = [value_metrics[s]["rollout_corr/rollout_is_batch_norm_factor"] for s in (1, 2, 3)]
        assert all(f != 1.0 for f in factors), factors
    assert sorted(value_metrics) == sorted(resident_metrics) == [1, 2, 3]
    for step, values in value_metrics.items():
        assert resident_metrics[step].keys() == values.keys()
        assert any(key.startswith("rollout_corr/") for key in values)
        for key, value in values.items():
            assert resident_metrics[step][key] == pytest.approx(value, rel=1e-6, abs=1e-12), (step, key)


def test_resident_rollout_correction_needs_the_rollout_log_probs(tmp_path) -> None:
    class NoRolloutLogProbs(MismatchActor):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
            return ToyActor.generate_sequences(self, batch, do_sample)

    class Trainer(BasePPOTrainer):
        def init_workers(self) -> None:
            self.actor_wg = LocalWorkerGroup(WorkerSpec(NoRolloutLogProbs), 2)

    cfg = make_config(
        tmp_path,
        algorithm={
            "adv_estimator": "grpo",
            "use_kl_in_reward": False,
            "rollout_correction": {"rollout_is": "token"},
        },
        actor={"world_size": 2, "worker": {}},
        trainer={"total_epochs": 1, "save_freq": 0, "test_freq": 0, "resident_batches": True},
    )
    trainer = Trainer(cfg, train_dataset=make_dataset(4), val_dataset=[], reward_fn=reward_first_token)
    try:
        with pytest.raises(ValueError, match="generate_sequences returned no 'rollout_log_probs'"):
            trainer.fit()
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_passes_over_its_tokens_once_a_step(tmp_path, monkeypatch, world) -> None:
    """The rows (weights, rejection) and the metrics' parts share every per-token term: each rank computes them in
    one pass a step, the parts kept for the controller's gather that follows the rows' dispatch."""
    from ppo_core.rollout_correction import compute

    calls = []
    real = compute._correction_rows

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(compute, "_correction_rows", counting)
    _run(tmp_path, True, world, CORRECTIONS["token-tis-batch-normalized-with-rejection"])
    steps = 3  # 12 prompts, 4 a step
    assert len(calls) == steps * world
    assert sum(calls) == steps * 4 * 2  # every row (4 prompts x n = 2) once a step


def test_the_parts_memo_serves_only_the_rows_it_was_kept_for() -> None:
    """Kept parts are given back once, for the very tensors and an equal config; anything else is computed again
    (the same values either way)."""
    from ppo_core.rollout_correction import RolloutCorrectionConfig
    from ppo_core.workers.resident_ops import CorrectionPartsMemo, correction_parts

    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, R, generator=gen)
    batch = TensorDict(
        {
            "old_log_probs": old,
            "rollout_log_probs": old + 0.1 * torch.randn(3, R, generator=gen),
            "response_mask": torch.ones(3, R, dtype=torch.long),
        },
        batch_size=[3],
    )
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5)
    memo = CorrectionPartsMemo()
    memo.rows(batch, config)
    kept = memo._kept[2]
    assert memo.parts(batch, config) is kept
    again = memo.parts(batch, config)  # taken once: computed afresh, the same values
    assert again is not kept and again == correction_parts(batch, config)
    memo.rows(batch, config)
    kept = memo._kept[2]
    other = batch.clone()  # equal values, other tensors
    assert memo.parts(other, config) is not kept
    memo.rows(batch, config)
    kept = memo._kept[2]
    assert (
        memo.parts(batch, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)) is not kept
    )
