"""pad_to_multiple / unpad, concat, repeat_interleave, select and union against list-of-rows oracles."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import concat, pad_to_multiple, repeat_interleave, select, union, unpad
from ppo_core.testing.batch_strategies import assert_batch_rows, td_batches

# Each example builds and compares whole TensorDicts (~10-30 ms): fewer examples keep the file fast.
FEW = settings(max_examples=min(60, settings.default.max_examples))


@FEW
@given(td_batches(), st.integers(1, 7))
def test_pad_to_multiple_cycles_from_first_row_and_unpad_inverts(batch, k):
    size = batch.batch_size[0]
    padded, pad = pad_to_multiple(batch, k)
    assert (size + pad) % k == 0 and 0 <= pad < k
    assert_batch_rows(padded, batch, [i % size for i in range(size + pad)] if size else [])
    assert_batch_rows(unpad(padded, pad), batch, list(range(size)))


def test_pad_can_exceed_batch_size():
    padded, pad = pad_to_multiple(TensorDict({"x": torch.arange(5)}, batch_size=[5]), 12)
    assert pad == 7 and padded["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="pad_size=13 is larger than the batch size 12"):
        unpad(padded, 13)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pad_to_multiple(padded, 0)


@FEW
@given(td_batches(max_batch=8), st.lists(st.integers(0, 8), min_size=1, max_size=4))
def test_concat_of_pieces_is_the_batch(batch, cuts):
    size = batch.batch_size[0]
    bounds = sorted({0, size, *(min(c, size) for c in cuts)})
    pieces = [select(batch, list(range(a, b))) for a, b in itertools.pairwise(bounds)] or [batch]
    assert_batch_rows(concat(pieces), batch, list(range(size)))


def test_concat_errors_name_the_key_and_batches():
    a = TensorDict({"x": torch.zeros(2, 3), "uid": NonTensorStack("a", "b")}, batch_size=[2])
    with pytest.raises(ValueError, match="non-empty sequence"):
        concat([])
    b = TensorDict({"x": torch.zeros(1, 3)}, batch_size=[1])
    with pytest.raises(ValueError, match=r"batches\[1\] has different keys .* missing \['uid'\], extra \[\]"):
        concat([a, b])
    c = TensorDict({"x": torch.zeros(1, 3, dtype=torch.float64), "uid": NonTensorStack("c")}, batch_size=[1])
    with pytest.raises(TypeError, match=r"key 'x' has dtype torch.float32 in batches\[0\] but torch.float64"):
        concat([a, c])
    d = TensorDict({"x": torch.zeros(1, 4), "uid": NonTensorStack("c")}, batch_size=[1])
    with pytest.raises(
        ValueError, match=r"key 'x' has shape \(2, 3\) in batches\[0\] but \(1, 4\) in batches\[1\]"
    ):
        concat([a, d])
    e = TensorDict({"x": torch.zeros(1, 3), "uid": torch.zeros(1)}, batch_size=[1])
    with pytest.raises(TypeError, match="key 'uid' is a non-tensor in batches\\[0\\] but a tensor"):
        concat([a, e])
    nested = TensorDict({"x": torch.zeros(1, 3), "uid": NonTensorStack("c"), "n": {"y": torch.zeros(1)}}, [1])
    with pytest.raises(ValueError, match=r"extra \['n.y'\]"):
        concat([a, nested])


@FEW
@given(td_batches(max_batch=6), st.integers(1, 4))
def test_repeat_interleave_repeats_rows_in_place_and_keeps_uids(batch, n):
    size = batch.batch_size[0]
    out = repeat_interleave(batch, n)
    assert_batch_rows(out, batch, [i for i in range(size) for _ in range(n)])
    uids = out.get("uid").tolist()
    assert all(len(set(uids[i * n : (i + 1) * n])) == 1 for i in range(size))


@FEW
@given(td_batches(max_batch=6), st.data())
def test_repeat_interleave_with_per_row_counts(batch, data):
    size = batch.batch_size[0]
    counts = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    out = repeat_interleave(batch, torch.tensor(counts, dtype=torch.int64))
    assert_batch_rows(out, batch, [i for i in range(size) for _ in range(counts[i])])


def test_repeat_interleave_errors():
    batch = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        repeat_interleave(batch, 0)
    with pytest.raises(ValueError, match=r"\[B\] integer tensor with B=2"):
        repeat_interleave(batch, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="repeats must be >= 0"):
        repeat_interleave(batch, torch.tensor([1, -1]))


@FEW
@given(td_batches(), st.data())
def test_select_by_indices_and_by_mask(batch, data):
    size = batch.batch_size[0]
    rows = data.draw(st.lists(st.integers(0, size - 1), max_size=10)) if size else []
    assert_batch_rows(select(batch, rows), batch, rows)
    assert_batch_rows(select(batch, torch.tensor(rows, dtype=torch.int32)), batch, rows)
    keep = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    assert_batch_rows(
        select(batch, torch.tensor(keep, dtype=torch.bool)), batch, [i for i in range(size) if keep[i]]
    )


def test_select_errors_name_the_bad_index():
    batch = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(ValueError, match=r"indices must be in \[0, 3\) for a batch of 3 rows, got index 3"):
        select(batch, [0, 3])
    with pytest.raises(ValueError, match=r"got index -1"):
        select(batch, [-1])
    with pytest.raises(ValueError, match="boolean indices must have length B=3, got 2"):
        select(batch, torch.tensor([True, False]))
    with pytest.raises(TypeError, match="integers or a boolean mask"):
        select(batch, torch.tensor([0.0]))


@FEW
@given(td_batches(max_batch=6))
def test_union_with_itself_and_with_new_keys(batch):
    """Identical tensors and objects holding NaN are equal, so a batch unions with its copy."""
    size = batch.batch_size[0]
    assert_batch_rows(union(batch, batch.clone()), batch, list(range(size)))
    extra = TensorDict({"new": torch.arange(size), "tag": NonTensorStack(*["t"] * size)}, batch_size=[size])
    out = union(batch, extra)
    assert out["new"].tolist() == list(range(size))
    assert out.get("tag").tolist() == ["t"] * size
    assert "new" not in batch  # inputs untouched


def test_union_conflicts_name_the_key():
    a = TensorDict({"x": torch.tensor([float("nan"), 1.0]), "uid": NonTensorStack("a", "b")}, batch_size=[2])
    b = TensorDict({"x": torch.tensor([float("nan"), 2.0])}, batch_size=[2])
    with pytest.raises(ValueError, match="key 'x' is in both a and b with different values"):
        union(a, b)
    c = TensorDict({"uid": NonTensorStack("a", "c")}, batch_size=[2])
    with pytest.raises(ValueError, match="key 'uid' is in both"):
        union(a, c)
    d = TensorDict({"x": torch.tensor([float("nan"), 1.0], dtype=torch.float64)}, batch_size=[2])
    with pytest.raises(ValueError, match="key 'x'"):
        union(a, d)
    with pytest.raises(ValueError, match="a has batch size 2 but b has batch size 1"):
        union(a, TensorDict({}, batch_size=[1]))
