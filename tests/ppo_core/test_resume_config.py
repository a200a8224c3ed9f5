"""Resume compares the checkpoint's config with the current one: keys that change what the run means raise
(listing each key with both values) unless named in trainer.resume_allow_changes; every other change is listed in
one warning."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_trainer_loop import ToyTrainer, crash_at, make_config, make_dataset, reward_first_token, run

from ppo_core.trainer import PPOConfig, RewardFunctionError
from ppo_core.trainer.config import TrainerConfig
from ppo_core.trainer.resume_config import (
    IGNORED_KEYS,
    MEANING_KEYS,
    ResumeConfigError,
    check_resume_config,
    config_differences,
)
from ppo_core.workers.torch.config import TorchActorConfig

# ----- the comparison ----------------------------------------------------------------------------------------

leaves = st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.text(max_size=3), st.none(), st.booleans())
keys = st.sampled_from(["a", "b", "lr", "model"])
nested = st.recursive(leaves, lambda inner: st.dictionaries(keys, inner, max_size=3), max_leaves=8)
configs = st.dictionaries(keys, nested, max_size=4)


def _flat(d, prefix=""):
    """Oracle: dotted leaves of a nested dict (empty dicts contribute nothing)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(_flat(v, key) if isinstance(v, dict) else {key: v})
    return out


@given(configs, configs)
def test_differences_are_the_differing_dotted_leaves(saved, current):
    a, b = _flat(saved), _flat(current)
    want = {
        k: (a.get(k, "(not set)"), b.get(k, "(not set)"))
        for k in sorted(a.keys() | b.keys())
        if k not in a or k not in b or a[k] != b[k]
    }
    assert config_differences(saved, current) == want
    assert config_differences(saved, saved) == {}


def test_lists_equal_tuples_and_ignored_keys_are_skipped():
    saved = PPOConfig().to_dict()
    saved["trainer"]["loggers"] = list(saved["trainer"]["loggers"])  # as a YAML round trip gives
    now = PPOConfig.from_dict(
        {"trainer": {"resume_mode": "disable", "progress_bar": False, "resume_allow_changes": ["data.seed"]}}
    )
    assert {"trainer.resume_mode", "trainer.progress_bar"} <= set(IGNORED_KEYS)
    assert config_differences(saved, now) == {}


def test_meaning_keys_raise_listing_both_values_and_allow_covers_sub_keys():
    saved = {"data": {"seed": 1}, "actor": {"worker": {"model": {"d": 8}, "optim": {"lr": 0.1}}}}
    now = {"data": {"seed": 2}, "actor": {"worker": {"model": {"d": 16}, "optim": {"lr": 0.2}}}}
    with pytest.raises(ResumeConfigError) as info:
        check_resume_config(saved, now, checkpoint="c/global_step_1")
    message = str(info.value)
    assert "data.seed: 1 in the checkpoint, 2 now" in message
    assert "actor.worker.model.d: 8 in the checkpoint, 16 now" in message
    assert "lr" not in message  # not a meaning key: only warned about
    assert info.value.differences == {"actor.worker.model.d": (8, 16), "data.seed": (1, 2)}
    assert isinstance(info.value, ValueError)
    allowed = check_resume_config(saved, now, checkpoint="c", allow=["data.seed", "actor.worker.model"])
    assert set(allowed) == {"data.seed", "actor.worker.model.d", "actor.worker.optim.lr"}
    with pytest.raises(ResumeConfigError) as info:  # a key covers the keys below it, not a name's prefix
        check_resume_config(saved, now, checkpoint="c", allow=["data.seed", "actor.worker.mod"])
    assert info.value.differences == {"actor.worker.model.d": (8, 16)}


# ----- the trainer -------------------------------------------------------------------------------------------


@pytest.fixture
def two_steps(tmp_path):
    """A run killed after checkpoints 1 and 2 (data.train_batch_size=2 over 6 prompts, rollout.n=2)."""
    with pytest.raises(RewardFunctionError):
        run(ToyTrainer, make_config(tmp_path), reward_fn=crash_at(3))
    return tmp_path


MEANING_CHANGES = {
    "algorithm.adv_estimator": (
        {"algorithm": {"adv_estimator": "grpo"}},
        "'gae' in the checkpoint, 'grpo' now",
    ),
    "data.train_batch_size": ({"data": {"train_batch_size": 3}}, "2 in the checkpoint, 3 now"),
    "data.seed": ({"data": {"seed": 4}}, "3 in the checkpoint, 4 now"),
    "rollout.n": ({"rollout": {"n": 4}}, "2 in the checkpoint, 4 now"),
    # the toy critic takes no settings, so its worker dict can carry any key
    "critic.worker.ppo_mini_batch_size": (
        {"critic": {"worker": {"ppo_mini_batch_size": 2}}},
        "'(not set)' in the checkpoint, 2 now",
    ),
    "critic.worker.model.d_model": (
        {"critic": {"worker": {"model": {"d_model": 64}}}},
        "'(not set)' in the checkpoint, 64 now",
    ),
}


@pytest.mark.parametrize("key", list(MEANING_CHANGES))
def test_resume_with_a_meaning_change_raises_naming_the_key(two_steps, key):
    override, values = MEANING_CHANGES[key]
    assert any(key == k or key.startswith(k + ".") for k in MEANING_KEYS)
    trainer = ToyTrainer(make_config(two_steps, **override), train_dataset=make_dataset(6), reward_fn=len)
    trainer.init_workers()
    try:
        with pytest.raises(ResumeConfigError) as info:
            trainer.fit()
    finally:
        trainer.shutdown()
    assert f"{key}: {values}" in str(info.value)
    assert str(two_steps / "global_step_2") in str(info.value)
    assert f'resume_allow_changes: ["{key}"]' in str(info.value)
    assert set(info.value.differences) == {key}
    assert trainer.global_steps == 0  # nothing was loaded


def test_every_meaning_change_is_listed_in_one_error(two_steps):
    cfg = make_config(two_steps, data={"seed": 9, "train_batch_size": 3}, rollout={"n": 3})
    with pytest.raises(ResumeConfigError) as info:
        run(ToyTrainer, cfg)
    assert set(info.value.differences) == {"data.seed", "data.train_batch_size", "rollout.n"}


def test_other_changes_are_listed_in_one_warning_and_the_run_goes_on(two_steps, caplog):
    kl_ctrl = {"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.01, "horizon": 10}
    cfg = make_config(two_steps, algorithm={"kl_ctrl": kl_ctrl}, actor={"worker": {"lr": 0.1}})
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.resume_config"):
        trainer = run(ToyTrainer, cfg)
    assert trainer.global_steps == 6
    records = [r.getMessage() for r in caplog.records if r.name == "ppo_core.trainer.resume_config"]
    assert len(records) == 1
    assert "algorithm.kl_ctrl.kl_coef: 0.05 in the checkpoint, 0.2 now" in records[0]
    assert "actor.worker.lr: '(not set)' in the checkpoint, 0.1 now" in records[0]
    assert "2 config change(s)" in records[0]


def test_unchanged_config_resumes_without_a_warning(two_steps, caplog):
    cfg = make_config(two_steps, trainer={"progress_bar": False, "console_every": 3})
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.resume_config"):
        run(ToyTrainer, cfg)
    assert not [r for r in caplog.records if r.name == "ppo_core.trainer.resume_config"]


def test_allowed_batch_size_change_continues_after_the_prompts_seen(two_steps, caplog):
    cfg = make_config(
        two_steps,
        data={"train_batch_size": 3},
        trainer={"resume_allow_changes": ["data.train_batch_size"], "total_epochs": 2},
    )
    trainer = ToyTrainer(cfg, train_dataset=make_dataset(6), reward_fn=reward_first_token)
    trainer.init_workers()
    try:
        with caplog.at_level(logging.WARNING):
            assert trainer._load_checkpoint()
    finally:
        trainer.shutdown()
    # 2 batches of 2 prompts were seen: 1 batch of 3 is the position that skips none of them
    assert trainer.train_dataloader.state_dict() == {"epoch": 0, "position": 1}
    assert "data.train_batch_size: 2 in the checkpoint, 3 now" in caplog.text


def test_checkpoint_without_config_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_resume_config(None, PPOConfig(), checkpoint="old/global_step_3") == {}
    assert "old/global_step_3 holds no config" in caplog.text


def test_a_checkpoint_of_the_old_rollout_layout_resumes_without_differences(caplog):
    cfg = PPOConfig.from_dict({"rollout": {"n": 2, "temperature": 0.5, "max_new_tokens": 7}})
    old = cfg.to_dict()  # as written before the sampling moved to rollout: under actor.worker.rollout
    sampling = {
        k: old["rollout"].pop(k)
        for k in list(old["rollout"])
        if k not in ("n", "val_n", "val_do_sample", "old_log_probs_from_rollout")
    }
    old["actor"]["worker"]["rollout"] = sampling
    with caplog.at_level(logging.WARNING):
        assert check_resume_config(old, cfg, checkpoint="old/global_step_3") == {}
    assert caplog.text == ""


def _typed_config(**actor: object) -> PPOConfig:
    worker = TorchActorConfig.from_dict({"optim": {"lr": 5e-4}, "rollout": {"max_new_tokens": 8}, **actor})
    return PPOConfig.from_dict(
        {"data": {"train_batch_size": 256}, "rollout": {"max_new_tokens": 8}, "actor": {"worker": worker}}
    )


def test_keys_an_older_checkpoint_lacks_are_no_change_at_their_defaults(caplog):
    # an earlier version saved a worker's keys as the job gave them (a dict) and the sampling under
    # actor.worker.rollout; a key it lacks ran at its default, so the same default now is no difference
    old = {
        **_typed_config().to_dict(),
        "actor": {
            "world_size": 1,
            "use_kl_loss": False,
            "worker": {"use_kl_loss": False, "optim": {"lr": 5e-4}, "rollout": {"max_new_tokens": 8}},
        },
    }
    with caplog.at_level(logging.WARNING):
        assert check_resume_config(old, _typed_config(), checkpoint="old/global_step_3") == {}
    assert caplog.text == ""
    # a key the checkpoint lacks that now differs from its default is still a change (refused for a meaning key)
    with pytest.raises(ResumeConfigError, match=r"actor\.worker\.ppo_mini_batch_size: '\(not set\)' in the"):
        check_resume_config(old, _typed_config(ppo_mini_batch_size=128), checkpoint="old/global_step_3")
    changes = check_resume_config(old, _typed_config(ppo_epochs=3), checkpoint="old/global_step_3")
    assert changes == {"actor.worker.ppo_epochs": ("(not set)", 3)}


# ----- the new trainer fields ------------------------------------------------------------------------------


def test_trainer_fields_check_their_values_and_round_trip():
    cfg = TrainerConfig.from_dict({"resume_allow_changes": ["data.seed", "rollout.n"], "max_ckpt_to_keep": 2})
    assert cfg.resume_allow_changes == ("data.seed", "rollout.n")
    assert TrainerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match=r"resume_allow_changes must be a list"):
        TrainerConfig(resume_allow_changes="data.seed")
    for bad in ("", ".seed", "data."):
        with pytest.raises(
            ValueError, match=r"trainer\.resume_allow_changes\[1\] must be a dotted config key"
        ):
            TrainerConfig(resume_allow_changes=["data.seed", bad])
    with pytest.raises(TypeError, match=r"resume_allow_changes\[1\] must be a str"):
        TrainerConfig(resume_allow_changes=["data.seed", 3])
    with pytest.raises(ValueError, match=r"max_ckpt_to_keep must be >= 1"):
        TrainerConfig(max_ckpt_to_keep=0)
    for bad in ("2", 2.0, True):
        with pytest.raises(TypeError, match=r"max_ckpt_to_keep must be an int"):
            TrainerConfig(max_ckpt_to_keep=bad)
