"""Trainer building blocks: PPOConfig, the stateful prompt loader, Tracker/metrics.jsonl, checkpoint folders,
reward normalisation and the pure step helpers."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.trainer import (
    PPOConfig,
    PromptDataLoader,
    RewardFunctionError,
    Tracker,
    collate_prompts,
    compute_advantages,
    merge_generation,
    read_metrics_jsonl,
    scores_to_token_level,
)
from ppo_core.trainer import checkpoint as ckpt
from ppo_core.trainer.reward import call_reward_fn

# ----- config ------------------------------------------------------------------------------------------------


def test_config_round_trip_and_derived_flags():
    cfg = PPOConfig.from_dict(
        {
            "data": {"train_batch_size": 4},
            "actor": {"use_kl_loss": True, "worker": {"optim": {"lr": 1e-3}}},
            "algorithm": {"adv_estimator": "grpo"},
            "trainer": {"loggers": ["jsonl"], "save_freq": 2},
        }
    )
    assert PPOConfig.from_dict(cfg.to_dict()) == cfg
    assert json.loads(json.dumps(cfg.to_dict())) is not None  # plain data, YAML/JSON friendly
    assert cfg.use_reference and not cfg.use_critic and cfg.trainer.loggers == ("jsonl",)
    assert PPOConfig().use_critic  # gae by default
    no_critic = {"critic": {"enable": False}, "algorithm": {"adv_estimator": "rloo"}}
    assert PPOConfig.from_dict(no_critic).use_critic is False


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"trainer": {"resume_mode": "latest"}}, "valid values: auto, disable, path"),
        ({"trainer": {"resume_mode": "path"}}, "resume_from_path"),
        ({"trainer": {"loggers": ["mlflow"]}}, "valid values: console, jsonl, tensorboard, wandb"),
        ({"rollout": {"n": 0}}, "n must be >= 1"),
        ({"data": {"train_batch_size": 2.5}}, "train_batch_size must be an int"),
        ({"trainer": {"bogus": 1}}, r"unknown TrainerConfig field\(s\) \['bogus'\]"),
        ({"actor": {"use_kl_loss": "false"}}, "use_kl_loss must be a bool"),
    ],
)
def test_config_errors_name_the_field(data, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PPOConfig.from_dict(data)


# ----- data --------------------------------------------------------------------------------------------------


def prompts(n: int) -> list[dict]:
    return [{"input_ids": list(range(1, 2 + i % 3)), "ground_truth": i} for i in range(n)]


@given(
    st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=6), st.integers(0, 3)
)
def test_collate_left_pads(rows, pad):
    td = collate_prompts([{"input_ids": r} for r in rows], pad_token_id=pad)
    width = max(map(len, rows))
    for i, r in enumerate(rows):
        assert td["input_ids"][i].tolist() == [pad] * (width - len(r)) + r
        assert td["attention_mask"][i].tolist() == [0] * (width - len(r)) + [1] * len(r)
    assert td.get("data_source").tolist() == ["unknown"] * len(rows)


def test_collate_errors():
    with pytest.raises(ValueError, match="at least one"):
        collate_prompts([])
    with pytest.raises(KeyError, match="item 1"):
        collate_prompts([{"input_ids": [1]}, {"ids": [2]}])
    with pytest.raises(ValueError, match="empty"):
        collate_prompts([{"input_ids": []}])


def drain(loader: PromptDataLoader, n: int) -> list[list[int]]:
    out = []
    while len(out) < n:
        out += [b.get("ground_truth").tolist() for b in loader]
    return out[:n]


@given(st.integers(2, 12), st.integers(1, 4), st.integers(0, 9), st.booleans())
def test_loader_resumes_exactly_from_any_position(size, batch, cut, shuffle):
    """Epoch boundaries included: a restored state continues with the very next batch."""
    total = 3 * (size // batch)
    if size // batch == 0:
        return
    cut = cut % total
    full = drain(PromptDataLoader(prompts(size), batch, shuffle=shuffle, seed=5), total)
    first = PromptDataLoader(prompts(size), batch, shuffle=shuffle, seed=5)
    head: list = []
    for b in _take(first, cut):
        head.append(b.get("ground_truth").tolist())
    state = first.state_dict()
    assert 0 <= state["position"] < len(first)
    second = PromptDataLoader(prompts(size), batch, shuffle=shuffle, seed=5)
    second.load_state_dict(state)
    assert head + drain(second, total - cut) == full


def _take(loader, n):
    while n > 0:
        for b in loader:
            yield b
            n -= 1
            if n == 0:
                return


def test_loader_epochs_are_permutations_and_differ():
    loader = PromptDataLoader(prompts(8), 2, seed=1)
    epochs = [[x for b in drain(loader, 4) for x in b] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(8)) and epochs[0] != epochs[1]
    assert loader.epoch == 2


def test_loader_end_of_epoch_state_points_at_the_next_epoch():
    loader = PromptDataLoader(prompts(4), 2, shuffle=False)
    list(loader)
    assert loader.state_dict() == {"epoch": 1, "position": 0}
    restored = PromptDataLoader(prompts(4), 2, shuffle=False)
    restored.load_state_dict({"epoch": 0, "position": 2})  # an "exhausted" state saved by other code
    assert restored.state_dict() == {"epoch": 1, "position": 0} and len(list(restored)) == 2


def test_loader_drop_last_and_errors():
    assert len(PromptDataLoader(prompts(5), 2)) == 2
    assert len(PromptDataLoader(prompts(5), 2, drop_last=False)) == 3
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataLoader(prompts(5), 0)


# ----- tracking ----------------------------------------------------------------------------------------------


def test_tracker_jsonl_merges_a_step_and_writes_strict_json(tmp_path):
    t = Tracker(("jsonl", "console"), tmp_path)
    t.log({"val/x": 1}, step=0)
    t.log({}, step=1)  # nothing to log is fine
    t.log({"a": torch.tensor(2.0), "b": np.float32(0.5)}, step=1)
    t.log({"c": float("nan")}, step=1)
    t.log({"a": 3.0}, step=2)
    t.close()
    t.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "val/x": 1.0},
        {"step": 1, "a": 2.0, "b": 0.5, "c": None},
        {"step": 2, "a": 3.0},
    ]
    assert all("NaN" not in line for line in lines)


def test_tracker_resume_drops_later_steps_and_fresh_run_starts_over(tmp_path):
    t = Tracker(("jsonl",), tmp_path)
    for s in range(1, 5):
        t.log({"a": float(s)}, step=s)
    t.close()
    Tracker(("jsonl",), tmp_path, resume_step=2).close()
    assert [r["step"] for r in read_metrics_jsonl(tmp_path)] == [1, 2]
    Tracker(("jsonl",), tmp_path).close()
    assert read_metrics_jsonl(tmp_path) == []


def test_tracker_errors():
    with pytest.raises(ValueError, match="valid values: console, jsonl, tensorboard, wandb"):
        Tracker(("mlflow",))
    with pytest.raises(ValueError, match="log_dir"):
        Tracker(("jsonl",))
    t = Tracker(("console",))
    with pytest.raises(TypeError, match="metric 'x'"):
        t.log({"x": "high"}, step=1)


# ----- checkpoint folders ------------------------------------------------------------------------------------


def test_rng_state_round_trip():
    state = ckpt.capture_rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.restore_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    torch.testing.assert_close(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_publish_and_find_latest(tmp_path):
    assert ckpt.find_latest_checkpoint(tmp_path / "missing") is None
    for step in (1, 2):
        tmp = str(tmp_path / f"global_step_{step}.tmp")
        ckpt.save_trainer_state(tmp, {"global_steps": step})
        ckpt.publish_checkpoint(tmp, tmp_path, step)
    assert ckpt.find_latest_checkpoint(tmp_path).endswith("global_step_2")
    # an unfinished save of step 3 is ignored, and so is a stale "latest" file
    os.makedirs(tmp_path / "global_step_3")
    (tmp_path / ckpt.LATEST_FILE).write_text("3")
    assert ckpt.find_latest_checkpoint(tmp_path).endswith("global_step_2")
    # re-publishing a step replaces it
    tmp = str(tmp_path / "global_step_2.tmp")
    ckpt.save_trainer_state(tmp, {"global_steps": 2, "again": True})
    ckpt.publish_checkpoint(tmp, tmp_path, 2)
    assert ckpt.load_trainer_state(tmp_path / "global_step_2")["again"] is True
    assert ckpt.step_of_checkpoint(tmp_path / "global_step_2") == 2
    with pytest.raises(ValueError, match="global_step_<k>"):
        ckpt.step_of_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_trainer_state(tmp_path / "global_step_3")


# ----- reward ------------------------------------------------------------------------------------------------


@given(
    st.lists(st.lists(st.booleans(), min_size=1, max_size=5), min_size=1, max_size=5).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    )
)
def test_sequence_scores_land_on_the_last_valid_token(rows):
    mask = torch.tensor(rows)
    scores = torch.arange(1, len(rows) + 1, dtype=torch.float32)
    out = scores_to_token_level(scores, mask)
    for i, row in enumerate(rows):
        expected = [0.0] * len(row)
        valid = [t for t, m in enumerate(row) if m]
        if valid:
            expected[valid[-1]] = float(scores[i])
        assert out[i].tolist() == expected


def test_reward_shapes_and_errors():
    mask = torch.ones(2, 3)
    token = torch.rand(2, 3)
    assert torch.equal(scores_to_token_level(token, mask), token)
    with pytest.raises(ValueError, match=r"shape \[B\]=2"):
        scores_to_token_level(torch.zeros(3), mask)
    batch = TensorDict({"response_mask": mask, "uid": NonTensorStack("a", "b")}, batch_size=[2])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    scores, extra = call_reward_fn(
        lambda b: ([1.0, 0.0], {"acc": torch.tensor([1, 0])}), batch, 4, pool
    ).result()
    assert scores[:, -1].tolist() == [1.0, 0.0] and extra == {"acc": [1, 0]}
    with pytest.raises(RewardFunctionError, match=r"step 4 .*uids \[a, b\].*extra info 'acc' has 1 values"):
        call_reward_fn(lambda b: ([1.0, 0.0], {"acc": [1]}), batch, 4, pool).result()
    with pytest.raises(RewardFunctionError, match="step 9"):
        call_reward_fn(lambda b: 1 / 0, batch, 9, pool)
    pool.shutdown()


# ----- step helpers ------------------------------------------------------------------------------------------


def test_merge_generation_keeps_prompt_fields_and_derives_the_mask():
    prompts_td = TensorDict(
        {"input_ids": torch.ones(2, 2, dtype=torch.long), "uid": NonTensorStack("u", "v")}, batch_size=[2]
    )
    gen = TensorDict(
        {"responses": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])},
        batch_size=[2],
    )
    out = merge_generation(prompts_td, gen)
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0]]
    assert out.get("uid").tolist() == ["u", "v"]
    with pytest.raises(ValueError, match="3 rows for 2 prompts"):
        merge_generation(prompts_td, TensorDict({"responses": torch.ones(3, 1)}, batch_size=[3]))
    with pytest.raises(KeyError, match="'attention_mask'"):
        merge_generation(prompts_td, TensorDict({"responses": torch.ones(2, 1)}, batch_size=[2]))


def test_compute_advantages_uses_uids_and_values():
    from ppo_core.config import AlgorithmConfig

    batch = TensorDict(
        {
            "token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]]),
            "response_mask": torch.ones(3, 2),
            "values": torch.zeros(3, 2),
            "uid": NonTensorStack("a", "a", "b"),
        },
        batch_size=[3],
    )
    grpo = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False))
    # grouped by uid: "a" is centred; "b" is a singleton, whose baseline is 0 (as in verl)
    assert grpo["advantages"][:, 0].tolist() == [0.5, -0.5, 3.0]
    gae = compute_advantages(batch, AlgorithmConfig(adv_estimator="gae"))
    assert gae["returns"][:, 0].tolist() == [1.0, 0.0, 3.0]  # gamma = lam = 1: return = sum of rewards
    assert not math.isnan(float(gae["advantages"].sum()))


@pytest.mark.parametrize("epsilon", [1e-6, 1e-4, 0.5])
def test_compute_advantages_passes_the_std_epsilon(epsilon):
    """``algorithm.adv_std_epsilon`` reaches the group estimator: (s - mean) / (std + epsilon)."""
    from ppo_core.config import AlgorithmConfig

    batch = TensorDict(
        {
            "token_level_rewards": torch.tensor([[1.0], [0.0]], dtype=torch.float64),
            "response_mask": torch.ones(2, 1),
            "uid": NonTensorStack("a", "a"),
        },
        batch_size=[2],
    )
    out = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", adv_std_epsilon=epsilon))
    std = math.sqrt(0.5)  # unbiased std of (1, 0)
    assert out["advantages"][:, 0].tolist() == pytest.approx([0.5 / (std + epsilon), -0.5 / (std + epsilon)])
    with pytest.raises(ValueError, match="adv_std_epsilon"):
        AlgorithmConfig(adv_std_epsilon=-1.0)


def test_tensorboard_logger_writes_events_or_warns_when_missing(tmp_path, caplog):
    try:
        import tensorboard  # noqa: F401

        installed = True
    except ImportError:
        installed = False
    t = Tracker(("tensorboard",), tmp_path)
    t.log({"a": 1.0}, step=1)
    t.close()
    if installed:
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))
    else:
        assert "tensorboard is not installed" in caplog.text


def test_kl_loss_switches_of_trainer_and_worker_must_agree() -> None:
    from ppo_core.trainer.config import ActorConfig

    assert ActorConfig(use_kl_loss=True, worker={"use_kl_loss": True}).use_kl_loss
    assert ActorConfig(use_kl_loss=True).worker == {}  # custom workers need not accept the flag
    with pytest.raises(ValueError, match=r"actor\.worker\.use_kl_loss"):
        ActorConfig(use_kl_loss=False, worker={"use_kl_loss": True})
    with pytest.raises(ValueError, match=r"actor\.use_kl_loss=True"):
        ActorConfig(use_kl_loss=True, worker={"use_kl_loss": False})


def test_step_end_metrics_is_the_union_of_its_parts_and_takes_the_groups_traffic():
    from ppo_core.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
    from ppo_core.trainer.config import PPOConfig
    from ppo_core.trainer.steps import step_end_metrics
    from ppo_core.workers.traffic import TrafficCounter

    class Group:  # a worker group's traffic counter, nothing else
        def __init__(self) -> None:
            self.traffic = TrafficCounter()

    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = TensorDict(
        dict(
            response_mask=mask,
            token_level_scores=r,
            token_level_rewards=r,
            advantages=r,
            returns=r,
            values=r,
            attention_mask=torch.cat([torch.ones(3, 2, dtype=torch.long), mask], dim=1),
        ),
        batch_size=[3],
    )
    timing = {"step": 2.0, "gen": 1.0, "update_actor": 0.5}
    config = PPOConfig.from_dict({"actor": {"world_size": 2}})
    actor, critic = Group(), Group()
    actor.traffic.record("generate_sequences", sent=10, received=7)
    critic.traffic.record("compute_values", sent=5)
    got = step_end_metrics(batch, timing, config=config, step=4, epoch=1, groups=(actor, None, critic))
    want = {"training/global_step": 4.0, "training/epoch": 1.0}
    want.update(compute_data_metrics(batch, use_critic=config.use_critic))
    want.update(compute_timing_metrics(batch, timing))
    want.update(compute_throughput_metrics(batch, timing, n_gpus=2))
    want.update(
        {
            "perf/controller_bytes": 22.0,
            "perf/controller_bytes_sent": 15.0,
            "perf/controller_bytes_received": 7.0,
        }
    )
    assert got == want
    # the counters were taken: the next step starts from zero
    again = step_end_metrics(batch, timing, config=config, step=5, epoch=1, groups=(actor, critic))
    assert again["perf/controller_bytes"] == 0.0 and again["training/global_step"] == 5.0
