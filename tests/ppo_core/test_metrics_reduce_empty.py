"""reduce_metrics leaves out a metric with no values (verl reports NaN there), and docs/semantics.md says so in its
table of deviations, pointing at this test."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ppo_core.metrics import reduce_metrics

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["loss", "len/max", "len/min", "kl"]


@given(
    st.lists(
        st.tuples(st.dictionaries(st.sampled_from(KEYS), st.floats(-10, 10), max_size=4), st.integers(0, 2)),
        max_size=5,
    ),
    st.dictionaries(st.sampled_from(KEYS), st.lists(st.floats(-10, 10), max_size=2), max_size=4),
)
def test_a_metric_without_values_is_left_out_never_nan(weighted_rows, lists):
    rows = [row for row, _ in weighted_rows]
    weights = [w for _, w in weighted_rows]
    reduced, counts = reduce_metrics(rows, weights=weights, return_counts=True)
    with_value = {k for row, w in weighted_rows if w > 0 for k in row}
    assert set(reduced) == set(counts) == with_value
    assert all(math.isfinite(v) for v in reduced.values())
    assert set(reduce_metrics(lists)) == {k for k, values in lists.items() if values}


def test_semantics_lists_the_deviation_with_this_test():
    rows = [
        line
        for line in (ROOT / "docs" / "semantics.md").read_text().splitlines()
        if line.startswith("| `reduce_metrics`") and "no values" in line
    ]
    assert len(rows) == 1, "docs/semantics.md needs one table row for reduce_metrics without values"
    behaviour, verl, ours, reason, test = (cell.strip() for cell in rows[0].strip().strip("|").split("|"))
    assert "no values" in behaviour
    assert "NaN" in verl
    assert "left out" in ours and reason
    assert (ROOT / test.strip("`")).resolve() == Path(__file__).resolve()
