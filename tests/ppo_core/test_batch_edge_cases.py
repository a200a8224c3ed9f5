"""Batch edge cases: ``union``/``concat`` with NaN and mismatched keys, padding rows for data parallelism
(cyclic from row 0, ``PadInfo`` keeps every rank, merging trims exactly) and ``balance_by_seqlen``'s
equal-size partitions.

Expected values are derived in the test (a loop, float64 or a small closed form), never copied from a run;
where verl behaves differently, ``docs/semantics.md`` says how and why.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import (
    balance_by_seqlen,
    concat,
    merge_from_dp,
    pad_to_multiple,
    select,
    split_for_dp,
    union,
    unpad,
)
from ppo_core.metrics import reduce_metrics

# --------------------------------------------------------------------------------------------------------------
# union compares NaN as equal (tensors and non-tensors), returns a new batch; concat([]) raises


def test_union_treats_identical_nan_tensors_as_equal_and_copies() -> None:
    x = torch.tensor([float("nan"), 1.0, float("inf")])
    a = TensorDict({"x": x.clone(), "tag": NonTensorStack(float("nan"), "p", 3)}, batch_size=[3])
    b = TensorDict(
        {"x": x.clone(), "tag": NonTensorStack(float("nan"), "p", 3), "y": torch.arange(3)}, batch_size=[3]
    )
    out = union(a, b)
    assert set(out.keys()) == {"x", "tag", "y"}
    assert torch.equal(out["y"], torch.arange(3))
    assert "y" not in a  # not in place, unlike verl's DataProto.union
    out["x"][1] = 5.0
    assert a["x"][1].item() == 1.0  # the result has its own storage


def test_union_refuses_different_values_naming_the_key() -> None:
    a = TensorDict({"x": torch.tensor([float("nan"), 1.0])}, batch_size=[2])
    b = TensorDict({"x": torch.tensor([float("nan"), 2.0])}, batch_size=[2])
    with pytest.raises(ValueError, match="'x'"):
        union(a, b)
    c = TensorDict({"x": torch.tensor([0.0, 1.0])}, batch_size=[2])  # NaN vs a number is a difference
    with pytest.raises(ValueError, match="'x'"):
        union(a, c)
    s1 = TensorDict({"s": NonTensorStack("a", "b")}, batch_size=[2])
    s2 = TensorDict({"s": NonTensorStack("a", "c")}, batch_size=[2])
    with pytest.raises(ValueError, match="'s'"):
        union(s1, s2)


def test_concat_empty_list_and_mismatches_raise() -> None:
    with pytest.raises(ValueError, match="batches"):
        concat([])
    a = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(TypeError, match="'x'"):
        concat([a, TensorDict({"x": torch.zeros(1, 3, dtype=torch.float64)}, batch_size=[1])])
    with pytest.raises(ValueError, match="'x'"):
        concat([a, TensorDict({"x": torch.zeros(1, 4)}, batch_size=[1])])
    with pytest.raises(ValueError, match="missing"):
        concat([a, TensorDict({"z": torch.zeros(1, 3)}, batch_size=[1])])


# --------------------------------------------------------------------------------------------------------------
# Padding for data parallelism: cyclic from row 0, PadInfo keeps every rank, merge trims exactly


def _rows_batch(size: int) -> TensorDict:
    return TensorDict(
        {"x": torch.arange(size), "uid": NonTensorStack(*[f"u{i}" for i in range(size)])}, batch_size=[size]
    )


def test_split_for_dp_five_rows_on_four_ranks_keeps_every_rank() -> None:
    shards, info = split_for_dp(_rows_batch(5), 4, pad="repeat")
    # ceil(5 / 4) = 2 rows per rank, 8 - 5 = 3 padding rows copied cyclically from row 0 (verl: the last row)
    assert [s["x"].tolist() for s in shards] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert (info.shard_size, info.pad_size, info.valid_counts) == (2, 3, [2, 2, 1, 0])
    assert info.row_mask().tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert merge_from_dp(shards, info).get("uid").tolist() == [f"u{i}" for i in range(5)]
    # per-rank metrics: one entry per rank (none dropped), weighted by its real rows = the global mean
    per_rank = []
    for rank, shard in enumerate(shards):
        real = shard["x"][: info.valid_rows(rank)].double()
        per_rank.append({"x_mean": real.mean().item() if real.numel() else 0.0})
    assert len(per_rank) == 4
    assert reduce_metrics(per_rank, weights=info.valid_counts)["x_mean"] == pytest.approx(2.0)  # mean(0..4)
    with pytest.raises(ValueError, match="dp_size"):
        split_for_dp(_rows_batch(5), 4)


@given(st.integers(0, 20), st.integers(1, 9))
def test_split_merge_roundtrip_and_padinfo(size: int, dp_size: int) -> None:
    shards, info = split_for_dp(_rows_batch(size), dp_size, pad="repeat")
    padded = size + (-size) % dp_size if size else 0
    assert info.pad_size == padded - size
    assert len(shards) == dp_size and all(s.batch_size[0] == info.shard_size for s in shards)
    flat = [v for s in shards for v in s["x"].tolist()]
    assert flat == [i % max(size, 1) for i in range(padded)]
    assert sum(info.valid_counts) == size
    mask = info.row_mask().flatten().tolist()
    assert mask == [i < size for i in range(padded)]
    assert merge_from_dp(shards, info)["x"].tolist() == list(range(size))


def test_pad_cycles_from_the_first_row_and_can_exceed_the_batch() -> None:
    padded, pad = pad_to_multiple(_rows_batch(5), 12)
    assert pad == 7  # larger than B = 5
    assert padded["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert padded.get("uid").tolist()[5:] == ["u0", "u1", "u2", "u3", "u4", "u0", "u1"]


@given(st.integers(0, 15), st.integers(1, 16))
def test_pad_to_multiple_then_unpad(size: int, k: int) -> None:
    padded, pad = pad_to_multiple(_rows_batch(size), k)
    assert pad == (-size) % k and (size + pad) % k == 0
    assert padded["x"].tolist() == [i % max(size, 1) for i in range(size + pad)]
    assert unpad(padded, pad)["x"].tolist() == list(range(size))


# --------------------------------------------------------------------------------------------------------------
# balance_by_seqlen: equal-size partitions, rank j gets partition j, loud failure, never worse than greedy


def _greedy_imbalance(weights: list[int], k: int) -> int:
    """Longest-first into the lightest partition with room (equal sizes): the baseline we must not lose to."""
    cap = len(weights) // k
    sums, counts = [0] * k, [0] * k
    for w in sorted(weights, reverse=True):
        j = min((j for j in range(k) if counts[j] < cap), key=lambda j: (sums[j], counts[j], j))
        sums[j] += w
        counts[j] += 1
    return max(sums) - min(sums)


@given(st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), st.integers(1, 5))), st.data())
def test_balance_equal_size_partitions_map_to_ranks(k_rows: tuple[int, int], data: st.DataObject) -> None:
    k, per_rank = k_rows
    seqlens = data.draw(st.lists(st.integers(0, 1000), min_size=k * per_rank, max_size=k * per_rank))
    parts, perm = balance_by_seqlen(seqlens, k)
    assert sorted(perm.tolist()) == list(range(len(seqlens)))
    assert [len(p) for p in parts] == [per_rank] * k
    sums = [sum(seqlens[i] for i in p) for p in parts]
    imbalance = max(sums) - min(sums)
    assert imbalance <= _greedy_imbalance(seqlens, k)
    assert imbalance <= max(seqlens) - min(seqlens)  # the equal-size Karmarkar-Karp bound
    batch = TensorDict({"x": torch.arange(len(seqlens))}, batch_size=[len(seqlens)])
    shards, _ = split_for_dp(select(batch, perm), k)
    assert [s["x"].tolist() for s in shards] == parts  # partition j lands on rank j


def test_balance_too_small_or_non_divisible_batches_fail_loudly() -> None:
    with pytest.raises(ValueError, match="k=4"):
        balance_by_seqlen([1, 2, 3], 4)
    with pytest.raises(ValueError, match="divisible"):
        balance_by_seqlen([1, 2, 3, 4, 5], 2)
    parts, _ = balance_by_seqlen([1, 2, 3, 4, 5], 2, equal_size=False)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
