"""``trainer.resident_batches``: TinyGPT / toy GRPO and PPO runs with the batch resident in the workers equal the
by-value runs: GRPO bit for bit (sampled tokens, log-probs, advantages, weights), PPO (GAE + critic, colocated or in
separate groups) bit for bit up to the whitening and within 1e-6 relative after it; metrics within 1e-6 relative."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_trainer_loop import (
    EOS,
    PAD,
    R,
    ToyActor,
    ToyCritic,
    V,
    deterministic,
    make_config,
    make_dataset,
    reward_first_token,
)

from ppo_core.backends import LocalWorkerGroup
from ppo_core.trainer import BasePPOTrainer, read_metrics_jsonl
from ppo_core.trainer.worker_reward import WorkerReward
from ppo_core.workers import ColocatedWorker, Dispatch, WorkerSpec, get_registration, register
from ppo_core.workers.ppo import ACTOR_UPDATE_KEYS
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker

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


def _recording_critic(base: type, weights) -> type:
    """``base`` (a critic worker) recording the values it computed, the returns it was updated with, its weights."""

    def same_reads(name: str) -> dict:
        reg = get_registration(getattr(base, name))
        return {"reads": reg.reads, "may_read": reg.may_read}

    class RecordingCritic(base):
        @register(dispatch=Dispatch.DP_COMPUTE, **same_reads("compute_values"))
        def compute_values(self, batch):
            out = super().compute_values(batch)
            RECORDS.append((self.rank, "values", out["values"].clone()))
            return out

        @register(dispatch=Dispatch.DP_COMPUTE_METRIC, **same_reads("update_critic"))
        def update_critic(self, batch):
            RECORDS.append((self.rank, "returns", batch["returns"].clone()))
            out = super().update_critic(batch)
            for name, p in weights(self):
                RECORDS.append((self.rank, f"critic_weight:{name}", p.detach().clone()))
            return out

    return RecordingCritic


RecordingTorchActor = _recording(TorchActorWorker, lambda w: w.engine.named_parameters())
RecordingToyActor = _recording(ToyActor, lambda w: [("logits", w.logits)])
RecordingTorchCritic = _recording_critic(TorchCriticWorker, lambda w: w.engine.named_parameters())
RecordingToyCritic = _recording_critic(ToyCritic, lambda w: [("v", w.v)])

SIZES = {"vocab_size": V, "max_seq_len": 8, "d_model": 16, "n_heads": 2}


class ResidentTrainer(BasePPOTrainer):
    """TinyGPT through the torch workers on one rank (their data parallelism needs processes), the toy workers on
    more; actor and critic colocated (one ColocatedWorker group) unless ``separate`` (two groups: the resident
    step then reshards between them)."""

    separate = False

    def init_workers(self) -> None:
        from ppo_core.models import TinyGPT, TinyGPTConfig

        world = self.config.actor.world_size
        if world > 1:
            actor, critic = WorkerSpec(RecordingToyActor), WorkerSpec(RecordingToyCritic)
        else:
            policy = functools.partial(TinyGPT, TinyGPTConfig(**SIZES), seed=1)
            value = functools.partial(TinyGPT, TinyGPTConfig(**SIZES, value_head=True), seed=2)
            actor = WorkerSpec(RecordingTorchActor, (policy, self.config.actor.worker))
            critic = WorkerSpec(RecordingTorchCritic, (value, self.config.critic.worker))
        if not self.config.use_critic:
            self.actor_wg = LocalWorkerGroup(actor, world)
        elif self.separate:
            self.actor_wg = LocalWorkerGroup(actor, world)
            self.critic_wg = LocalWorkerGroup(critic, world)
        else:
            roles = {"actor": actor, "critic": critic}
            group = LocalWorkerGroup(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world)
            self.actor_wg, self.critic_wg = group.role("actor"), group.role("critic")


class SeparateTrainer(ResidentTrainer):
    separate = True


VARIANTS = {
    # GRPO without a reference
    "grpo": {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False}},
    # GRPO with the KL loss: reference log-probs added in place, read by update_actor
    "grpo_kl_loss": {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "actor": {"use_kl_loss": True},
    },
    # GRPO with the KL penalty in the reward (adaptive controller): the penalty at the workers
    "grpo_kl_reward": {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True}},
    # PPO: GAE with a critic and the in-reward KL penalty (make_config's algorithm)
    "ppo": {"algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True}},
    # the old log-probs from the rollout engine (no log-prob pass), as asked directly or by the bypass mode
    "grpo_old_from_rollout": {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "rollout": {"old_log_probs_from_rollout": True},
    },
    "grpo_bypass": {
        "algorithm": {
            "adv_estimator": "grpo",
            "use_kl_in_reward": False,
            "rollout_correction": {"bypass_mode": True},
        },
    },
    # rollout correction: token weights (batch-normalised) and a token rejection at the ranks
    "grpo_correction": {
        "algorithm": {
            "adv_estimator": "grpo",
            "use_kl_in_reward": False,
            "rollout_correction": {
                "rollout_is": "token",
                "rollout_is_batch_normalize": True,
                "rollout_rs": "token_k1",
                "rollout_rs_threshold": 1.0001,
            },
        },
    },
    # the other outcome estimators (one value a row; REINFORCE++-baseline's whitened over the tokens)
    **{
        name: {"algorithm": {"adv_estimator": name, "use_kl_in_reward": False}}
        for name in (
            "grpo_passk",
            "rloo",
            "gpg",
            "reinforce_plus_plus_baseline",
            "opo",
            "reinforce_plus_plus",
        )
    },
}


def _run(
    path,
    resident: bool,
    world: int,
    variant: str = "grpo",
    trainer_cls=ResidentTrainer,
    reward=reward_first_token,
    collate_fn=None,
):
    RECORDS.clear()
    KEYS_SEEN.clear()
    overrides = {section: dict(values) for section, values in VARIANTS[variant].items()}
    kl_loss = overrides.get("actor", {}).get("use_kl_loss", False)
    worker = (
        {}  # the toy actor takes no config (it ignores the KL loss; the reference is still computed)
        if world > 1
        else {
            "ppo_mini_batch_size": 2,
            "ppo_epochs": 2,
            "use_kl_loss": kl_loss,
            "optim": {"lr": 1e-2},
            "rollout": {"max_new_tokens": R, "eos_token_id": EOS, "pad_token_id": PAD},
        }
    )
    critic = {} if world > 1 else {"ppo_mini_batch_size": 2, "ppo_epochs": 2, "optim": {"lr": 1e-2}}
    overrides.setdefault("actor", {}).update({"world_size": world, "worker": worker})
    cfg = make_config(
        path,
        rollout={"n": 2, **overrides.pop("rollout", {})},
        critic={"world_size": world, "worker": critic},
        trainer={"total_epochs": 1, "save_freq": 0, "test_freq": 0, "resident_batches": resident},
        **overrides,
    )
    trainer = trainer_cls(
        cfg, train_dataset=make_dataset(6), val_dataset=[], reward_fn=reward, collate_fn=collate_fn
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return list(RECORDS), deterministic(read_metrics_jsonl(path)), list(KEYS_SEEN)


# what the whitening of GAE's advantages (reduced over the batch in another order) reaches: the whitened
# advantages themselves, and through the update everything after it
WHITENED = ("advantages", "weight", "critic_weight", "old_log_probs", "ref_log_probs", "values", "returns")


def _check_equal(
    by_value, resident, value_metrics, resident_metrics, exact_all: bool, metric_abs: float | None = None
) -> None:
    assert [(r, k) for r, k, _ in resident] == [(r, k) for r, k, _ in by_value]
    seen_advantages = False
    for (rank, kind, a), (_, _, b) in zip(by_value, resident, strict=True):
        assert a.dtype == b.dtype, (rank, kind)
        base = kind.split(":")[0]
        seen_advantages = seen_advantages or base == "advantages"
        if exact_all or base not in WHITENED or not seen_advantages:
            # before the first whitened advantage everything is computed row by row: the same bits
            assert torch.equal(a, b), (rank, kind)
        else:
            scale = float(a.abs().max()) if a.numel() else 0.0
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=f"{rank} {kind}")
    assert sorted(value_metrics) == sorted(resident_metrics) == [1, 2, 3]
    for step, values in value_metrics.items():
        assert resident_metrics[step].keys() == values.keys()
        for key, value in values.items():
            # whitened advantages have unit scale and mean 0: what sums them (their mean, the policy loss) cancels,
            # so its float32 rounding is compared at the advantages' scale (1e-6 absolute), not its own
            noise = metric_abs if metric_abs is not None else (1e-9 if exact_all else 1e-6)
            assert resident_metrics[step][key] == pytest.approx(value, rel=1e-6, abs=noise, nan_ok=True), (
                step,
                key,
            )


@pytest.mark.parametrize("world", [1, 2], ids=["tinygpt-world1", "toy-world2"])
def test_resident_grpo_equals_the_by_value_run_bit_for_bit(tmp_path, world) -> None:
    by_value, value_metrics, _ = _run(tmp_path / "value", resident=False, world=world)
    resident, resident_metrics, seen = _run(tmp_path / "resident", resident=True, world=world)
    if (
        world == 1
    ):  # the torch actor declares what update_actor reads: only that is materialised from the store
        assert seen and set(seen) == {frozenset(ACTOR_UPDATE_KEYS)}
    kinds = {k.split(":")[0] for _, k, _ in by_value}
    assert {"responses", "old_log_probs", "advantages", "weight"} <= kinds
    _check_equal(by_value, resident, value_metrics, resident_metrics, exact_all=True)
    # both log the step's controller bytes (at these sizes handles cost about what the rows do: the
    # savings are measured by benchmarks/resident_bytes.py)
    for name in ("value", "resident"):
        assert all(r["perf/controller_bytes"] > 0 for r in read_metrics_jsonl(tmp_path / name))


@pytest.mark.parametrize(
    ("world", "variant", "trainer_cls"),
    [
        (1, "grpo_kl_loss", ResidentTrainer),
        (1, "ppo", ResidentTrainer),
        (2, "grpo_kl_reward", ResidentTrainer),
        (2, "ppo", ResidentTrainer),
        (2, "ppo", SeparateTrainer),
        (1, "grpo_correction", ResidentTrainer),
    ],
    ids=[
        "tinygpt-world1-grpo-kl-loss",
        "tinygpt-world1-ppo",
        "toy-world2-grpo-kl-reward",
        "toy-world2-ppo",
        "toy-world2-ppo-separate-groups",
        "tinygpt-world1-grpo-rollout-correction",
    ],
)
def test_resident_ppo_and_reference_equal_the_by_value_run(tmp_path, world, variant, trainer_cls) -> None:
    """Reference log-probs and values added in place (or, with separate groups, resharded there and back), the
    in-reward KL penalty and GAE at the workers (its whitening from per-row partials): every tensor bit for bit
    at any world size; every metric within 1e-6 relative."""
    by_value, value_metrics, _ = _run(tmp_path / "value", False, world, variant, trainer_cls)
    resident, resident_metrics, seen = _run(tmp_path / "resident", True, world, variant, trainer_cls)
    kinds = {k.split(":")[0] for _, k, _ in by_value}
    assert {"responses", "old_log_probs", "advantages", "weight"} <= kinds
    if variant == "ppo":
        assert {"values", "returns", "critic_weight"} <= kinds
    if world == 1 and variant == "grpo_kl_loss":  # update_actor reads the reference log-probs (may_read)
        assert set(seen) == {frozenset((*ACTOR_UPDATE_KEYS, "ref_log_probs"))}
    if variant == "grpo_correction":  # and the rollout correction's weights
        assert set(seen) == {frozenset((*ACTOR_UPDATE_KEYS, "rollout_is_weights"))}
        assert any(key.startswith("rollout_corr/") for key in resident_metrics[1])
    # GRPO advantages are per row; GAE's are whitened over the batch from per-row float64 partials reduced
    # exactly (the by-value step's whitening, whatever the dp layout): every tensor bit for bit. The token-level
    # metrics are reduced from per-rank parts in another order: within 1e-6 (1e-6 absolute where whitened
    # advantages of mean 0 cancel)
    noise = 1e-9 if variant != "ppo" or world == 1 else 1e-6
    _check_equal(by_value, resident, value_metrics, resident_metrics, exact_all=True, metric_abs=noise)
    if "kl_reward" in variant or variant == "ppo":
        betas = [value_metrics[s]["actor/reward_kl_penalty_coeff"] for s in (1, 2, 3)]
        assert len(set(betas)) > 1  # the adaptive controller moved, from the workers' per-row KL


@pytest.mark.parametrize(
    ("world", "variant"),
    [
        (2, "grpo_passk"),
        (2, "rloo"),
        (2, "gpg"),
        (2, "reinforce_plus_plus_baseline"),
        (1, "reinforce_plus_plus_baseline"),
        (2, "opo"),
        (1, "opo"),
        (2, "reinforce_plus_plus"),
        (1, "reinforce_plus_plus"),
    ],
    ids=[
        "toy-world2-grpo-passk",
        "toy-world2-rloo",
        "toy-world2-gpg",
        "toy-world2-rpp-baseline",
        "tinygpt-rpp-baseline",
        "toy-world2-opo",
        "tinygpt-opo",
        "toy-world2-reinforce-pp",
        "tinygpt-reinforce-pp",
    ],
)
def test_resident_outcome_estimators_equal_the_by_value_run_bit_for_bit(tmp_path, world, variant) -> None:
    """The outcome estimators computed on the controller from ``[B]`` row sums and group ids (REINFORCE++-baseline
    also from the row lengths, for its token-weighted whitening; OPO from them, for its length-weighted baseline)
    and REINFORCE++ (its reward-to-go scanned at the ranks, whitened from their row partials): every tensor bit for
    bit, metrics within 1e-6."""
    by_value, value_metrics, _ = _run(tmp_path / "value", False, world, variant)
    resident, resident_metrics, _ = _run(tmp_path / "resident", True, world, variant)
    advantages = [a for _, k, a in by_value if k == "advantages"]
    assert advantages and any(bool(a.abs().sum() > 0) for a in advantages)  # something was learned from
    _check_equal(by_value, resident, value_metrics, resident_metrics, exact_all=True, metric_abs=1e-6)


@pytest.mark.parametrize("variant", ["grpo_old_from_rollout", "grpo_bypass"])
def test_old_log_probs_from_the_rollout_equal_the_by_value_run_bit_for_bit(
    tmp_path, monkeypatch, variant
) -> None:
    """``rollout.old_log_probs_from_rollout`` (or the bypass mode): the rollout's log-probs kept as the old ones at
    the ranks, no log-prob pass on either path; every tensor bit for bit, the same metrics."""
    calls: list[str] = []
    compute = TorchActorWorker.compute_log_prob

    def counting(self, batch):
        calls.append("compute_log_prob")
        return compute(self, batch)

    monkeypatch.setattr(TorchActorWorker, "compute_log_prob", counting)
    by_value, value_metrics, _ = _run(tmp_path / "value", False, 1, variant)
    resident, resident_metrics, _ = _run(tmp_path / "resident", True, 1, variant)
    assert calls == []
    assert "actor/entropy" not in value_metrics[1] and "actor/entropy" not in resident_metrics[1]
    _check_equal(by_value, resident, value_metrics, resident_metrics, exact_all=True)


def test_resident_batches_refuse_what_they_do_not_support_yet(tmp_path) -> None:
    # refused when the config is built (a ``ppo-core train`` job before any model loads), not at the first step
    with pytest.raises(
        ValueError, match=r"resident_batches=True does not support algorithm.adv_estimator='remax'"
    ):
        make_config(tmp_path, algorithm={"adv_estimator": "remax"}, trainer={"resident_batches": True})
    # the rollout correction is served (tests/ppo_core/test_trainer_resident_correction.py)
    correction = {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}
    cfg = make_config(
        tmp_path,
        algorithm={"adv_estimator": "grpo", "rollout_correction": correction},
        trainer={"resident_batches": True},
    )
    assert cfg.algorithm.rollout_correction.enabled


class ReadsResponses:
    """A controller-side reward declaring the generation keys it reads: only those are fetched."""

    reads = ("responses",)

    def __call__(self, batch):
        assert set(batch.keys()) - {"uid", "ground_truth", "data_source"} == {"responses"}
        return reward_first_token(batch)


WORKER_REWARD = WorkerReward(reward_first_token, reads=("responses",), fields=("ground_truth",))


@pytest.mark.parametrize(
    ("world", "variant"),
    [(1, "grpo"), (2, "grpo"), (2, "ppo")],
    ids=["tinygpt-world1-grpo", "toy-world2-grpo", "toy-world2-ppo"],
)
def test_a_worker_side_reward_and_a_reward_reading_declared_keys_equal_the_by_value_run(
    tmp_path, monkeypatch, world, variant
) -> None:
    """The same reward scored on the ranks holding the responses (``WorkerReward``: the scores stay there, ``[B]``
    row sums come back) or on the controller from the keys it declares (only those fetched): the by-value run's
    results; and the controller fetches no ``[B, R]`` key for a worker-side reward."""
    from ppo_core.workers.group import WorkerGroup

    fetched: list[tuple[str, ...]] = []
    fetch = WorkerGroup.fetch_resident

    def recording(self, ref, keys):
        fetched.append(tuple(keys))
        return fetch(self, ref, keys)

    monkeypatch.setattr(WorkerGroup, "fetch_resident", recording)
    noise = 1e-9 if variant != "ppo" or world == 1 else 1e-6
    by_value, value_metrics, _ = _run(tmp_path / "value", False, world, variant, reward=WORKER_REWARD)
    for name, reward in (("worker", WORKER_REWARD), ("reads", ReadsResponses()), ("all", reward_first_token)):
        fetched.clear()
        records, metrics, _ = _run(tmp_path / name, True, world, variant, reward=reward)
        _check_equal(by_value, records, value_metrics, metrics, exact_all=True, metric_abs=noise)
        assert len(fetched) == 3, (name, fetched)  # one fetch a step
        if name == "worker":
            assert set(fetched) == {("row_score_sum",)}  # this reward returns no extra infos
        elif name == "reads":
            assert set(fetched) == {("responses",)}
        else:  # a reward that declares nothing gets the whole generation
            assert len(set(fetched)) == 1 and {"responses", "response_mask", "input_ids"} <= set(fetched[0])


@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=5), min_size=1, max_size=6),
    st.data(),
)
def test_prompt_rows_are_the_collated_rows(items, data) -> None:
    """A rank rebuilds its prompt rows from dataset indices exactly as the controller's collation pads the batch."""
    from ppo_core.trainer.data import collate_prompts
    from ppo_core.workers.resident_ops import prompt_rows

    index = data.draw(st.lists(st.integers(0, len(items) - 1), min_size=1, max_size=8))
    table = [torch.tensor(i) for i in items]
    batch = collate_prompts([{"input_ids": items[i]} for i in index], pad_token_id=7)
    width = int(batch["input_ids"].shape[1])
    ids, mask = prompt_rows(table, torch.tensor(index, dtype=torch.int32), width, 7)
    assert torch.equal(ids, batch["input_ids"]) and torch.equal(mask, batch["attention_mask"])


@pytest.mark.parametrize("collate", [False, True], ids=["indices", "custom-collate-by-value"])
def test_prompts_go_as_indices_unless_the_trainer_collates_its_own_way(
    tmp_path, monkeypatch, collate
) -> None:
    """With the default collation the ranks rebuild the prompt rows from dataset indices; a trainer with its own
    ``collate_fn`` sends them by value. Both equal the by-value run bit for bit."""
    import functools

    from ppo_core.trainer.data import collate_prompts
    from ppo_core.workers.group import WorkerGroup

    methods: list[str] = []
    dispatch = WorkerGroup.dispatch_resident_async

    def recording(self, method, *args, **kwargs):
        methods.append(method)
        return dispatch(self, method, *args, **kwargs)

    monkeypatch.setattr(WorkerGroup, "dispatch_resident_async", recording)
    collate_fn = functools.partial(collate_prompts, pad_token_id=PAD) if collate else None
    by_value, value_metrics, _ = _run(tmp_path / "value", False, 2, collate_fn=collate_fn)
    resident, resident_metrics, _ = _run(tmp_path / "resident", True, 2, collate_fn=collate_fn)
    _check_equal(by_value, resident, value_metrics, resident_metrics, exact_all=True)
    assert methods.count("resident_prompts") == (0 if collate else 3)
    assert methods.count("generate_sequences") == 3
