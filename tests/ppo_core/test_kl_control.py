"""KL controllers (fixed, adaptive), their state across a resume, KLConfig, and the in-reward KL penalty."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
)
from ppo_core.testing import PPOBatch, ppo_batches
from ppo_core.testing.kl_oracles import kl_penalty_oracle

ESTIMATORS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "kl+"]


def _adaptive_oracle(beta: float, target: float, horizon: float, kl: float, n_steps: int) -> float:
    """Ziegler et al.'s update as in verl, plus our clamp of the multiplier at 0."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * max(1.0 + error * n_steps / horizon, 0.0)


updates = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=10.0), st.integers(min_value=0, max_value=5000)), max_size=20
)


@given(
    st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=1e-3, max_value=5.0),
    st.integers(min_value=1, max_value=20000),
    updates,
)
def test_adaptive_follows_the_update_rule_and_stays_non_negative(
    beta: float, target: float, horizon: int, steps: list
) -> None:
    ctrl = AdaptiveKLController(init_kl_coef=beta, target_kl=target, horizon=horizon)
    expected = beta
    for kl, n_steps in steps:
        ctrl.update(kl, n_steps)
        expected = _adaptive_oracle(expected, target, horizon, kl, n_steps)
        assert ctrl.value == pytest.approx(expected, rel=1e-12, abs=0.0)
        assert ctrl.value >= 0.0


@given(st.floats(min_value=0.0, max_value=1.0), updates)
def test_fixed_never_changes(beta: float, steps: list) -> None:
    ctrl = FixedKLController(beta)
    for kl, n_steps in steps:
        ctrl.update(kl, n_steps)
    assert ctrl.value == beta


def test_adaptive_direction_and_magnitude() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.2, n_steps=10)  # error clipped to +0.2: beta * (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=0.1, n_steps=10)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=0.09, n_steps=50)  # error -0.1: beta * (1 - 0.1 * 0.5)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.95)


def test_adaptive_beta_never_turns_negative(caplog: pytest.LogCaptureFixture) -> None:
    """verl: beta=0.1, n=1000, horizon=100, KL=0 gives beta = 0.1 * (1 - 0.2 * 10) = -0.1. We clamp at 0 and warn."""
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    with caplog.at_level(logging.WARNING, logger="ppo_core.kl_control"):
        ctrl.update(current_kl=0.0, n_steps=1000)
    assert ctrl.value == 0.0
    assert "clamping beta at 0" in caplog.text


@given(st.floats(min_value=0.0, max_value=1.0), updates, updates)
def test_state_dict_round_trip_survives_resume(beta: float, before: list, after: list) -> None:
    for make in (
        lambda: AdaptiveKLController(init_kl_coef=beta, target_kl=0.1, horizon=1000),
        lambda: FixedKLController(beta),
    ):
        ctrl = make()
        for kl, n in before:
            ctrl.update(kl, n)
        resumed = make()
        resumed.load_state_dict(ctrl.state_dict())
        assert resumed.value == ctrl.value
        for kl, n in after:
            ctrl.update(kl, n)
            resumed.update(kl, n)
        assert resumed.value == ctrl.value


def test_state_dict_validation() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=1000)
    with pytest.raises(KeyError, match="value"):
        ctrl.load_state_dict({})
    with pytest.raises(ValueError, match="value"):
        ctrl.load_state_dict({"value": -1.0})
    with pytest.raises(TypeError, match="value"):
        ctrl.load_state_dict({"value": "0.1"})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_kl_coef": -0.1, "target_kl": 0.1, "horizon": 10}, "init_kl_coef"),
        ({"init_kl_coef": 0.1, "target_kl": 0.0, "horizon": 10}, "target_kl"),
        ({"init_kl_coef": 0.1, "target_kl": -1.0, "horizon": 10}, "target_kl"),
        ({"init_kl_coef": 0.1, "target_kl": 0.1, "horizon": 0}, "horizon"),
        ({"init_kl_coef": 0.1, "target_kl": 0.1, "horizon": float("nan")}, "horizon"),
        ({"init_kl_coef": float("inf"), "target_kl": 0.1, "horizon": 10}, "init_kl_coef"),
    ],
)
def test_adaptive_validation_names_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        AdaptiveKLController(**kwargs)


def test_update_and_fixed_validation() -> None:
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1e-3)
    with pytest.raises(TypeError, match="kl_coef"):
        FixedKLController("0.1")
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="current_kl"):
        ctrl.update(float("nan"), 4)
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(0.1, -1)
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(0.1, 2.5)
    ctrl.update(torch.tensor(0.2), np.int64(1))  # a 0-d tensor and a numpy integer are accepted
    assert ctrl.value == pytest.approx(0.1 * 1.02)


def test_kl_config_defaults_and_builder() -> None:
    cfg = KLConfig()
    assert (cfg.type, cfg.kl_coef, cfg.target_kl, cfg.horizon) == (
        "fixed",
        0.001,
        0.1,
        10000,
    )  # verl's defaults
    fixed = build_kl_controller(cfg)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.001
    adaptive = build_kl_controller({"type": "adaptive", "kl_coef": 0.05, "target_kl": 2.0, "horizon": 7})
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.05, 2.0, 7.0)
    assert isinstance(fixed, KLController) and isinstance(adaptive, KLController)
    with pytest.raises(ValueError, match="type") as err:
        KLConfig(type="pid")
    assert "adaptive" in str(err.value)
    with pytest.raises(ValueError, match="horizon"):
        KLConfig(horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        KLConfig(target_kl=0.0)
    with pytest.raises(ValueError, match="kl_coeff"):
        KLConfig.from_dict({"kl_coeff": 0.1})


@given(
    st.sampled_from(["fixed", "adaptive"]),
    st.floats(min_value=0.0, max_value=10.0),
    st.floats(min_value=1e-6, max_value=10.0),
    st.integers(min_value=1, max_value=10**6),
)
def test_kl_config_round_trip(kind: str, coef: float, target: float, horizon: int) -> None:
    cfg = KLConfig(type=kind, kl_coef=coef, target_kl=target, horizon=horizon)
    assert KLConfig.from_dict(cfg.to_dict()) == cfg


# --------------------------------------------------------------------------------------------- apply_kl_penalty


def _to_tensordict(b: PPOBatch) -> TensorDict:
    return TensorDict(
        {
            "token_level_scores": b.token_level_rewards,
            "old_log_probs": b.old_log_probs,
            "ref_log_probs": b.ref_log_probs,
            "response_mask": b.response_mask,
            "values": b.values,
        },
        batch_size=[b.batch_size],
    )


def _apply_oracle(b: PPOBatch, beta: float, estimator: str) -> tuple[torch.Tensor, float]:
    kld = kl_penalty_oracle(b.old_log_probs, b.ref_log_probs, estimator).tolist()
    mask = b.response_mask.tolist()
    rewards = b.token_level_rewards.double().tolist()
    row_means = []
    for i, row in enumerate(mask):
        valid = [kld[i][t] for t, m in enumerate(row) if m]
        row_means.append(sum(valid) / len(valid) if valid else 0.0)  # all-masked row counts as 0, as in verl
        for t, m in enumerate(row):
            if m:
                rewards[i][t] -= beta * kld[i][t]
    rewards_t = torch.tensor(rewards, dtype=torch.float64).reshape(b.response_mask.shape)
    return rewards_t, sum(row_means) / len(row_means)


@given(ppo_batches(max_batch=8, max_len=10), st.sampled_from(ESTIMATORS), st.booleans())
def test_apply_kl_penalty_matches_loop_oracle_and_ignores_padding(
    b: PPOBatch, estimator: str, adaptive: bool
) -> None:
    ctrl = (
        AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=100)
        if adaptive
        else FixedKLController(0.2)
    )
    batch = _to_tensordict(b)
    before = {key: batch[key].clone() for key in set(batch.keys())}
    out, metrics = apply_kl_penalty(batch, ctrl, estimator)

    rewards, current_kl = _apply_oracle(b, 0.2, estimator)
    torch.testing.assert_close(out["token_level_rewards"].double(), rewards, rtol=1e-5, atol=1e-5)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-5, abs=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2  # beta before the update
    expected_beta = _adaptive_oracle(0.2, 0.05, 100, metrics["actor/reward_kl_penalty"], b.batch_size)
    assert ctrl.value == pytest.approx(expected_beta if adaptive else 0.2, rel=1e-12)
    # the input is untouched; the output shares its other tensors
    assert "token_level_rewards" not in set(batch.keys())
    assert sorted(batch.keys()) == sorted(before)
    for key, value in before.items():
        assert torch.equal(batch[key], value)
        assert out[key] is batch[key]

    # padding values (NaN / -inf log-probs) never change the rewards or the metrics
    junk = batch.copy()
    pad = ~b.response_mask
    junk["old_log_probs"] = b.old_log_probs.masked_fill(pad, float("nan"))
    junk["ref_log_probs"] = b.ref_log_probs.masked_fill(pad, float("-inf"))
    out_junk, metrics_junk = apply_kl_penalty(junk, FixedKLController(0.2), estimator)
    torch.testing.assert_close(out_junk["token_level_rewards"], out["token_level_rewards"])
    assert metrics_junk == metrics


def test_reward_kl_metric_counts_an_all_masked_row_as_zero() -> None:
    batch = TensorDict(
        {
            "token_level_scores": torch.zeros(2, 2),
            "old_log_probs": torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
            "ref_log_probs": torch.tensor([[-1.4, -1.2], [-3.0, -3.0]]),
            "response_mask": torch.tensor([[1, 1], [0, 0]]),
        },
        batch_size=[2],
    )
    _, metrics = apply_kl_penalty(batch, FixedKLController(0.1), "k1")
    row0 = (0.4 + 0.2) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((row0 + 0.0) / 2)


def test_empty_batch_keeps_beta() -> None:
    batch = TensorDict(
        {
            k: torch.zeros(0, 4)
            for k in ("token_level_scores", "old_log_probs", "ref_log_probs", "response_mask")
        },
        batch_size=[0],
    )
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    out, metrics = apply_kl_penalty(batch, ctrl)
    assert out["token_level_rewards"].shape == (0, 4)
    assert metrics == {"actor/reward_kl_penalty": 0.0, "actor/reward_kl_penalty_coeff": 0.1}
    assert ctrl.value == 0.1


def test_apply_kl_penalty_errors() -> None:
    full = {
        "token_level_scores": torch.zeros(2, 3),
        "old_log_probs": torch.zeros(2, 3),
        "ref_log_probs": torch.zeros(2, 3),
        "response_mask": torch.ones(2, 3),
    }
    for key in full:
        partial = TensorDict({k: v for k, v in full.items() if k != key}, batch_size=[2])
        with pytest.raises(KeyError, match=key):
            apply_kl_penalty(partial, FixedKLController(0.1))
    ctrl = FixedKLController(0.1)
    with pytest.raises(ValueError, match="estimator"):
        apply_kl_penalty(TensorDict(full, batch_size=[2]), ctrl, "nope")
    bad = dict(full, ref_log_probs=torch.tensor([[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="not finite"):
        apply_kl_penalty(TensorDict(bad, batch_size=[2]), ctrl, "k1")
    bad = dict(full, old_log_probs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="old_log_probs"):
        apply_kl_penalty(TensorDict(bad, batch_size=[2]), ctrl)
    bad = dict(full, response_mask=torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="response_mask"):
        apply_kl_penalty(TensorDict(bad, batch_size=[2]), ctrl)
    with pytest.raises(TypeError, match="batch"):
        apply_kl_penalty(full, ctrl)
    # k3 clamps the same -inf to a finite penalty, so it is accepted
    ok = dict(full, ref_log_probs=torch.tensor([[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]]))
    out, _ = apply_kl_penalty(TensorDict(ok, batch_size=[2]), ctrl, "k3")
    assert math.isfinite(out["token_level_rewards"].abs().max().item())


@given(st.integers(min_value=0, max_value=2**31 - 1), st.integers(min_value=0, max_value=6))
def test_kl_penalty_rewards_on_any_cut_of_the_rows_are_the_batch_rows_bit_for_bit(
    seed: int, cut: int
) -> None:
    """The per-row core a resident step runs on each rank's rows: the same bits as on the whole batch, and the
    batch's current_kl is the mean of the row values (what apply_kl_penalty reports)."""
    from ppo_core.kl_control import kl_penalty_rewards

    gen = torch.Generator().manual_seed(seed)
    rows, width = 6, 4
    scores = torch.randn(rows, width, generator=gen)
    old, ref = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    mask = torch.rand(rows, width, generator=gen) < 0.7
    whole, row_kl = kl_penalty_rewards(scores, old, ref, mask, 0.1, "kl")
    cut = min(cut, rows)
    parts = [
        kl_penalty_rewards(scores[s], old[s], ref[s], mask[s], 0.1, "kl")
        for s in (slice(0, cut), slice(cut, rows))
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole)
    assert torch.equal(torch.cat([p[1] for p in parts]), row_kl)
    batch = TensorDict(
        {"token_level_scores": scores, "old_log_probs": old, "ref_log_probs": ref, "response_mask": mask},
        batch_size=[rows],
    )
    out, metrics = apply_kl_penalty(batch, FixedKLController(0.1))
    assert torch.equal(out["token_level_rewards"], whole)
    assert metrics["actor/reward_kl_penalty"] == float(row_kl.mean())
