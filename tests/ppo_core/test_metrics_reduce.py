"""reduce_metrics: mean / max / min by explicit suffix, weights, counts, against numpy oracles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.metrics import reduce_metrics

KEYS = ["loss", "len/max", "len/min", "critic/terminal_reward", "maxed_out", "a/max_len"]


def _oracle(rows, weights):
    out, counts = {}, {}
    for key in {k for row in rows for k in row}:
        pairs = [(row[key], w) for row, w in zip(rows, weights, strict=True) if key in row and w > 0]
        if not pairs:
            continue
        values = [v for v, _ in pairs]
        last = key.split("/")[-1]
        if last == "max":
            out[key] = max(values)
        elif last == "min":
            out[key] = min(values)
        else:
            out[key] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
        counts[key] = len(pairs)
    return out, counts


@given(
    st.lists(
        st.dictionaries(st.sampled_from(KEYS), st.floats(-1e6, 1e6), max_size=len(KEYS)), max_size=6
    ).flatmap(
        lambda rows: st.tuples(
            st.just(rows), st.lists(st.integers(0, 5), min_size=len(rows), max_size=len(rows))
        )
    )
)
def test_matches_oracle_with_weights_and_counts(case):
    rows, weights = case
    got, counts = reduce_metrics(rows, weights=weights, return_counts=True)
    want, want_counts = _oracle(rows, weights)
    assert counts == want_counts
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-6), key
    unweighted = reduce_metrics(rows)
    assert unweighted == pytest.approx(_oracle(rows, [1] * len(rows))[0])


def test_list_of_dicts_equals_dict_of_lists_and_verl_cases():
    assert reduce_metrics({"a": [1.0, 2.0, 3.0], "b": [0.5]}) == {"a": 2.0, "b": 0.5}
    assert reduce_metrics([{"a": 1.0}, {"a": 3.0}]) == reduce_metrics({"a": [1.0, 3.0]})
    assert reduce_metrics({"empty": []}) == {}
    assert reduce_metrics([]) == {}
    assert reduce_metrics({"t": [torch.tensor(1.0), np.float32(3.0)]}) == {"t": 2.0}


def test_substring_keys_are_averaged_not_maxed_or_mined():
    """verl's substring rule would take the min of 'terminal' and the max of 'maxed_out'."""
    got = reduce_metrics(
        {"critic/terminal_reward": [1.0, 3.0], "maxed_out": [0.0, 1.0], "len/max": [1.0, 3.0]}
    )
    assert got == {"critic/terminal_reward": 2.0, "maxed_out": 0.5, "len/max": 3.0}


def test_zero_weight_rank_is_ignored_even_for_max_and_nan_propagates():
    got = reduce_metrics([{"x/max": 1.0, "m": 1.0}, {"x/max": 99.0, "m": 99.0}], weights=[1, 0])
    assert got == {"x/max": 1.0, "m": 1.0}
    assert np.isnan(reduce_metrics({"m": [1.0, float("nan")]})["m"])


def test_errors():
    with pytest.raises(ValueError, match="weights has 1 entries but metrics has 2 dicts"):
        reduce_metrics([{}, {}], weights=[1])
    with pytest.raises(ValueError, match=r"weights\[0\] = -1.0"):
        reduce_metrics([{}], weights=[-1])
    with pytest.raises(ValueError, match="weights apply to a list"):
        reduce_metrics({"a": [1.0]}, weights=[1])
    with pytest.raises(TypeError, match="metric 'a' must hold numbers, got str"):
        reduce_metrics({"a": ["x"]})
