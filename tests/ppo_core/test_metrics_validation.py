"""Validation metrics: majority vote tie-break, bootstrap, per-uid aggregation with mixed N, RNG hygiene."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.metrics import bootstrap, flatten_validation_metrics, majority_vote, process_validation_metrics
from ppo_core.metrics.validation import _majority_values

FEW = settings(max_examples=min(60, settings.default.max_examples))


def majority_oracle(votes, values):
    counts = {v: votes.count(v) for v in votes}
    top = max(counts.values())
    winner = min((v for v in counts if counts[v] == top), key=votes.index)
    return float(values[votes.index(winner)])


@given(st.lists(st.tuples(st.sampled_from("ABCD"), st.floats(-10, 10)), min_size=1, max_size=12))
def test_majority_vote_matches_oracle(pairs):
    votes, values = [v for v, _ in pairs], [x for _, x in pairs]
    assert majority_vote(votes, values) == majority_oracle(votes, values)


def test_majority_vote_tie_goes_to_first_seen_vote_and_its_first_value():
    """(B, A, A, B) is a tie; B is seen first, so the first B's value wins."""
    assert majority_vote(["B", "A", "A", "B"], [0.1, 0.2, 0.3, 0.4]) == 0.1
    assert majority_vote(["A", "A", "B"], [0.9, 0.8, 0.1]) == 0.9
    with pytest.raises(ValueError, match="non-empty and of equal length"):
        majority_vote([], [])


@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_vectorized_majority_matches_loop(n_codes, size, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, n_codes, size=(20, size))
    values = rng.normal(size=(20, size))
    want = [majority_oracle(list(c), list(v)) for c, v in zip(codes.tolist(), values.tolist(), strict=True)]
    assert _majority_values(codes, values).tolist() == want


def test_bootstrap_matches_verl_expectations_and_leaves_global_rng_alone():
    state = np.random.get_state()
    (mean_of_means, _), (mean_of_max, _) = bootstrap(
        [1, 2, 3, 4, 5], 3, [lambda x: x.mean(axis=1), lambda x: x.max(axis=1)], n_bootstrap=2000, seed=0
    )
    assert abs(mean_of_means - 3.0) < 0.3 and 3.5 < mean_of_max < 5
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1]) and state[2:] == after[2:]
    with pytest.raises(ValueError, match="non-empty 1-D"):
        bootstrap([], 2, [np.max])
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    fn = [lambda x: x.max(axis=1)]
    assert bootstrap([0, 1, 2], 2, fn, rng=rng_a) == bootstrap([0, 1, 2], 2, fn, rng=rng_b)


@st.composite
def validation_inputs(draw):
    n_uids = draw(st.integers(0, 5))
    sources, uids, rewards, preds = [], [], [], []
    for u in range(n_uids):
        n = draw(st.integers(1, 5))
        source = draw(st.sampled_from(["gsm8k", "math"]))
        for _ in range(n):
            sources.append(source)
            uids.append(f"uid{u}")
            rewards.append(draw(st.sampled_from([0.0, 0.5, 1.0])))
            preds.append(draw(st.sampled_from(["x", "y", "z"])))
    return sources, uids, {"reward": rewards, "pred": preds, "text": [f"t{i}" for i in range(len(uids))]}


def _ns(n):
    sizes, s = [], 2
    while s < n:
        sizes.append(s)
        s *= 2
    return [*sizes, n]


@FEW
@given(validation_inputs())
def test_structure_and_exact_statistics_against_oracle(case):
    sources, uids, infos = case
    state = np.random.get_state()
    got = process_validation_metrics(sources, uids, infos, n_bootstrap=50)
    assert np.array_equal(state[1], np.random.get_state()[1])
    groups: dict = {}
    for i, key in enumerate(zip(sources, uids, strict=True)):
        groups.setdefault(key, []).append(infos["reward"][i])
    expected_names: dict = {}
    mean_values: dict = {}
    for (source, _), values in groups.items():
        n = len(values)
        names = {f"mean@{n}"}
        mean_values.setdefault((source, f"mean@{n}"), []).append(sum(values) / n)
        if n > 1:
            names.add(f"std@{n}")
            mean_values.setdefault((source, f"std@{n}"), []).append(float(np.std(values)))
            for s in _ns(n):
                names |= {f"{a}@{s}/{b}" for a in ("best", "worst", "maj") for b in ("mean", "std")}
        expected_names.setdefault(source, set()).update(names)
    assert set(got) == set(expected_names)
    for source, names in expected_names.items():
        assert set(got[source]) == {"reward"}  # strings skipped, pred is the vote, not a metric
        metrics = got[source]["reward"]
        assert set(metrics) == names
        for name in names:
            if "@" in name and "/" in name:
                low, high = min(infos["reward"]), max(infos["reward"])
                assert low - 1e-12 <= metrics[name] <= high + 1e-12 or name.endswith("/std")
        for (src, name), values in mean_values.items():
            if src == source:
                assert metrics[name] == pytest.approx(math.fsum(values) / len(values)), name


@FEW
@given(validation_inputs(), st.randoms(use_true_random=False))
def test_invariant_to_the_order_of_prompts(case, rnd):
    sources, uids, infos = case
    order = sorted(set(uids), key=lambda _: rnd.random())
    perm = [i for u in order for i in range(len(uids)) if uids[i] == u]
    shuffled = (
        [sources[i] for i in perm],
        [uids[i] for i in perm],
        {k: [v[i] for i in perm] for k, v in infos.items()},
    )
    a = process_validation_metrics(sources, uids, infos, n_bootstrap=20, seed=3)
    b = process_validation_metrics(*shuffled, n_bootstrap=20, seed=3)
    assert a.keys() == b.keys()
    for source in a:
        for metric, value in a[source]["reward"].items():
            assert b[source]["reward"][metric] == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_mixed_n_produces_separate_means_and_a_shared_best_at_2():
    """Mixed n: uids with 4 and 2 responses give mean@4, mean@2 and a best@2 averaged over both."""
    uids = ["a"] * 4 + ["b"] * 2
    got = process_validation_metrics(["ds"] * 6, uids, {"acc": [1, 0, 0, 0, True, False]}, n_bootstrap=200)[
        "ds"
    ]["acc"]
    assert got["mean@4"] == 0.25 and got["mean@2"] == 0.5
    assert {"best@2/mean", "best@4/mean", "worst@4/std"} <= set(got) and "best@8/mean" not in got


def test_best_at_n_is_the_with_replacement_estimate():
    """best@N resamples with replacement: one correct of 4, best@4 ~ 1 - (3/4)^4 = 0.684 (not pass@4 = 1)."""
    got = process_validation_metrics(["ds"] * 4, ["u"] * 4, {"acc": [1, 0, 0, 0]}, n_bootstrap=20000)
    assert abs(got["ds"]["acc"]["best@4/mean"] - (1 - 0.75**4)) < 0.01


def test_single_response_gives_only_mean_at_1_and_empty_gives_empty():
    got = process_validation_metrics(["ds"], ["u"], {"reward": [0.7], "pred": ["x"]})
    assert got == {"ds": {"reward": {"mean@1": 0.7}}}
    assert process_validation_metrics([], [], {}) == {}
    assert process_validation_metrics([], [], {"reward": []}) == {}


def test_maj_uses_the_pred_votes():
    got = process_validation_metrics(
        ["ds"] * 3, ["u"] * 3, {"acc": [1.0, 1.0, 0.0], "pred": ["A", "A", "B"]}, n_bootstrap=5000
    )["ds"]["acc"]
    # A resample of 3 votes cannot tie; it picks A (value 1) iff it holds >= 2 A's:
    # P = 3 * (2/3)^2 * (1/3) + (2/3)^3 = 20/27.
    assert abs(got["maj@3/mean"] - 20 / 27) < 0.02


def test_deterministic_given_seed_and_length_errors():
    args = (["ds"] * 3, ["u"] * 3, {"r": [0.0, 1.0, 0.5]})
    assert process_validation_metrics(*args, seed=1) == process_validation_metrics(*args, seed=1)
    assert process_validation_metrics(*args, seed=1) != process_validation_metrics(*args, seed=2)
    with pytest.raises(ValueError, match=r"infos\['r'\] has 2 entries but data_sources has 3"):
        process_validation_metrics(["ds"] * 3, ["u"] * 3, {"r": [0.0, 1.0]})
    with pytest.raises(ValueError, match="uids has 2 entries but data_sources has 3"):
        process_validation_metrics(["ds"] * 3, ["u"] * 2, {})


def test_flatten_puts_core_metrics_at_the_largest_n_in_val_core():
    metrics = {
        "ds": {
            "acc": {"mean@4": 0.5, "mean@2": 0.4, "best@4/mean": 0.9, "std@4": 0.1, "maj@4/mean": 0.6},
            "reward": {"mean@4": 0.3},
        }
    }
    got = flatten_validation_metrics(metrics)
    assert {k for k in got if k.startswith("val-core")} == {
        "val-core/ds/acc/mean@4",
        "val-core/ds/acc/best@4/mean",
        "val-core/ds/acc/maj@4/mean",
    }
    assert got["val-aux/ds/reward/mean@4"] == 0.3 and got["val-aux/ds/acc/std@4"] == 0.1
    assert "val-core/ds/reward/mean@4" in flatten_validation_metrics(metrics, core_var="reward")
    assert flatten_validation_metrics({}) == {}


@given(st.lists(st.floats(-100, 100), min_size=1, max_size=6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_bootstrap_matches_a_loop_over_the_same_resamples(data, subset, seed):
    got = bootstrap(
        data, subset, [lambda x: x.max(axis=1), lambda x: x.min(axis=1)], n_bootstrap=30, seed=seed
    )
    picks = np.random.default_rng(seed).integers(0, len(data), size=(30, subset))
    maxima = [max(data[i] for i in row) for row in picks.tolist()]
    minima = [min(data[i] for i in row) for row in picks.tolist()]
    for (mean, std), stats in zip(got, (maxima, minima), strict=True):
        assert mean == pytest.approx(np.mean(stats)) and std == pytest.approx(np.std(stats), abs=1e-9)
        assert min(data) - 1e-9 <= mean <= max(data) + 1e-9


@given(
    st.dictionaries(
        st.sampled_from(["acc", "reward", "len"]),
        st.dictionaries(
            st.builds(
                lambda a, n, s: f"{a}@{n}{s}",
                st.sampled_from(["mean", "std", "best", "worst", "maj"]),
                st.sampled_from([1, 2, 4]),
                st.sampled_from(["", "/mean", "/std"]),
            ),
            st.floats(0, 1),
            max_size=6,
        ),
        max_size=3,
    )
)
def test_flatten_matches_the_val_core_rule(per_var):
    got = flatten_validation_metrics({"ds": per_var})
    core = "acc" if "acc" in per_var else "reward"
    want = {}
    for var, metrics in per_var.items():
        n_max = max((int(m.split("@")[1].split("/")[0]) for m in metrics), default=0)
        for m, v in metrics.items():
            n = int(m.split("@")[1].split("/")[0])
            is_core = var == core and m.split("@")[0] in ("mean", "maj", "best") and n == n_max
            want[f"{'val-core' if is_core else 'val-aux'}/ds/{var}/{m}"] = v
    assert got == want
