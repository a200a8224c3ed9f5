"""balance_groups_by_seqlen: every group on one rank, equal group counts, imbalance no worse than a greedy
assignment of whole groups, against brute force on small cases."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import balance_groups_by_seqlen, select, split_for_dp


@st.composite
def grouped_instances(draw, equal_size: bool):
    """(seqlens, uids, k): G groups of random sizes (equal sizes half the time), rows shuffled apart."""
    k = draw(st.integers(1, 4))
    n_groups = k * draw(st.integers(1, 4)) if equal_size else draw(st.integers(k, 12))
    same = draw(st.booleans())
    n = draw(st.integers(1, 4))
    sizes = [n if same else draw(st.integers(1, 4)) for _ in range(n_groups)]
    uids = [f"p{g}" for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(uids))))
    uids = [uids[i] for i in order]
    seqlens = draw(st.lists(st.integers(0, 200), min_size=len(uids), max_size=len(uids)))
    return seqlens, uids, k


def _group_sums(seqlens, uids):
    sums: dict[str, int] = {}
    for s, u in zip(seqlens, uids, strict=True):
        sums[u] = sums.get(u, 0) + s
    return sums


def _greedy_groups(sums: dict[str, int], k: int, equal_size: bool) -> list[list[str]]:
    """Baseline: heaviest group first into the lightest partition with room."""
    capacity = len(sums) // k if equal_size else len(sums)
    parts: list[list[str]] = [[] for _ in range(k)]
    for uid in sorted(sums, key=lambda u: (-sums[u], u)):
        j = min(
            (j for j in range(k) if len(parts[j]) < capacity),
            key=lambda j: (sum(sums[u] for u in parts[j]), len(parts[j]), j),
        )
        parts[j].append(uid)
    return parts


def _spread(values):
    return max(values) - min(values)


@given(st.booleans().flatmap(lambda eq: st.tuples(st.just(eq), grouped_instances(eq))))
def test_groups_stay_whole_and_balance_beats_greedy(case):
    equal_size, (seqlens, uids, k) = case
    partitions, perm = balance_groups_by_seqlen(seqlens, uids, k, equal_size=equal_size)
    assert len(partitions) == k
    assert sorted(i for p in partitions for i in p) == list(range(len(seqlens)))
    assert perm.tolist() == [i for p in partitions for i in p]
    assert all(p == sorted(p) and p for p in partitions)
    owner = {}
    for j, p in enumerate(partitions):
        for i in p:
            assert owner.setdefault(uids[i], j) == j, f"group {uids[i]} split across partitions"
    sums = _group_sums(seqlens, uids)
    if equal_size:
        assert len({len({uids[i] for i in p}) for p in partitions}) == 1
    got = _spread([sum(seqlens[i] for i in p) for p in partitions])
    baseline = _spread([sum(sums[u] for u in p) for p in _greedy_groups(sums, k, equal_size)])
    assert got <= baseline


@given(grouped_instances(equal_size=False).filter(lambda c: len(set(c[1])) <= 6))
def test_imbalance_within_the_heaviest_group_and_optimal_for_two_groups(case):
    seqlens, uids, k = case
    partitions, _ = balance_groups_by_seqlen(seqlens, uids, k, equal_size=False)
    sums = _group_sums(seqlens, uids)
    names = sorted(sums)
    best = min(
        _spread([sum(sums[u] for u, a in zip(names, assign, strict=True) if a == j) for j in range(k)])
        for assign in itertools.product(range(k), repeat=len(names))
    )
    got = _spread([sum(seqlens[i] for i in p) for p in partitions])
    assert got <= max(best, max(sums.values()))  # Karmarkar-Karp's bound: at most the largest item
    if len(names) == 2 and k == 2:
        assert got == best


def test_equal_group_sizes_give_equal_rows_and_whole_groups_per_rank():
    uids = ["a", "b", "c", "d"] * 2  # groups of 2, not contiguous
    seqlens = [9, 1, 8, 2, 9, 1, 8, 2]
    partitions, perm = balance_groups_by_seqlen(seqlens, uids, 2)
    assert [sorted({uids[i] for i in p}) for p in partitions] == [["a", "b"], ["c", "d"]]
    batch = TensorDict({"len": torch.tensor(seqlens), "uid": NonTensorStack(*uids)}, batch_size=[8])
    shards, _ = split_for_dp(select(batch, perm), 2)
    assert [s["len"].sum().item() for s in shards] == [20, 20]
    assert [sorted(set(s.get("uid").tolist())) for s in shards] == [["a", "b"], ["c", "d"]]
    # integer uids in a tensor
    parts, _ = balance_groups_by_seqlen(torch.tensor(seqlens), torch.tensor([0, 1, 2, 3] * 2), 2)
    assert parts == partitions


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"3 groups .* k=4"):
        balance_groups_by_seqlen([1, 1, 1], ["a", "b", "c"], 4)
    with pytest.raises(ValueError, match=r"divisible by k, got 3 groups .* and k=2"):
        balance_groups_by_seqlen([1, 1, 1], ["a", "b", "c"], 2)
    parts, _ = balance_groups_by_seqlen([1, 1, 1], ["a", "b", "c"], 2, equal_size=False)
    assert sorted(len(p) for p in parts) == [1, 2]
    with pytest.raises(ValueError, match="uids has 2 entries but seqlens has 3"):
        balance_groups_by_seqlen([1, 1, 1], ["a", "b"], 1)
    with pytest.raises(TypeError, match=r"uids\[1\] = \['x'\]"):
        balance_groups_by_seqlen([1, 1], ["a", ["x"]], 1)
    with pytest.raises(TypeError, match="uids must be a sequence"):
        balance_groups_by_seqlen([1, 1], "ab", 1)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        balance_groups_by_seqlen([1], ["a"], 0)
    with pytest.raises(ValueError, match=r"seqlens\[0\] = -1"):
        balance_groups_by_seqlen([-1], ["a"], 1)
