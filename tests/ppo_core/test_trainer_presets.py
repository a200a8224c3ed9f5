"""Algorithm presets: defaults that a config's own keys override; each builds the algorithm it names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.trainer import PPOConfig
from ppo_core.trainer.presets import PRESETS, apply_preset, preset_overridden


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_builds_its_algorithm(name):
    cfg = PPOConfig.from_dict(apply_preset(name, {"actor": {"worker": {"ppo_mini_batch_size": 8}}}))
    estimator = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo"}[name]
    assert cfg.algorithm.adv_estimator == estimator
    assert cfg.use_critic == (name == "ppo")
    # the KL to the reference: in the reward (ppo, rloo) or in the actor's loss (grpo), and the worker agrees
    assert cfg.algorithm.use_kl_in_reward == (name != "grpo")
    assert cfg.actor.use_kl_loss == cfg.actor.worker["use_kl_loss"] == (name == "grpo")
    assert cfg.use_reference
    assert (cfg.rollout.n == 1) == (name == "ppo")


def test_grpo_is_the_five_keys_grpo_needed():
    cfg = apply_preset("grpo", {})
    assert cfg["actor"]["worker"]["kl_loss_type"] == "low_var_kl"
    assert cfg["rollout"]["n"] == 8 and cfg["algorithm"]["use_kl_in_reward"] is False


_KEYS = {
    ("rollout", "n"): st.integers(1, 16),
    ("algorithm", "adv_estimator"): st.sampled_from(["gae", "grpo", "rloo"]),
    ("algorithm", "use_kl_in_reward"): st.booleans(),
    ("actor", "use_kl_loss"): st.booleans(),
    ("data", "train_batch_size"): st.integers(1, 64),
}


@given(
    name=st.sampled_from(sorted(PRESETS)),
    given_keys=st.dictionaries(st.sampled_from(sorted(_KEYS)), st.none()).flatmap(
        lambda keys: st.fixed_dictionaries({k: _KEYS[k] for k in keys})
    ),
)
def test_explicit_keys_win_and_are_listed(name, given_keys):
    config: dict = {}
    for (section, key), value in given_keys.items():
        config.setdefault(section, {})[key] = value
    out = apply_preset(name, config)
    preset = PRESETS[name]
    for (section, key), value in given_keys.items():
        assert out[section][key] == value  # the config's own value
    for section, keys in preset.items():  # every preset key the config leaves out is the preset's
        for key, value in keys.items():
            if (section, key) not in given_keys and not isinstance(value, dict):
                assert out[section][key] == value
    listed = {k for k, _, _ in preset_overridden(name, config)}
    expected = {
        f"{s}.{k}" for (s, k), v in given_keys.items() if s in preset and k in preset[s] and preset[s][k] != v
    }
    assert listed == expected
    assert config == {
        s: {k: v for (s2, k), v in given_keys.items() if s2 == s} for s in config
    }  # not mutated


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'dapo'; valid values: grpo, ppo, rloo"):
        apply_preset("dapo", {})
