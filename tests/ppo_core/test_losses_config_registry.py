"""PolicyLossConfig validation and dict round trip; the policy-loss registry; argument checking of the losses."""

from __future__ import annotations

import dataclasses
import doctest
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
    vanilla_policy_loss,
)
from ppo_core.losses import registry as registry_module

VERL_LOSSES = [
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "sapo",
    "vanilla",
]


def test_defaults_are_verls():
    cfg = PolicyLossConfig()
    assert (cfg.loss_mode, cfg.clip_ratio, cfg.clip_ratio_c, cfg.loss_agg_mode) == (
        "vanilla",
        0.2,
        3.0,
        "token-mean",
    )
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.2)
    assert (cfg.tau_pos, cfg.tau_neg) == (1.0, 1.05)
    assert (cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (cfg.kl_cov_ratio, cfg.ppo_kl_coef) == (2e-4, 0.1)


@given(
    st.sampled_from(VERL_LOSSES),
    st.sampled_from(LOSS_AGG_MODES),
    st.floats(0, 1, exclude_max=True),
    st.one_of(st.none(), st.floats(0, 1)),
    st.floats(1.001, 100),
)
def test_config_round_trips_through_a_dict(loss_mode, mode, clip_ratio, clip_high, clip_c):
    cfg = PolicyLossConfig(
        loss_mode=loss_mode,
        loss_agg_mode=mode,
        clip_ratio=clip_ratio,
        clip_ratio_high=clip_high,
        clip_ratio_c=clip_c,
    )
    data = cfg.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(PolicyLossConfig)}
    assert PolicyLossConfig.from_dict(data) == cfg
    assert cfg.eps_high == (clip_ratio if clip_high is None else clip_high)


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl", "geo_mean", "sapo", "gpg", "kl_cov"])
def test_a_lower_bound_of_1_or_more_is_accepted_where_it_is_no_ratio_bound(loss_mode):
    assert PolicyLossConfig(loss_mode=loss_mode, clip_ratio_low=1.5).eps_low == 1.5
    assert PolicyLossConfig(loss_mode=loss_mode, clip_ratio=2.0).eps_low == 2.0


def test_the_ratio_bound_is_named_under_its_dotted_path():
    from ppo_core.workers.config import PPOActorConfig

    with pytest.raises(ValueError, match=r"policy_loss\.clip_ratio_low must be < 1"):
        PPOActorConfig.from_dict({"ppo_mini_batch_size": 4, "policy_loss": {"clip_ratio_low": 1.5}})


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="cliprange"):
        PolicyLossConfig.from_dict({"cliprange": 0.2})


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"loss_mode": "ppo"}, ValueError, "loss_mode.*vanilla"),
        ({"loss_agg_mode": "mean"}, ValueError, "loss_agg_mode"),
        ({"clip_ratio": -0.1}, ValueError, "clip_ratio"),
        ({"clip_ratio": "0.2"}, TypeError, "clip_ratio"),
        ({"clip_ratio_low": float("nan")}, ValueError, "clip_ratio_low"),
        ({"clip_ratio_high": -1.0}, ValueError, "clip_ratio_high"),
        ({"clip_ratio_low": 1.5}, ValueError, r"clip_ratio_low must be < 1 .* 1 - clip_ratio_low = -0\.5"),
        ({"clip_ratio": 1.0}, ValueError, r"clip_ratio must be < 1 .*clip_ratio_low is unset"),
        (
            {"loss_mode": "gspo", "clip_ratio_low": 1.0},
            ValueError,
            "clip_ratio_low must be < 1 with loss_mode='gspo'",
        ),
        (
            {"loss_mode": "cispo", "clip_ratio": 2.0},
            ValueError,
            "clip_ratio must be <= 1 with loss_mode='cispo'",
        ),
        ({"loss_mode": "clip_cov", "clip_ratio_low": 1.0}, ValueError, "clip_ratio_low must be < 1"),
        ({"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c"),
        ({"clip_ratio_c": float("inf")}, ValueError, "clip_ratio_c"),
        ({"tau_pos": 0.0}, ValueError, "tau_pos"),
        ({"tau_neg": -1.0}, ValueError, "tau_neg"),
        ({"clip_cov_ratio": 1.5}, ValueError, "clip_cov_ratio"),
        ({"kl_cov_ratio": -0.1}, ValueError, "kl_cov_ratio"),
        ({"clip_cov_lb": 5.0, "clip_cov_ub": 5.0}, ValueError, "clip_cov_lb"),
        ({"ppo_kl_coef": -1.0}, ValueError, "ppo_kl_coef"),
        ({"ppo_kl_coef": True}, TypeError, "ppo_kl_coef"),
    ],
)
def test_config_validation_names_the_field(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        PolicyLossConfig(**kwargs)


def test_registry_holds_every_verl_loss_and_rejects_unknown_names():
    assert set(VERL_LOSSES) <= set(policy_loss_names())
    with pytest.raises(ValueError, match=r"unknown policy loss \(loss_mode\) 'ppo'") as info:
        get_policy_loss("ppo")
    for name in VERL_LOSSES:
        assert name in str(info.value)


def test_register_custom_loss_and_dispatch_through_the_config(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_policy_loss("double_vanilla")
    def double_vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        loss, metrics = vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kwargs)
        return 2 * loss, metrics

    assert register_policy_loss("double_vanilla")(double_vanilla) is double_vanilla  # same function: allowed
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("double_vanilla")(vanilla_policy_loss)
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    single, _ = compute_policy_loss(lp, lp - 0.1, adv, mask, config=PolicyLossConfig())
    double, _ = compute_policy_loss(
        lp, lp - 0.1, adv, mask, config=PolicyLossConfig(loss_mode="double_vanilla")
    )
    assert double.item() == pytest.approx(2 * single.item())


def test_register_rejects_bad_names_and_objects():
    with pytest.raises(TypeError, match="name"):
        register_policy_loss("")
    with pytest.raises(TypeError, match="callable"):
        register_policy_loss("not_a_function")(3)  # type: ignore[arg-type]


def _args(**overrides):
    args = {
        "old_log_prob": torch.zeros(2, 3),
        "log_prob": torch.zeros(2, 3),
        "advantages": torch.ones(2, 3),
        "response_mask": torch.ones(2, 3),
    }
    return args | overrides


@pytest.mark.parametrize("name", VERL_LOSSES)
@pytest.mark.parametrize(
    ("overrides", "exc", "arg"),
    [
        ({"old_log_prob": torch.zeros(2, 4)}, ValueError, "old_log_prob"),
        ({"log_prob": torch.zeros(2, 4)}, ValueError, "log_prob"),
        ({"advantages": torch.zeros(3, 3)}, ValueError, "advantages"),
        ({"advantages": torch.ones(2, 3, dtype=torch.int64)}, TypeError, "advantages"),
        ({"log_prob": [[0.0]]}, TypeError, "log_prob"),
        ({"old_log_prob": torch.zeros(6)}, ValueError, "old_log_prob"),
        ({"response_mask": torch.full((2, 3), 0.5)}, ValueError, "response_mask"),
        ({"response_mask": torch.ones(2, 2)}, ValueError, "response_mask"),
        ({"rollout_is_weights": torch.ones(2, 2)}, ValueError, "rollout_is_weights"),
        ({"config": {"clip_ratio": 0.2, "ppo_mini_batch_size": 4}}, TypeError, "config"),  # not its fields
        ({"loss_agg_mode": "seq-mean"}, ValueError, "loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, ValueError, "loss_scale_factor"),
        ({"dp_size": 2}, ValueError, "batch_num_tokens|global_batch_size"),
    ],
)
def test_bad_inputs_name_the_argument(name, overrides, exc, arg):
    kwargs = {"generator": torch.Generator().manual_seed(0)} | overrides
    if name == "geo_mean" and arg == "loss_scale_factor":  # geo_mean ignores loss_agg_mode
        get_policy_loss(name)(**_args(**kwargs))
        return
    with pytest.raises(exc, match=arg):
        get_policy_loss(name)(**_args(**kwargs))


@pytest.mark.parametrize("name", VERL_LOSSES)
def test_empty_batch_gives_zero(name):
    empty = torch.zeros(0, 5)
    loss, metrics = get_policy_loss(name)(
        empty, empty, empty, empty, generator=torch.Generator().manual_seed(0)
    )
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize(
    "module",
    [
        "aggregation",
        "config",
        "registry",
        "ppo_clip",
        "sequence_level",
        "gated",
        "dppo",
        "covariance",
        "value",
        "entropy",
    ],
)
def test_docstring_examples_run(module, monkeypatch):
    # the registry example registers a loss: keep it out of the real registry
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
    mod = importlib.import_module(f"ppo_core.losses.{module}")
    result = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
