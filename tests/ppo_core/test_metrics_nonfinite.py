"""Metrics never turn NaN, inf or negative silently: data metrics raise, reduce_metrics warns (or raises), timings
raise."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tensordict import TensorDict

from ppo_core.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    reduce_metrics,
)

NAN, INF = float("nan"), float("inf")


def _batch(**overrides: torch.Tensor) -> TensorDict:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    fields = {
        "response_mask": mask,
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        "token_level_rewards": torch.tensor([[0.0, 0.9, 0.0], [0.4, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        "advantages": torch.randn(3, 3, generator=torch.Generator().manual_seed(0)),
        "returns": torch.randn(3, 3, generator=torch.Generator().manual_seed(1)),
        "values": torch.randn(3, 3, generator=torch.Generator().manual_seed(2)),
    }
    return TensorDict(fields | overrides, batch_size=[3])


def _with(key: str, index: tuple[int, int], value: float) -> TensorDict:
    t = _batch()[key].clone()
    t[index] = value
    return _batch(**{key: t})


@pytest.mark.parametrize("key", ["token_level_scores", "token_level_rewards"])
@pytest.mark.parametrize("bad", [NAN, INF])
def test_a_nan_score_raises_naming_the_key(key, bad):
    # a score anywhere in a row with a response enters critic/score (the row sum), even on a masked position
    with pytest.raises(ValueError, match=rf"^{key} contains .* the first at index \[0, 2\]"):
        compute_data_metrics(_with(key, (0, 2), bad))
    # an aborted row (no response) never enters a metric
    got = compute_data_metrics(_with(key, (2, 1), bad))
    assert all(math.isfinite(v) for v in got.values())


@pytest.mark.parametrize("key", ["advantages", "returns", "values"])
def test_non_finite_token_values_raise_at_valid_tokens_only(key):
    with pytest.raises(ValueError, match=rf"^{key} contains NaN .*\[1, 0\]"):
        compute_data_metrics(_with(key, (1, 0), NAN))
    got = compute_data_metrics(_with(key, (1, 1), NAN))  # padding
    assert all(math.isfinite(v) for v in got.values())


def test_values_are_not_read_without_a_critic():
    got = compute_data_metrics(_with("values", (0, 0), NAN), use_critic=False)
    assert all(math.isfinite(v) for v in got.values())


def test_reduce_metrics_warns_naming_the_metric_and_the_position(caplog):
    with caplog.at_level(logging.WARNING, logger="ppo_core.metrics.reduce"):
        got = reduce_metrics([{"a": NAN, "b": 1.0}, {"a": 1.0, "b": 2.0}])
    assert math.isnan(got["a"]) and got["b"] == 1.5  # kept as verl does, but not silently
    assert "non-finite metric values (NaN or inf): 'a' at value(s) [0]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ppo_core.metrics.reduce"):
        reduce_metrics({"grad_norm": [1.0, INF, 2.0], "x": [1.0]})
    assert "'grad_norm' at value(s) [1]" in caplog.text and "'x'" not in caplog.text


def test_reduce_metrics_can_raise_and_ignores_zero_weight_entries(caplog):
    with pytest.raises(ValueError, match=r"'a' at value\(s\) \[0\]"):
        reduce_metrics([{"a": NAN}, {"a": 1.0}], nonfinite="raise")
    with caplog.at_level(logging.WARNING, logger="ppo_core.metrics.reduce"):
        got = reduce_metrics([{"a": NAN}, {"a": 1.0}], weights=[0, 1], nonfinite="raise")
    assert got == {"a": 1.0} and not caplog.text  # a rank that held only padding is ignored entirely
    with pytest.raises(ValueError, match="nonfinite must be one of warn, raise"):
        reduce_metrics([{"a": 1.0}], nonfinite="drop")


@pytest.mark.parametrize("bad", [-0.5, NAN, INF])
def test_negative_or_non_finite_timings_raise_naming_the_timer(bad):
    batch = _batch()
    with pytest.raises(ValueError, match=r"^timing\['gen'\] must be a finite number of seconds >= 0"):
        compute_timing_metrics(batch, {"step": 1.0, "gen": bad})
    with pytest.raises(ValueError, match=r"^timing\['step'\] must be a finite number"):
        compute_throughput_metrics(batch, {"step": bad}, n_gpus=1)
    with pytest.raises(TypeError, match=r"timing\['gen'\] must be a number of seconds, got str"):
        compute_timing_metrics(batch, {"gen": "fast"})
    assert compute_timing_metrics(batch, {"gen": 0.0})["timing_per_token_ms/gen"] == 0.0
