"""``trainer.resident_batches``: a TinyGPT GRPO run with the batch resident in the actor's workers equals the
by-value run bit for bit (sampled tokens, log-probs, advantages, weights, metrics)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_trainer_loop import (
    EOS,
    PAD,
    R,
    ToyActor,
    V,
    deterministic,
    make_config,
    make_dataset,
    reward_first_token,
)

from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import BasePPOTrainer, read_metrics_jsonl
from ppo_core.workers import Dispatch, WorkerSpec, get_registration, register
from ppo_core.workers.ppo import ACTOR_UPDATE_KEYS
from ppo_core.workers.torch import TorchActorWorker

RECORDS: list[tuple[int, str, torch.Tensor]] = []
KEYS_SEEN: list[frozenset] = []


def _recording(base: type, weights) -> type:
    """``base`` (an actor worker) recording what each rank sampled, computed, was updated with, and its weights."""

    def same_reads(name: str) -> dict:  # keep the base's declared keys: a handle materialises only those
        reg = get_registration(getattr(base, name))
        return {"reads": reg.reads, "may_read": reg.may_read}

    class Recording(base):
        @register(dispatch=Dispatch.DP_COMPUTE, **same_reads("generate_sequences"))
        def generate_sequences(self, batch, do_sample: bool = True, **kwargs):
            out = super().generate_sequences(batch, do_sample, **kwargs)
            if do_sample:
                RECORDS.append((self.rank, "responses", out["responses"].clone()))
            return out

        @register(dispatch=Dispatch.DP_COMPUTE, **same_reads("compute_log_prob"))
        def compute_log_prob(self, batch):
            out = super().compute_log_prob(batch)
            RECORDS.append((self.rank, "old_log_probs", out["old_log_probs"].clone()))
            return out

        @register(dispatch=Dispatch.DP_COMPUTE_METRIC, **same_reads("update_actor"))
        def update_actor(self, batch):
            RECORDS.append((self.rank, "advantages", batch["advantages"].clone()))
            KEYS_SEEN.append(frozenset(batch.keys()))
            out = super().update_actor(batch)
            for name, p in weights(self):
                RECORDS.append((self.rank, f"weight:{name}", p.detach().clone()))
            return out

    return Recording


RecordingTorchActor = _recording(TorchActorWorker, lambda w: w.engine.named_parameters())
RecordingToyActor = _recording(ToyActor, lambda w: [("logits", w.logits)])


class GRPOTrainer(BasePPOTrainer):
    """TinyGPT through the torch actor (one rank: its data parallelism needs processes), or the toy actor."""

    def init_workers(self) -> None:
        from ppo_core.models import TinyGPT, TinyGPTConfig

        if self.config.actor.world_size > 1:
            spec = WorkerSpec(RecordingToyActor)
        else:
            sizes = {"vocab_size": V, "max_seq_len": 8, "d_model": 16, "n_heads": 2}
            policy = functools.partial(TinyGPT, TinyGPTConfig(**sizes), seed=1)
            spec = WorkerSpec(RecordingTorchActor, (policy, self.config.actor.worker))
        self.actor_wg = LocalWorkerGroup(spec, self.config.actor.world_size)


def _run(path, resident: bool, world: int) -> tuple[list, dict]:
    RECORDS.clear()
    KEYS_SEEN.clear()
    cfg = make_config(
        path,
        algorithm={"adv_estimator": "grpo", "use_kl_in_reward": False},
        rollout={"n": 2},
        actor={
            "world_size": world,
            "worker": {}
            if world > 1
            else {
                "ppo_mini_batch_size": 2,
                "ppo_epochs": 2,
                "optim": {"lr": 1e-2},
                "rollout": {"max_new_tokens": R, "eos_token_id": EOS, "pad_token_id": PAD},
            },
        },
        trainer={"total_epochs": 1, "save_freq": 0, "test_freq": 0, "resident_batches": resident},
    )
    trainer = GRPOTrainer(cfg, train_dataset=make_dataset(6), val_dataset=[], reward_fn=reward_first_token)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return list(RECORDS), deterministic(read_metrics_jsonl(path)), list(KEYS_SEEN)


@pytest.mark.parametrize("world", [1, 2], ids=["tinygpt-world1", "toy-world2"])
def test_resident_grpo_equals_the_by_value_run_bit_for_bit(tmp_path, world) -> None:
    by_value, value_metrics, _ = _run(tmp_path / "value", resident=False, world=world)
    resident, resident_metrics, seen = _run(tmp_path / "resident", resident=True, world=world)
    if (
        world == 1
    ):  # the torch actor declares what update_actor reads: only that is materialised from the store
        assert seen and set(seen) == {frozenset(ACTOR_UPDATE_KEYS)}
    assert [(r, k) for r, k, _ in resident] == [(r, k) for r, k, _ in by_value]
    kinds = {k.split(":")[0] for _, k, _ in by_value}
    assert {"responses", "old_log_probs", "advantages", "weight"} <= kinds
    for (rank, kind, a), (_, _, b) in zip(by_value, resident, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (rank, kind)
    assert sorted(value_metrics) == sorted(resident_metrics) == [1, 2, 3]
    for step, values in value_metrics.items():
        assert resident_metrics[step].keys() == values.keys()
        for key, value in values.items():
            assert resident_metrics[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (
                step,
                key,
            )
    # both log the step's controller bytes (at these sizes handles cost about what the rows do: the
    # savings are measured by benchmarks/resident_bytes.py)
    for name in ("value", "resident"):
        assert all(r["perf/controller_bytes"] > 0 for r in read_metrics_jsonl(tmp_path / name))


def test_resident_batches_refuse_what_they_do_not_support_yet(tmp_path) -> None:
    # GRPO with the KL penalty in the reward needs reference log-probs: refused when the config is built (a
    # ``ppo-core train`` job before any model loads), not at the first step
    with pytest.raises(ValueError, match=r"resident_batches=True does not support reference log-probs"):
        make_config(
            tmp_path,
            algorithm={"adv_estimator": "grpo"},
            actor={"world_size": 2},
            trainer={"resident_batches": True, "save_freq": 0},
        )
