"""The private tensordict helpers, and the tensordict 0.15 behaviours ppo_core.batch relies on."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from ppo_core.batch._td import (
    _check_batch,
    _copy,
    _field_values,
    _key_name,
    _leaves,
    _shallow_copy,
    _slice,
    _tensors_equal,
    _values_equal,
)
from ppo_core.testing.batch_strategies import assert_batch_rows, td_batches

NAN = float("nan")

# Each example builds and compares whole TensorDicts (~10-30 ms): fewer examples keep the file fast.
FEW = settings(max_examples=min(60, settings.default.max_examples))


def test_leaves_include_non_tensor_and_nested_fields():
    b = TensorDict(
        {
            "x": torch.zeros(2),
            "u": NonTensorStack("a", "b"),
            "n": {"y": torch.ones(2), "z": NonTensorStack(1, 2)},
        },
        batch_size=[2],
    )
    assert list(_leaves(b)) == ["x", "u", ("n", "y"), ("n", "z")]
    assert _key_name(("n", "z")) == "n.z"


def test_field_values_of_stack_and_shared_data():
    b = TensorDict({"u": NonTensorStack("a", "a"), "m": NonTensorData("meta")}, batch_size=[2])
    assert _field_values(b, "u") == ["a", "a"]
    assert _field_values(b, "m") == ["meta", "meta"]


def test_check_batch_names_argument():
    with pytest.raises(TypeError, match="batch must be a tensordict"):
        _check_batch("batch", {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"1-D batch_size \[B\], got batch_size \[2, 3\]"):
        _check_batch("batch", TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (NAN, NAN, True),
        (1.0, 1.0, True),
        (1.0, 2.0, False),
        ([1, NAN], [1, NAN], True),
        ([1, NAN], (1, NAN), False),
        ({"k": NAN}, {"k": NAN}, True),
        ({"k": 1}, {"j": 1}, False),
        (None, None, True),
        (None, 0, False),
        (np.array([1.0, NAN]), np.array([1.0, NAN]), True),
        (np.array([1.0, NAN]), np.array([1.0, 2.0]), False),
        (torch.tensor([NAN]), torch.tensor([NAN]), True),
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64), False),
        (torch.tensor([1.0]), 1.0, False),
        ("a", "a", True),
    ],
)
def test_values_equal_is_nan_safe_and_deep(a, b, equal):
    assert _values_equal(a, b) is equal
    assert _values_equal(b, a) is equal


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6))
def test_tensors_equal_matches_elementwise_oracle(xs):
    a = torch.tensor(xs, dtype=torch.float64)
    assert _tensors_equal(a, a.clone())
    oracle = all((x == y) or (x != x and y != y) for x, y in zip(xs, reversed(xs), strict=True))
    assert _tensors_equal(a, a.flip(0)) == oracle


@FEW
@given(td_batches(), st.data())
def test_tensordict_indexing_cat_clone_pickle_keep_non_tensor_rows(batch, data):
    size = batch.batch_size[0]
    rows = data.draw(st.lists(st.integers(0, max(size - 1, 0)), max_size=6)) if size else []
    picked = batch[torch.tensor(rows, dtype=torch.int64)]
    assert_batch_rows(picked, batch, rows)
    assert_batch_rows(pickle.loads(pickle.dumps(picked.clone())), batch, rows)
    cut = data.draw(st.integers(0, size))
    assert_batch_rows(torch.cat([_slice(batch, 0, cut), _slice(batch, cut, size)]), batch, list(range(size)))


def test_torch_cat_promotes_dtypes_so_concat_must_check():
    a = TensorDict({"x": torch.zeros(1)}, batch_size=[1])
    b = TensorDict({"x": torch.zeros(1, dtype=torch.float64)}, batch_size=[1])
    assert torch.cat([a, b])["x"].dtype == torch.float64  # why ppo_core.batch.concat compares dtypes first


def test_slice_is_compact_but_view_is_not():
    big = TensorDict({"x": torch.randn(1000, 50)}, batch_size=[1000])
    view_bytes = len(pickle.dumps(big[:10]))
    compact_bytes = len(pickle.dumps(_slice(big, 0, 10)))
    assert compact_bytes * 20 < view_bytes


@FEW
@given(td_batches(min_batch=1), st.data())
def test_slices_and_copies_are_independent_of_the_batch(batch, data):
    """What ``clone()`` promised: the rows, in new storage, with the rows' Python objects copied, so that assigning
    rows or mutating an object of the copy leaves the batch alone."""
    size = batch.batch_size[0]
    start = data.draw(st.integers(0, size - 1))
    stop = data.draw(st.integers(start + 1, size))
    before = pickle.dumps(batch.clone())
    for copy, rows in (
        (_slice(batch, start, stop), list(range(start, stop))),
        (_copy(batch), list(range(size))),
    ):
        assert_batch_rows(copy, batch, rows)
        assert all(
            copy.get(key).data_ptr() != value.data_ptr()
            for key, value in _leaves(batch).items()
            if isinstance(value, torch.Tensor) and value.numel()
        )
        copy[0:1] = copy[1:2] if copy.batch_size[0] > 1 else copy[0:1].apply(torch.zeros_like)
        for value in copy.get("extra").tolist():
            if isinstance(value, (dict, list)):
                value.clear()
    assert_batch_rows(batch, pickle.loads(before), list(range(size)))


def test_shallow_copy_shares_leaves_but_not_keys():
    batch = TensorDict(
        {"x": torch.zeros(3), "u": NonTensorStack("a", "b", "c"), "n": {"y": torch.ones(3)}}, batch_size=[3]
    )
    out = _shallow_copy(batch)
    assert list(_leaves(out)) == list(_leaves(batch))
    assert out.get("x") is batch.get("x") and out.get(("n", "y")) is batch.get(("n", "y"))
    out.set("x", torch.ones(3))
    out.set("v", NonTensorStack("p", "q", "r"))
    del out["u"]
    assert (
        torch.equal(batch["x"], torch.zeros(3))
        and "v" not in batch
        and batch.get("u").tolist() == ["a", "b", "c"]
    )
    lazy = torch.stack([TensorDict({"x": torch.zeros(2)}, []), TensorDict({"x": torch.ones(2)}, [])])
    assert type(_shallow_copy(lazy)) is type(lazy)  # not a plain TensorDict: its own clone(False)
