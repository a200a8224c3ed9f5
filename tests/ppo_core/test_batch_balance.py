"""balance_by_seqlen: equal sizes, every index once, imbalance bounds, never worse than a greedy baseline."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.batch import balance_by_seqlen, seqlen_balance_metrics
from ppo_core.batch.balance import _karmarkar_karp


def _sums(weights, partitions):
    return [sum(weights[i] for i in p) for p in partitions]


def _imbalance(weights, partitions):
    sums = _sums(weights, partitions)
    return max(sums) - min(sums)


def greedy_baseline(weights, k, equal_size):
    """Longest item first into the lightest partition that has room (ties: fewer items, lower index)."""
    capacity = len(weights) // k if equal_size else len(weights)
    parts = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_parts = [j for j in range(k) if len(parts[j]) < capacity]
        j = min(open_parts, key=lambda j: (sum(weights[x] for x in parts[j]), len(parts[j]), j))
        parts[j].append(i)
    return parts


@st.composite
def instances(draw, equal_size):
    k = draw(st.integers(1, 5))
    size = k * draw(st.integers(1, 6)) if equal_size else draw(st.integers(k, 24))
    weights = draw(st.lists(st.integers(0, 300), min_size=size, max_size=size))
    return weights, k


@given(st.booleans().flatmap(lambda eq: st.tuples(st.just(eq), instances(eq))))
def test_partitions_cover_every_index_once_with_equal_sizes(case):
    equal_size, (weights, k) = case
    partitions, perm = balance_by_seqlen(weights, k, equal_size=equal_size)
    assert len(partitions) == k
    assert sorted(i for p in partitions for i in p) == list(range(len(weights)))
    assert perm.tolist() == [i for p in partitions for i in p]
    assert all(p == sorted(p) and p for p in partitions)
    if equal_size:
        assert all(len(p) == len(weights) // k for p in partitions)
    assert _imbalance(weights, partitions) <= _imbalance(weights, greedy_baseline(weights, k, equal_size))


@given(st.booleans().flatmap(lambda eq: st.tuples(st.just(eq), instances(eq))))
def test_karmarkar_karp_alone_stays_within_the_largest_initial_spread(case):
    equal_size, (weights, k) = case
    partitions = _karmarkar_karp([float(w) for w in weights], k, equal_size)
    bound = max(weights) - (min(weights) if equal_size else 0)
    assert _imbalance(weights, partitions) <= bound
    if equal_size:
        assert all(len(p) == len(weights) // k for p in partitions)


def test_karmarkar_karp_beats_greedy_on_average():
    rng = random.Random(0)
    kk_total = greedy_total = 0
    for _ in range(200):
        k = rng.randint(2, 4)
        weights = [rng.randint(1, 4096) for _ in range(k * rng.randint(2, 8))]
        kk_total += _imbalance(weights, _karmarkar_karp([float(w) for w in weights], k, True))
        greedy_total += _imbalance(weights, greedy_baseline(weights, k, True))
    assert kk_total < greedy_total


def test_known_examples():
    parts, _ = balance_by_seqlen(list(range(1, 9)), 2)
    assert _sums(list(range(1, 9)), parts) == [18, 18]
    weights = [10, 1, 1, 1, 1, 1]
    equal, _ = balance_by_seqlen(weights, 2)
    assert sorted(_sums(weights, equal)) == [3, 12] and [len(p) for p in equal] == [3, 3]
    unequal, _ = balance_by_seqlen(weights, 2, equal_size=False)
    assert sorted(map(sorted, unequal)) == [[0], [1, 2, 3, 4, 5]]


def test_tensor_input_and_permutation_dtype():
    parts, perm = balance_by_seqlen(torch.tensor([5.0, 1.0, 4.0, 2.0]), 2)
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == [0, 1, 2, 3]
    assert _sums([5, 1, 4, 2], parts) == [6, 6]


def test_errors_are_loud():
    with pytest.raises(ValueError, match=r"cannot balance 2 rows .* into k=3 partitions"):
        balance_by_seqlen([1, 2], 3)
    with pytest.raises(ValueError, match="divisible by k, got 5 rows and k=2"):
        balance_by_seqlen([1, 2, 3, 4, 5], 2)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        balance_by_seqlen([1], 0)
    with pytest.raises(ValueError, match=r"seqlens\[1\] = nan"):
        balance_by_seqlen([1, float("nan")], 1)
    with pytest.raises(ValueError, match=r"seqlens\[0\] = -1"):
        balance_by_seqlen([-1, 2], 1)


def test_seqlen_balance_metrics_against_hand_sums():
    weights = [1, 1, 5, 5]
    parts, _ = balance_by_seqlen(weights, 2)
    m = seqlen_balance_metrics(weights, parts, prefix="s")
    assert (m["s/min"], m["s/max"], m["s/minmax_diff"]) == (2.0, 10.0, 8.0)
    assert (m["s/balanced_min"], m["s/balanced_max"], m["s/mean"]) == (6.0, 6.0, 6.0)


@given(st.lists(st.integers(0, 100), min_size=1, max_size=12), st.integers(1, 4))
def test_seqlen_balance_metrics_matches_loop_oracle(weights, k):
    k = min(k, len(weights))
    parts, _ = balance_by_seqlen(weights, k, equal_size=False)
    m = seqlen_balance_metrics(weights, parts)
    chunk = -(-len(weights) // k)
    chunks = [sum(weights[j * chunk : (j + 1) * chunk]) for j in range(k)]
    assert m["global_seqlen/min"] == min(chunks) and m["global_seqlen/max"] == max(chunks)
    assert m["global_seqlen/minmax_diff"] == max(chunks) - min(chunks)
    assert m["global_seqlen/balanced_max"] - m["global_seqlen/balanced_min"] == _imbalance(weights, parts)
    assert m["global_seqlen/mean"] == pytest.approx(sum(weights) / k)
