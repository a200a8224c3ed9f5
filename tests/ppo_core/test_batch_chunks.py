"""split (fixed-size chunks with a remainder) and repeat (tiling) against list-of-rows oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import concat, repeat, repeat_interleave, split
from ppo_core.testing.batch_strategies import assert_batch_rows, td_batches

# Each example builds and compares whole TensorDicts (~10-30 ms): fewer examples keep the file fast.
FEW = settings(max_examples=min(60, settings.default.max_examples))


def _chunk_rows(size: int, split_size: int) -> list[list[int]]:
    """Oracle: consecutive runs of split_size row indices, the last one shorter; one empty run for B = 0."""
    rows = list(range(size))
    return [rows[i : i + split_size] for i in range(0, size, split_size)] or [[]]


@FEW
@given(td_batches(), st.integers(1, 14))
def test_split_gives_fixed_size_chunks_with_the_remainder_last(batch, split_size):
    size = batch.batch_size[0]
    chunks = split(batch, split_size)
    want = _chunk_rows(size, split_size)
    assert len(chunks) == len(want)
    for chunk, rows in zip(chunks, want, strict=True):
        assert_batch_rows(chunk, batch, rows)
    assert_batch_rows(concat(chunks), batch, list(range(size)))


def test_split_ten_rows_by_three_and_chunks_own_their_storage():
    batch = TensorDict({"x": torch.arange(10), "uid": NonTensorStack(*"abcdefghij")}, batch_size=[10])
    chunks = split(batch, 3)
    assert [c["x"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [c.get("uid").tolist() for c in chunks][-1] == ["j"]
    chunks[1]["x"][0] = 100  # a chunk is a copy: the batch is untouched
    assert batch["x"][3] == 3
    assert chunks[1]["x"].untyped_storage().nbytes() == 3 * 8  # compact, not a view of the whole batch
    assert [c["x"].tolist() for c in split(batch, 10)] == [list(range(10))]
    assert [len(c) for c in split(batch, 25)] == [10]


def test_split_errors_name_the_argument():
    batch = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="split_size must be >= 1"):
            split(batch, bad)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="split_size must be an int"):
            split(batch, bad)
    with pytest.raises(TypeError, match=r"batch must be a tensordict\.TensorDict"):
        split({"x": torch.arange(4)}, 2)


@FEW
@given(td_batches(max_batch=6), st.integers(1, 4))
def test_repeat_tiles_the_batch_and_differs_from_repeat_interleave(batch, n):
    size = batch.batch_size[0]
    tiled = repeat(batch, n)
    assert_batch_rows(tiled, batch, [i for _ in range(n) for i in range(size)])
    # tiling is interleaving followed by the transposing permutation
    interleaved = repeat_interleave(batch, n)
    assert_batch_rows(interleaved, batch, [i for i in range(size) for _ in range(n)])


def test_repeat_abc_and_errors():
    batch = TensorDict({"x": torch.arange(3), "uid": NonTensorStack("a", "b", "c")}, batch_size=[3])
    out = repeat(batch, 2)
    assert out.get("uid").tolist() == ["a", "b", "c", "a", "b", "c"]
    assert out["x"].tolist() == [0, 1, 2, 0, 1, 2]
    out["x"][0] = 7
    assert batch["x"][0] == 0
    assert repeat(batch, 1)["x"].tolist() == [0, 1, 2]
    for bad in (0, -2):
        with pytest.raises(ValueError, match="repeats must be >= 1"):
            repeat(batch, bad)
    for bad in (2.0, torch.tensor([1, 1, 1])):
        with pytest.raises(TypeError, match="repeats must be an int"):
            repeat(batch, bad)
