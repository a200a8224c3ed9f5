"""``PPOConfig``'s cross-section rules (checked when the config is built) and the start warnings the trainer logs
(:func:`ppo_core.trainer.config.start_warnings`)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.trainer.config import GROUP_ADV_ESTIMATORS, PPOConfig, start_warnings


@given(tb=st.integers(1, 64), n=st.integers(1, 8), mb=st.integers(1, 128), critic=st.booleans())
def test_mini_batch_must_divide_the_responses_of_a_step(tb, n, mb, critic):
    role = "critic" if critic else "actor"
    cfg = {
        "data": {"train_batch_size": tb},
        "rollout": {"n": n},
        role: {"worker": {"ppo_mini_batch_size": mb}},
    }
    if (tb * n) % mb == 0:
        assert PPOConfig.from_dict(cfg).mini_batch_sizes()[role] == mb
    else:
        with pytest.raises(ValueError) as info:
            PPOConfig.from_dict(cfg)
        text = str(info.value)
        assert text.startswith(f"{role}.worker.ppo_mini_batch_size={mb} does not divide"), text
        assert f"{tb} x {n} = {tb * n}" in text


def test_an_unused_critic_and_custom_workers_are_not_checked():
    # grpo runs no critic: its mini-batch size is not a rule; a worker dict without the key is a custom worker's
    PPOConfig.from_dict(
        {"algorithm": {"adv_estimator": "grpo"}, "critic": {"worker": {"ppo_mini_batch_size": 7}}}
    )
    assert PPOConfig.from_dict({"actor": {"worker": {"lr": 1}}}).mini_batch_sizes() == {
        "actor": None,
        "critic": None,
    }


@pytest.mark.parametrize(
    ("cfg", "start"),
    [
        ({"critic": {"enable": False}}, "algorithm.adv_estimator='gae' needs the critic's values"),
        ({"algorithm": {"adv_estimator": "grpo_passk"}}, "algorithm.adv_estimator='grpo_passk' needs groups"),
    ],
)
def test_estimator_rules(cfg, start):
    with pytest.raises(ValueError, match="^" + start.replace("(", r"\(")):
        PPOConfig.from_dict(cfg)


@given(per_epoch=st.integers(1, 20), epochs=st.integers(1, 5), steps=st.none() | st.integers(1, 200))
def test_the_step_cap_is_warned_with_the_steps_that_run(per_epoch, epochs, steps):
    cfg = PPOConfig.from_dict({"trainer": {"total_epochs": epochs, "total_training_steps": steps}})
    warnings = [w for w in start_warnings(cfg, steps_per_epoch=per_epoch) if "total_training_steps" in w]
    available = per_epoch * epochs
    if steps is None or steps <= available:
        assert warnings == []
    else:
        (text,) = warnings
        assert f"the run stops after {available} steps" in text
        epochs_needed = -(-steps // per_epoch)
        assert f"set trainer.total_epochs={epochs_needed} to run all {steps}" in text
        assert epochs_needed * per_epoch >= steps > (epochs_needed - 1) * per_epoch


@pytest.mark.parametrize("estimator", [*GROUP_ADV_ESTIMATORS, "gae", "reinforce_plus_plus"])
@pytest.mark.parametrize("n", [1, 4])
def test_group_estimators_warn_on_one_response_per_prompt(estimator, n):
    given = {"algorithm": {"adv_estimator": estimator}, "rollout": {"n": n}}
    if estimator == "grpo_passk" and n == 1:  # an error, not a warning
        with pytest.raises(ValueError, match="needs groups of at least 2"):
            PPOConfig.from_dict(given)
        return
    cfg = PPOConfig.from_dict(given)
    warned = [w for w in start_warnings(cfg, steps_per_epoch=10) if "rollout.n=1" in w]
    assert len(warned) == (1 if estimator in GROUP_ADV_ESTIMATORS and n == 1 else 0)


def test_critic_warmup_over_every_step_is_warned():
    cfg = PPOConfig.from_dict({"trainer": {"critic_warmup": 5, "total_training_steps": 5}})
    assert any("the actor is never updated" in w for w in start_warnings(cfg, steps_per_epoch=10))
    cfg = PPOConfig.from_dict({"trainer": {"critic_warmup": 4, "total_training_steps": 5}})
    assert not any("never updated" in w for w in start_warnings(cfg, steps_per_epoch=10))


def test_the_trainer_logs_the_warnings_when_built(caplog):
    from ppo_core.trainer import BasePPOTrainer

    class _T(BasePPOTrainer):
        def init_workers(self) -> None:  # never called here
            raise AssertionError

    prompts = [{"input_ids": [1, 2], "ground_truth": "1"}] * 8
    cfg = {"data": {"train_batch_size": 4}, "trainer": {"total_training_steps": 9}}
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.base"):
        _T(cfg, train_dataset=prompts, reward_fn=lambda batch: None)
    assert (
        "trainer.total_training_steps=9 but trainer.total_epochs=1 x 2 steps per epoch allow 2" in caplog.text
    )
