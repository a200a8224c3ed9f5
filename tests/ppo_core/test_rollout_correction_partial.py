"""Rollout correction over shards of rows (``ppo_core.rollout_correction.partial``): the shards' weights, masks and
batch-normalisation mean equal the whole batch's bit for bit, whatever the split; the metrics from the combined
parts equal the whole batch's up to the order of their float64 sums."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_rollout_correction import configs, log_prob_pairs

from ppo_core.rollout_correction import compute_rollout_correction
from ppo_core.rollout_correction.partial import (
    ExactSum,
    correction_rows,
    normalize_weights,
    reduce_correction_parts,
)


def _cuts(draw: st.DrawFn, rows: int) -> list[int]:
    inner = draw(st.lists(st.integers(0, rows), max_size=3))
    return [0, *sorted(inner), rows]


@given(log_prob_pairs(), configs(), st.data())
def test_shards_give_the_whole_batch_weights_masks_and_metrics(inputs, cfg, data) -> None:
    old, rollout, mask = inputs
    if data.draw(st.booleans()):
        old, rollout = old.float(), rollout.float()
    weights, kept, metrics = compute_rollout_correction(old, rollout, mask, cfg)
    cuts = _cuts(data.draw, old.shape[0])
    shards = [correction_rows(old[a:b], rollout[a:b], mask[a:b], cfg) for a, b in itertools.pairwise(cuts)]
    mean, shard_metrics = reduce_correction_parts([s[2] for s in shards], cfg)
    assert torch.equal(torch.cat([s[1] for s in shards]), kept)
    if weights is None:
        assert all(s[0] is None for s in shards)
    else:
        joined = torch.cat([normalize_weights(s[0], mean) for s in shards])
        assert joined.dtype == weights.dtype and torch.equal(joined, weights)
    assert shard_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        assert shard_metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    if "rollout_corr/rollout_is_batch_norm_factor" in metrics:  # the same exact mean: the same bits
        assert (
            shard_metrics["rollout_corr/rollout_is_batch_norm_factor"]
            == metrics["rollout_corr/rollout_is_batch_norm_factor"]
        )


@given(st.lists(st.floats(-1e300, 1e300) | st.floats(-1e-300, 1e-300), max_size=40), st.data())
def test_exact_sum_is_exact_and_independent_of_the_grouping(values, data) -> None:
    whole = ExactSum.of(torch.tensor(values, dtype=torch.float64))
    assert whole.count == len(values)
    assert whole.total == sum((Fraction(v) for v in values), Fraction(0))
    assert float(whole.total) == math.fsum(values)  # both correctly rounded
    cut = data.draw(st.integers(0, len(values)))
    left = ExactSum.of(torch.tensor(values[:cut], dtype=torch.float64))
    right = ExactSum.of(torch.tensor(values[cut:], dtype=torch.float64))
    assert left.total + right.total == whole.total
    expected = float(whole.total / len(values)) if values else 0.0
    assert whole.mean() == expected


def test_reduce_needs_parts() -> None:
    with pytest.raises(ValueError, match="no rollout correction parts"):
        reduce_correction_parts([], {"rollout_is": "token"})
    _, _, parts = correction_rows(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), {"rollout_is": "token"}
    )
    with pytest.raises(ValueError, match="ExactSum"):
        reduce_correction_parts([parts], {"rollout_is": "token", "rollout_is_batch_normalize": True})
