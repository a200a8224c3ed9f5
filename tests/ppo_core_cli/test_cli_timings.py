"""The step-time breakdown (``--timings-json``) against a hand-written reference, and the validation reward read from
the metric records."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.trainer.plot import validation_reward
from ppo_core_cli.timings import STAGES, step_time_breakdown

TIMERS = [
    "gen",
    "reward",
    "reward_wait",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
]


def _record(step: int, times: dict[str, float], tokens: float, length: float) -> dict:
    rec = {"step": step, "perf/total_num_tokens": tokens, "response_length/mean": length}
    rec |= {f"timing_s/{k}": v for k, v in times.items()}
    rec["timing_s/step"] = sum(times.values()) + 0.25  # a quarter second outside the stages
    return rec


@given(
    st.lists(
        st.fixed_dictionaries({t: st.floats(0, 10) for t in TIMERS}),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 8),
)
def test_breakdown_against_a_reference(steps, warmup):
    records = [_record(i + 1, t, tokens=1000.0 * (i + 1), length=10.0 + i) for i, t in enumerate(steps)]
    records.insert(0, {"step": 0, "val-core/x/reward/mean@1": 0.5})  # a validation-only record is no step
    out = step_time_breakdown(records, warmup_steps=warmup, num_responses=64)
    skip = min(warmup, len(steps) - 1)
    kept = steps[skip:]
    assert out["steps"] == len(steps) and out["warmup_steps"] == skip and len(out["per_step"]) == len(steps)
    mean = out["mean_s"]
    # written out per stage, from the trainer's timer names
    assert math.isclose(mean["generation"], sum(t["gen"] for t in kept) / len(kept), abs_tol=1e-9)
    assert math.isclose(
        mean["reward"], sum(t["reward"] + t["reward_wait"] for t in kept) / len(kept), abs_tol=1e-9
    )
    assert math.isclose(mean["actor_update"], sum(t["update_actor"] for t in kept) / len(kept), abs_tol=1e-9)
    assert math.isclose(mean["everything_else"], 0.25, abs_tol=1e-9)
    assert math.isclose(sum(mean[k] for k in (*STAGES, "everything_else")), mean["step"], rel_tol=1e-9)
    if mean["step"] > 0:
        assert math.isclose(sum(out["share"].values()), 1.0, rel_tol=1e-9)
    tokens = sum(1000.0 * (i + 1) for i in range(skip, len(steps))) / len(kept)
    assert math.isclose(out["tokens_per_s"]["step"], tokens / mean["step"], rel_tol=1e-9)
    if mean["generation"] > 0:
        length = sum(10.0 + i for i in range(skip, len(steps))) / len(kept)
        assert math.isclose(out["tokens_per_s"]["generation"], length * 64 / mean["generation"], rel_tol=1e-9)
    assert [s["global_step"] for s in out["per_step"]] == list(range(1, len(steps) + 1))


def test_missing_timers_count_as_zero_and_no_step_is_an_error():
    out = step_time_breakdown([{"step": 1, "timing_s/step": 2.0, "timing_s/gen": 1.5}], warmup_steps=3)
    assert out["warmup_steps"] == 0 and out["mean_s"]["generation"] == 1.5
    assert out["mean_s"]["everything_else"] == 0.5 and out["mean_s"]["critic_update"] == 0.0
    assert "generation" not in out["tokens_per_s"]  # no response count given
    with pytest.raises(ValueError, match="no training step"):
        step_time_breakdown([{"step": 0, "val-core/a/acc/mean@1": 1.0}])


def test_validation_reward_takes_the_largest_n_per_source_and_averages_sources():
    record = {
        "val-aux/a/reward/mean@1": 0.1,
        "val-core/a/reward/mean@4": 0.4,
        "val-aux/b/reward/mean@1": 0.8,
        "val-core/b/acc/mean@1": 1.0,  # not a reward
        "critic/score/mean": 0.3,
    }
    assert validation_reward(record) == pytest.approx((0.4 + 0.8) / 2)
    assert validation_reward({"val-aux/a/reward/mean@1": None, "step": 1}) is None
    assert validation_reward({"critic/score/mean": 0.3}) is None
