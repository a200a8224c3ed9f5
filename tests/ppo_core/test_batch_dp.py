"""split_for_dp / merge_from_dp: round trips, rank order, compact shards or views, padding bookkeeping."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.batch import PadInfo, merge_from_dp, split_for_dp
from ppo_core.metrics import reduce_metrics
from ppo_core.testing.batch_strategies import assert_batch_rows, td_batches

# Each example builds and compares whole TensorDicts (~10-30 ms): fewer examples keep the file fast.
FEW = settings(max_examples=min(60, settings.default.max_examples))


def _padded_rows(size: int, dp: int) -> list[int]:
    """Oracle: the rows of the padded batch, cycling from row 0."""
    total = size + (-size) % dp
    return [i % size for i in range(total)] if size else []


@FEW
@given(td_batches(max_batch=13), st.integers(1, 6))
def test_split_then_merge_is_identity_with_padding(batch, dp):
    size = batch.batch_size[0]
    shards, info = split_for_dp(batch, dp, pad="repeat")
    rows = _padded_rows(size, dp)
    shard_size = len(rows) // dp
    assert len(shards) == dp
    assert info == PadInfo(batch_size=size, dp_size=dp, shard_size=shard_size, pad_size=len(rows) - size)
    for r, shard in enumerate(shards):
        assert_batch_rows(shard, batch, rows[r * shard_size : (r + 1) * shard_size])
        assert info.valid_rows(r) == sum(1 for j in range(r * shard_size, (r + 1) * shard_size) if j < size)
    assert sum(info.valid_counts) == size
    mask = info.row_mask()
    assert mask.shape == (dp, shard_size)
    assert mask.reshape(-1).tolist() == [j < size for j in range(len(rows))]
    assert_batch_rows(merge_from_dp(shards, info), batch, list(range(size)))


@FEW
@given(td_batches(max_batch=13), st.integers(1, 6))
def test_pad_error_splits_divisible_batches_and_names_sizes_otherwise(batch, dp):
    size = batch.batch_size[0]
    if size % dp:
        with pytest.raises(ValueError, match=rf"batch size {size} is not divisible by dp_size={dp}"):
            split_for_dp(batch, dp)
        return
    shards, info = split_for_dp(batch, dp)
    assert info.pad_size == 0
    assert all(s.batch_size[0] == size // dp for s in shards)
    assert_batch_rows(merge_from_dp(shards, info), batch, list(range(size)))


def test_empty_batch_gives_empty_shards_and_merges_back():
    batch = TensorDict({"x": torch.zeros(0, 3), "uid": NonTensorStack()}, batch_size=[0])
    for pad in ("error", "repeat"):
        shards, info = split_for_dp(batch, 3, pad=pad)
        assert [s.batch_size[0] for s in shards] == [0, 0, 0]
        assert info.valid_counts == [0, 0, 0]
        merged = merge_from_dp(shards, info)
        assert merged.batch_size == torch.Size([0])
        assert merged["x"].shape == (0, 3)


@pytest.mark.parametrize("dp", [2, 4])
def test_shards_are_compact_when_pickled(dp):
    size = 1024
    parent = TensorDict(
        {
            "x": torch.randn(2 * size, 64),
            "uid": NonTensorStack(*[f"uid-{i:06d}" for i in range(2 * size)]),
        },
        batch_size=[2 * size],
    )
    batch = parent[:size]  # a view: a naive slice of it would pickle the whole parent storage
    whole = len(pickle.dumps(batch.clone()))
    shards, _ = split_for_dp(batch, dp)
    for shard in shards:
        ratio = len(pickle.dumps(shard)) / whole
        assert ratio < 1.15 / dp, ratio
        assert shard["x"].is_contiguous()
        assert shard["x"].untyped_storage().nbytes() == shard["x"].numel() * 4


def test_shards_do_not_alias_the_batch():
    batch = TensorDict({"x": torch.zeros(4)}, batch_size=[4])
    shards, _ = split_for_dp(batch, 2)
    shards[0]["x"].add_(1.0)
    assert batch["x"].tolist() == [0.0] * 4


def _tensor_leaves(td):
    return dict(td.items(include_nested=True, leaves_only=True))


@FEW
@given(td_batches(max_batch=13), st.integers(1, 6))
def test_views_equal_copies_share_storage_and_round_trip(batch, dp):
    """``copy=False``: same rows and PadInfo as the clones, but each shard is a row slice of one storage."""
    size = batch.batch_size[0]
    copies, info = split_for_dp(batch, dp, pad="repeat")
    views, view_info = split_for_dp(batch, dp, pad="repeat", copy=False)
    assert view_info == info
    rows = _padded_rows(size, dp)
    for r, (view, shard) in enumerate(zip(views, copies, strict=True)):
        assert_batch_rows(view, batch, rows[r * info.shard_size : (r + 1) * info.shard_size])
        assert_batch_rows(view, shard, list(range(info.shard_size)))
    # without padding the views are slices of the batch itself; with padding, of one padded copy of it
    parents = _tensor_leaves(batch) if info.pad_size == 0 else _tensor_leaves(views[0])
    for r, view in enumerate(views):
        for key, leaf in _tensor_leaves(view).items():
            parent = parents[key]
            assert leaf.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr(), key
            if leaf.numel():
                offset = leaf.storage_offset() - parent.storage_offset()
                assert offset == r * info.shard_size * parent.stride(0), key
    assert_batch_rows(merge_from_dp(views, view_info), batch, list(range(size)))


def test_views_write_through_and_pickle_the_parent_storage():
    """What the ``copy=False`` caveat warns about: in-place writes reach the batch, pickles drag its storage."""
    batch = TensorDict({"x": torch.zeros(4096)}, batch_size=[4096])
    views, _ = split_for_dp(batch, 4, copy=False)
    copies, _ = split_for_dp(batch, 4)
    views[1]["x"][0] = 7.0
    assert batch["x"][1024].item() == 7.0
    assert len(pickle.dumps(views[2])) > 3 * len(pickle.dumps(copies[2]))  # whole 16 KB parent, not 4 KB
    compacted = views[2].clone()
    assert len(pickle.dumps(compacted)) < 1.2 * len(pickle.dumps(copies[2]))


def test_merge_of_views_does_not_alias_the_parts():
    batch = TensorDict({"x": torch.arange(6.0)}, batch_size=[6])
    views, info = split_for_dp(batch, 4, pad="repeat", copy=False)
    merged = merge_from_dp(views, info)
    merged["x"].add_(100.0)
    assert batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(v["x"].max().item() < 100.0 for v in views)


def test_merge_keeps_fields_added_by_workers_and_uses_rank_order():
    batch = TensorDict({"x": torch.arange(5.0)}, batch_size=[5])
    shards, info = split_for_dp(batch, 2, pad="repeat")
    outputs = []
    for shard in shards:
        out = shard.clone()
        out["y"] = shard["x"] * 10
        outputs.append(out)
    merged = merge_from_dp(outputs, info)
    assert merged["y"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    with pytest.raises(ValueError, match="parts must be a sequence of dp_size=2"):
        merge_from_dp(outputs[:1], info)
    with pytest.raises(ValueError, match=r"parts\[1\] has 2 rows but every shard had shard_size=3"):
        merge_from_dp([outputs[0], outputs[1][:2]], info)


def test_per_rank_metrics_keep_every_rank_and_weight_by_valid_rows():
    """5 rows on 4 ranks; no rank's entry is dropped, padding rows never count."""
    batch = TensorDict({"x": torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])}, batch_size=[5])
    shards, info = split_for_dp(batch, 4, pad="repeat")
    assert info.valid_counts == [2, 2, 1, 0]
    per_rank = [
        {"x/mean": float(s["x"][: info.valid_rows(r)].mean()) if info.valid_rows(r) else 0.0}
        for r, s in enumerate(shards)
    ]
    assert len(per_rank) == 4
    reduced = reduce_metrics(per_rank, weights=info.valid_counts)
    assert reduced["x/mean"] == pytest.approx(batch["x"].mean().item())


def test_argument_errors():
    batch = TensorDict({"x": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        split_for_dp(batch, 0)
    with pytest.raises(ValueError, match="unknown pad 'last'; valid values: error, repeat"):
        split_for_dp(batch, 2, pad="last")
    with pytest.raises(TypeError, match="pad_info must be a PadInfo"):
        merge_from_dp([batch], {"dp_size": 1})
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        split_for_dp(batch, 2)[1].valid_rows(2)
    with pytest.raises(TypeError, match="copy must be a bool"):
        split_for_dp(batch, 2, copy="no")
