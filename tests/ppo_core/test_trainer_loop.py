"""BasePPOTrainer end to end on tiny deterministic fake workers (pure torch, CPU): resume, async rewards,
validation edge cases, reward errors, critic warm-up, data parallel and colocated groups."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
from typing import ClassVar

import pytest
import torch
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import BasePPOTrainer, PPOConfig, RewardFunctionError, read_metrics_jsonl
from ppo_core.trainer.checkpoint import find_latest_checkpoint, load_trainer_state
from ppo_core.trainer.manifest import write_manifest
from ppo_core.workers import ColocatedWorker, Dispatch, Worker, WorkerSpec, register

V, R, EOS, PAD = 6, 3, 0, 0


class ToyActor(Worker):
    """A policy with one logit vector per response position (ignores the prompt); samples with its own
    generator, which it checkpoints together with the parameters and the optimiser."""

    def __init__(self, seed: int = 0, lr: float = 0.3) -> None:
        super().__init__()
        self.logits = torch.zeros(R, V, requires_grad=True)
        self.ref_logits = self.logits.detach().clone()
        self.opt = torch.optim.Adam([self.logits], lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1000 * self.rank)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict, do_sample: bool = True) -> TensorDict:
        prompt, prompt_mask = batch["input_ids"], batch["attention_mask"]
        bsz = prompt.shape[0]
        probs = torch.softmax(self.logits.detach(), -1)
        if do_sample:
            flat = probs.unsqueeze(0).expand(bsz, R, V).reshape(bsz * R, V)
            tokens = torch.multinomial(flat, 1, generator=self.gen).view(bsz, R)
        else:
            tokens = probs.argmax(-1).unsqueeze(0).expand(bsz, R).clone()
        eos = (tokens == EOS).long()
        mask = (eos.cumsum(-1) - eos) == 0  # up to and including the first EOS
        responses = torch.where(mask, tokens, torch.full_like(tokens, PAD))
        return TensorDict(
            {
                "prompts": prompt,
                "responses": responses,
                "input_ids": torch.cat([prompt, responses], -1),
                "attention_mask": torch.cat([prompt_mask, mask.long()], -1),
                "response_mask": mask.long(),
            },
            batch_size=[bsz],
        )

    @staticmethod
    def _log_probs(logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        return (
            logp.unsqueeze(0).expand(responses.shape[0], R, V).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        logp = self._log_probs(self.logits.detach(), batch["responses"])
        p = torch.softmax(self.logits.detach(), -1)
        entropy = -(p * p.log()).sum(-1).expand(logp.shape[0], R)
        return TensorDict({"old_log_probs": logp, "entropies": entropy}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        return TensorDict(
            {"ref_log_probs": self._log_probs(self.ref_logits, batch["responses"])},
            batch_size=batch.batch_size,
        )

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        mask = batch["response_mask"].float()
        logp = self._log_probs(self.logits, batch["responses"])
        ratio = torch.exp(logp - batch["old_log_probs"])
        adv = batch["advantages"]
        loss_mat = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = (loss_mat * mask).sum() / mask.sum().clamp(min=1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"actor/pg_loss": loss.item(), "actor/n_rows/max": float(batch.batch_size[0])}

    @register()
    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        state = {"logits": self.logits.detach(), "opt": self.opt.state_dict(), "gen": self.gen.get_state()}
        torch.save(state, os.path.join(path, f"rank{self.rank}.pt"))

    @register()
    def load_checkpoint(self, path: str) -> None:
        state = torch.load(os.path.join(path, f"rank{self.rank}.pt"))
        with torch.no_grad():
            self.logits.copy_(state["logits"])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])


class ToyCritic(Worker):
    """One value per response position, fitted by MSE."""

    def __init__(self, lr: float = 0.3) -> None:
        super().__init__()
        self.v = torch.zeros(R, requires_grad=True)
        self.opt = torch.optim.Adam([self.v], lr=lr)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, batch: TensorDict) -> TensorDict:
        values = self.v.detach().expand(batch.batch_size[0], R).clone()
        return TensorDict({"values": values}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        mask = batch["response_mask"].float()
        loss = (((self.v - batch["returns"]) ** 2) * mask).sum() / mask.sum().clamp(min=1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"critic/vf_loss": loss.item()}

    @register()
    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save(
            {"v": self.v.detach(), "opt": self.opt.state_dict()}, os.path.join(path, f"rank{self.rank}.pt")
        )

    @register()
    def load_checkpoint(self, path: str) -> None:
        state = torch.load(os.path.join(path, f"rank{self.rank}.pt"))
        with torch.no_grad():
            self.v.copy_(state["v"])
        self.opt.load_state_dict(state["opt"])


class ToyTrainer(BasePPOTrainer):
    def init_workers(self) -> None:
        self.actor_wg = LocalWorkerGroup(
            WorkerSpec(ToyActor, kwargs=self.config.actor.worker), self.config.actor.world_size
        )
        if self.config.use_critic:
            self.critic_wg = LocalWorkerGroup(WorkerSpec(ToyCritic), self.config.critic.world_size)


class ColocatedToyTrainer(BasePPOTrainer):
    def init_workers(self) -> None:
        roles = {"actor": WorkerSpec(ToyActor), "critic": WorkerSpec(ToyCritic)}
        group = LocalWorkerGroup(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world_size=2)
        self.actor_wg, self.critic_wg = group.role("actor"), group.role("critic")


def make_dataset(n: int, offset: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(123 + offset)
    return [
        {
            "input_ids": torch.randint(1, V, (1 + i % 3,), generator=g).tolist(),
            "ground_truth": int(torch.randint(1, V, (1,), generator=g)),
            "data_source": "toy" if i % 2 else "toy2",
        }
        for i in range(n)
    ]


def reward_first_token(batch: TensorDict) -> torch.Tensor:
    """1 when the first response token equals the ground truth."""
    truth = torch.tensor(batch.get("ground_truth").tolist())
    return (batch["responses"][:, 0] == truth).float()


def make_config(tmp_path, **overrides) -> PPOConfig:
    cfg = {
        "data": {"train_batch_size": 2, "seed": 3},
        "rollout": {"n": 2},
        "algorithm": {
            "adv_estimator": "gae",
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 10},
        },
        "trainer": {
            "total_epochs": 2,
            "save_freq": 1,
            "test_freq": 2,
            "default_local_dir": str(tmp_path),
            "progress_bar": False,
            "seed": 7,
        },
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    return PPOConfig.from_dict(cfg)


# a resumed run's first step also asks the fresh groups for their layout: its controller bytes differ
NONDETERMINISTIC = (
    "timing_s/",
    "timing_per_token_ms/",
    "perf/time_per_step",
    "perf/throughput",
    "perf/controller_bytes",
)


def deterministic(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC)} for r in records}


def run(trainer_cls, cfg, reward_fn=reward_first_token, train=None, val=None) -> BasePPOTrainer:
    trainer = trainer_cls(
        cfg,
        train_dataset=make_dataset(6) if train is None else train,
        val_dataset=make_dataset(3, offset=1) if val is None else val,
        reward_fn=reward_fn,
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 6-step run (2 epochs of 3 batches): its metrics per step."""
    path = tmp_path_factory.mktemp("uninterrupted")
    run(ToyTrainer, make_config(path))
    return deterministic(read_metrics_jsonl(path))


def crash_at(step: int):
    def reward(batch: TensorDict) -> torch.Tensor:
        if batch.get("uid").tolist()[0].startswith(f"{step}:"):
            raise RuntimeError("reward server went away")
        return reward_first_token(batch)

    return reward


@pytest.mark.parametrize("killed_after", [2, 3, 4])  # 3 is an epoch boundary
def test_resume_reproduces_the_uninterrupted_run(tmp_path, reference_run, killed_after):
    cfg = make_config(tmp_path)
    with pytest.raises(RewardFunctionError, match=f"step {killed_after + 1}"):
        run(ToyTrainer, cfg, reward_fn=crash_at(killed_after + 1))
    assert find_latest_checkpoint(tmp_path).endswith(f"global_step_{killed_after}")
    assert max(deterministic(read_metrics_jsonl(tmp_path))) == killed_after

    resumed = run(ToyTrainer, cfg)
    assert resumed.global_steps == 6
    got = deterministic(read_metrics_jsonl(tmp_path))
    assert sorted(got) == sorted(reference_run) == [0, 1, 2, 3, 4, 5, 6]
    for step in range(killed_after + 1, 7):
        assert got[step].keys() == reference_run[step].keys()
        for key, value in reference_run[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)
    # the KL coefficient moved (adaptive) and was restored, not reset
    betas = [reference_run[s]["actor/reward_kl_penalty_coeff"] for s in range(1, 7)]
    assert len(set(betas)) > 1


def test_resume_without_restoring_the_kl_controller_would_differ(tmp_path, reference_run):
    """The resume test can fail: dropping the KL state from the checkpoint changes the resumed metrics."""
    cfg = make_config(tmp_path)
    with pytest.raises(RewardFunctionError):
        run(ToyTrainer, cfg, reward_fn=crash_at(3))
    state_file = os.path.join(find_latest_checkpoint(tmp_path), "trainer_state.pt")
    state = load_trainer_state(os.path.dirname(state_file))
    state["kl_ctrl"] = None
    torch.save(state, state_file)
    # a deliberate edit: record it in the manifest, or the resume refuses the changed file
    write_manifest(os.path.dirname(state_file))
    run(ToyTrainer, cfg)
    got = deterministic(read_metrics_jsonl(tmp_path))
    assert got[3]["actor/reward_kl_penalty_coeff"] != reference_run[3]["actor/reward_kl_penalty_coeff"]


def test_reward_error_names_step_and_batch_and_keeps_checkpoints(tmp_path):
    with pytest.raises(RewardFunctionError) as info:
        run(ToyTrainer, make_config(tmp_path), reward_fn=crash_at(3))
    message = str(info.value)
    assert "step 3" in message and "4 samples" in message and "uids [3:0, 3:0, 3:1, 3:1]" in message
    assert info.value.step == 3 and info.value.batch.batch_size[0] == 4
    assert isinstance(info.value.__cause__, RuntimeError)
    for step in (1, 2):
        state = load_trainer_state(os.path.join(tmp_path, f"global_step_{step}"))
        assert state["global_steps"] == step
    assert not os.path.exists(os.path.join(tmp_path, "global_step_3"))


@pytest.mark.parametrize("kind", ["future", "awaitable"])
def test_async_reward_matches_sync(tmp_path, reference_run, kind):
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def future_reward(batch):
        return pool.submit(reward_first_token, batch)

    async def awaitable_reward(batch):
        await asyncio.sleep(0)
        return reward_first_token(batch)

    reward = future_reward if kind == "future" else awaitable_reward
    try:
        run(ToyTrainer, make_config(tmp_path), reward_fn=reward)
    finally:
        pool.shutdown()
    got = deterministic(read_metrics_jsonl(tmp_path))
    assert got.keys() == reference_run.keys()
    for step, metrics in reference_run.items():
        for key, value in metrics.items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


def test_async_reward_failure_is_reported_at_await(tmp_path):
    async def broken(batch):
        raise ValueError("bad judge")

    with pytest.raises(RewardFunctionError, match=r"step 1 .*ValueError: bad judge"):
        run(ToyTrainer, make_config(tmp_path), reward_fn=broken, val=[])


def test_empty_validation_logs_nothing_and_goes_on(tmp_path):
    cfg = make_config(tmp_path, trainer={"test_freq": 1, "save_freq": 0, "total_epochs": 1})
    trainer = run(ToyTrainer, cfg, val=[])
    records = read_metrics_jsonl(tmp_path)
    assert trainer.global_steps == 3
    assert [r["step"] for r in records] == [1, 2, 3]
    assert not any(k.startswith("val") for r in records for k in r)


def test_validation_logs_reward_and_extra_infos(tmp_path):
    def with_extras(batch):
        scores = reward_first_token(batch)
        return scores, {"acc": (scores > 0).tolist()}

    cfg = make_config(
        tmp_path, trainer={"test_freq": 0, "save_freq": 0, "total_epochs": 1}, rollout={"val_n": 2}
    )
    run(ToyTrainer, cfg, reward_fn=with_extras)
    records = {r["step"]: r for r in read_metrics_jsonl(tmp_path)}
    assert any(k.startswith("val-core/toy/acc/mean@2") for k in records[0])  # before training
    assert any(k.startswith("val-core/toy2/acc/") for k in records[3])  # at the end
    assert not any(k.startswith("val") for k in records[1])  # test_freq=0: not in between
    # greedy validation of identical prompts: every sample of a prompt gets the same reward
    assert records[0]["val-aux/toy/reward/std@2"] == 0.0


def test_critic_warmup_skips_exactly_k_actor_updates(tmp_path):
    cfg = make_config(tmp_path, trainer={"critic_warmup": 2, "save_freq": 0, "total_epochs": 1})
    run(ToyTrainer, cfg)
    records = {r["step"]: r for r in read_metrics_jsonl(tmp_path)}
    assert [("actor/pg_loss" in records[s]) for s in (1, 2, 3)] == [False, False, True]
    assert all("critic/vf_loss" in records[s] for s in (1, 2, 3))


def test_grpo_without_critic_or_reference(tmp_path):
    cfg = make_config(
        tmp_path,
        algorithm={"adv_estimator": "grpo", "use_kl_in_reward": False},
        rollout={"n": 4},
        trainer={"save_freq": 0, "total_epochs": 1},
    )
    trainer = run(ToyTrainer, cfg)
    assert trainer.critic_wg is None
    last = read_metrics_jsonl(tmp_path)[-1]
    assert "critic/values/mean" not in last and "actor/reward_kl_penalty" not in last
    assert math.isfinite(last["actor/pg_loss"])
    # every step's bytes through the controller: the whole batch went out and came back several times
    sent, received = last["perf/controller_bytes_sent"], last["perf/controller_bytes_received"]
    assert last["perf/controller_bytes"] == sent + received
    rows = cfg.data.train_batch_size * 4
    assert sent > rows * R * 8 and received > rows * R * 8  # at least [B, R] int64 each way


def test_data_parallel_groups_agree_with_one_rank_on_deterministic_parts(tmp_path):
    """Two simulated dp ranks: each samples half the batch with its own generator; the loop runs through."""
    cfg = make_config(
        tmp_path, actor={"world_size": 2}, critic={"world_size": 2}, trainer={"total_epochs": 1}
    )
    trainer = run(ToyTrainer, cfg)
    last = read_metrics_jsonl(tmp_path)[-1]
    assert trainer.global_steps == 3
    assert last["actor/n_rows/max"] == 2.0  # each dp rank updated on its 2 of the 4 rows
    assert os.path.exists(os.path.join(tmp_path, "global_step_3", "actor", "rank1.pt"))


def test_colocated_roles_train(tmp_path):
    cfg = make_config(tmp_path, trainer={"total_epochs": 1, "save_freq": 3})
    trainer = run(ColocatedToyTrainer, cfg)
    assert trainer.global_steps == 3
    assert os.path.exists(os.path.join(tmp_path, "global_step_3", "critic", "rank1.pt"))
    assert "critic/vf_loss" in read_metrics_jsonl(tmp_path)[-1]


def test_missing_critic_group_is_a_clear_error(tmp_path):
    class NoCritic(BasePPOTrainer):
        def init_workers(self):
            self.actor_wg = LocalWorkerGroup(ToyActor)

    trainer = NoCritic(make_config(tmp_path), train_dataset=make_dataset(4), reward_fn=reward_first_token)
    with pytest.raises(ValueError, match="critic_wg"):
        trainer.fit()


def test_too_few_prompts_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train_batch_size"):
        ToyTrainer(make_config(tmp_path), train_dataset=make_dataset(1), reward_fn=reward_first_token)


def test_missing_worker_methods_are_named(tmp_path):
    class NoUpdate(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def generate_sequences(self, batch):
            return batch

    class Partial(BasePPOTrainer):
        def init_workers(self):
            self.actor_wg = LocalWorkerGroup(NoUpdate)
            self.critic_wg = LocalWorkerGroup(ToyCritic)

    cfg = make_config(tmp_path, algorithm={"use_kl_in_reward": False})
    trainer = Partial(cfg, train_dataset=make_dataset(4), reward_fn=reward_first_token)
    with pytest.raises(
        ValueError, match=r"\['compute_log_prob', 'update_actor', 'save_checkpoint', 'load_checkpoint'\]"
    ):
        trainer.fit()


class KeyRecordingActor(ToyActor):
    seen: ClassVar[list[set]] = []

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        KeyRecordingActor.seen.append(set(batch.keys()))
        return super().update_actor(batch)


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_kl_loss_sends_reference_log_probs_to_the_actor(tmp_path, use_kl_loss):
    class Trainer(BasePPOTrainer):
        def init_workers(self):
            self.actor_wg = LocalWorkerGroup(KeyRecordingActor)

    KeyRecordingActor.seen = []
    cfg = make_config(
        tmp_path,
        algorithm={"adv_estimator": "grpo", "use_kl_in_reward": False},
        actor={"use_kl_loss": use_kl_loss},
        trainer={"save_freq": 0, "total_epochs": 1},
    )
    run(Trainer, cfg)
    assert len(KeyRecordingActor.seen) == 3
    for keys in KeyRecordingActor.seen:
        assert {"advantages", "old_log_probs", "responses", "response_mask", "uid"} <= keys
        assert ("ref_log_probs" in keys) is use_kl_loss


class TinyGPTTrainer(BasePPOTrainer):
    """The reference torch workers on a randomly initialised TinyGPT (actor + reference, critic)."""

    def init_workers(self) -> None:
        from ppo_core.models import TinyGPT, TinyGPTConfig
        from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker

        sizes = {"vocab_size": V, "max_seq_len": 8, "d_model": 16, "n_heads": 2}
        policy = functools.partial(TinyGPT, TinyGPTConfig(**sizes), seed=1)
        critic = functools.partial(TinyGPT, TinyGPTConfig(**sizes, value_head=True), seed=2)
        self.actor_wg = LocalWorkerGroup(WorkerSpec(TorchActorWorker, (policy, self.config.actor.worker)))
        self.critic_wg = LocalWorkerGroup(WorkerSpec(TorchCriticWorker, (critic, self.config.critic.worker)))


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_with_the_torch_workers(tmp_path):
    common = {"ppo_mini_batch_size": 2, "ppo_epochs": 2, "shuffle": True, "optim": {"lr": 1e-2}}
    rollout = {"max_new_tokens": R, "eos_token_id": EOS, "pad_token_id": PAD}
    overrides = {
        "actor": {"worker": {**common, "rollout": rollout}},
        "critic": {"worker": common},
        "trainer": {"total_epochs": 1},
    }
    run(TinyGPTTrainer, make_config(tmp_path / "a", **overrides))
    reference = deterministic(read_metrics_jsonl(tmp_path / "a"))
    with pytest.raises(RewardFunctionError):
        run(TinyGPTTrainer, make_config(tmp_path / "b", **overrides), reward_fn=crash_at(2))
    run(TinyGPTTrainer, make_config(tmp_path / "b", **overrides))
    got = deterministic(read_metrics_jsonl(tmp_path / "b"))
    assert sorted(got) == sorted(reference) == [0, 1, 2, 3]
    for step in (2, 3):
        assert got[step].keys() == reference[step].keys()
        for key, value in reference[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


def test_a_worker_left_at_the_default_mini_batch_is_warned_about_before_the_first_rollout(tmp_path, caplog):
    """A config of mappings gives the library workers their default mini-batch (256), which 2 prompts x 2
    responses do not fill: the warning names the keys at the start, before the run stops at the first update."""
    cfg = make_config(tmp_path, trainer={"total_epochs": 1, "save_freq": 0})
    trainer = TinyGPTTrainer(cfg, train_dataset=make_dataset(6), val_dataset=make_dataset(3, offset=1),
                             reward_fn=reward_first_token)  # fmt: skip
    try:
        trainer.init_workers()
        with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.base"):
            trainer._check_workers()
        warned = [
            r.getMessage() for r in caplog.records if "ppo_mini_batch_size is not set" in r.getMessage()
        ]
        assert [m.split(".")[0] for m in warned] == ["actor", "critic"]
        assert "default (256) does not divide" in warned[0] and "= 2 x 2 = 4" in warned[0]
        caplog.clear()
        sized = make_config(
            tmp_path,
            actor={"worker": {"ppo_mini_batch_size": 4}},
            critic={"worker": {"ppo_mini_batch_size": 2}},
        )
        trainer.config = sized
        with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.base"):
            trainer._check_workers()
        assert not [r for r in caplog.records if "ppo_mini_batch_size" in r.getMessage()]
    finally:
        trainer.shutdown()
