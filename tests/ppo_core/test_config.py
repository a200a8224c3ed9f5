"""AlgorithmConfig: verl's defaults, dict round trip, nested KLConfig, validation naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.config import IN_REWARD_KL_ESTIMATORS, AlgorithmConfig
from ppo_core.kl import KL_ESTIMATORS
from ppo_core.kl_control import KLConfig

ADV_ESTIMATORS = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
]

unit = st.floats(min_value=0.0, max_value=1.0)
kl_configs = st.builds(
    KLConfig,
    type=st.sampled_from(["fixed", "adaptive"]),
    kl_coef=st.floats(min_value=0.0, max_value=10.0),
    target_kl=st.floats(min_value=1e-6, max_value=10.0),
    horizon=st.integers(min_value=1, max_value=10**7),
)
algorithm_configs = st.builds(
    AlgorithmConfig,
    adv_estimator=st.sampled_from(ADV_ESTIMATORS),
    gamma=unit,
    lam=unit,
    norm_adv_by_std_in_grpo=st.booleans(),
    use_kl_in_reward=st.booleans(),
    kl_penalty=st.sampled_from(IN_REWARD_KL_ESTIMATORS),
    kl_ctrl=kl_configs,
)


def test_defaults_are_verls() -> None:
    cfg = AlgorithmConfig()
    assert cfg.to_dict() == {
        "adv_estimator": "gae",
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std_in_grpo": True,
        "adv_std_epsilon": 1e-6,  # verl's hard-coded value
        "use_kl_in_reward": False,
        "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000},
        # verl's algorithm/rollout_correction.yaml
        "rollout_correction": {
            "rollout_is": None,
            "rollout_is_threshold": 2.0,
            "rollout_is_batch_normalize": False,
            "rollout_rs": None,
            "rollout_rs_threshold": None,
            "bypass_mode": False,
            "loss_type": "ppo_clip",
        },
    }
    assert AlgorithmConfig.from_dict({}) == cfg
    assert AlgorithmConfig.from_dict(None) == cfg


@given(algorithm_configs)
def test_dict_round_trip(cfg: AlgorithmConfig) -> None:
    data = cfg.to_dict()
    assert isinstance(data["kl_ctrl"], dict)
    again = AlgorithmConfig.from_dict(data)
    assert again == cfg
    assert again.to_dict() == data


@given(algorithm_configs)
def test_nested_dict_builds_nested_config(cfg: AlgorithmConfig) -> None:
    partial = {"kl_ctrl": {"type": cfg.kl_ctrl.type, "horizon": cfg.kl_ctrl.horizon}}
    built = AlgorithmConfig.from_dict(partial)
    assert isinstance(built.kl_ctrl, KLConfig)
    assert built.kl_ctrl == KLConfig(type=cfg.kl_ctrl.type, horizon=cfg.kl_ctrl.horizon)
    # a plain dict given to the constructor is converted too
    assert AlgorithmConfig(kl_ctrl=partial["kl_ctrl"]).kl_ctrl == built.kl_ctrl


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match="lambda") as err:
        AlgorithmConfig.from_dict({"lambda": 0.95})
    assert "lam" in str(err.value)
    with pytest.raises(ValueError, match="kl_coeff"):
        AlgorithmConfig.from_dict({"kl_ctrl": {"kl_coeff": 0.1}})


@pytest.mark.parametrize(
    ("data", "error", "name"),
    [
        ({"gamma": 1.5}, ValueError, "gamma"),
        ({"gamma": float("nan")}, ValueError, "gamma"),
        ({"lam": -0.1}, ValueError, "lam"),
        ({"lam": "0.9"}, TypeError, "lam"),
        ({"adv_estimator": "ppo"}, ValueError, "adv_estimator"),
        ({"kl_penalty": "k4"}, ValueError, "kl_penalty"),
        ({"kl_penalty": "full"}, ValueError, "kl_penalty"),
        ({"use_kl_in_reward": "false"}, TypeError, "use_kl_in_reward"),
        ({"norm_adv_by_std_in_grpo": 1}, TypeError, "norm_adv_by_std_in_grpo"),
        ({"kl_ctrl": {"type": "adaptive", "target_kl": 0}}, ValueError, "target_kl"),
        ({"kl_ctrl": 0.1}, TypeError, "kl_ctrl"),
    ],
)
def test_validation_names_the_field(data: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        AlgorithmConfig.from_dict(data)


def test_in_reward_estimators_exclude_full() -> None:
    """The in-reward penalty sees only sampled-token log-probs, so the exact KL is rejected at config time."""
    assert set(KL_ESTIMATORS) - set(IN_REWARD_KL_ESTIMATORS) == {"full", "full+"}
    with pytest.raises(ValueError, match="low_var_kl"):
        AlgorithmConfig(kl_penalty="full+")
