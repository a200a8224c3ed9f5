"""Dispatch modes as pure functions: no backend, just plans and collects against loop oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ppo_core.workers import (
    Dispatch,
    DispatchPlan,
    DPLayout,
    Execute,
    RankCall,
    WorkerLayout,
    resolve_dispatch,
)


@st.composite
def layouts(draw, max_dp: int = 4, max_tp: int = 3) -> DPLayout:
    """DP x TP layouts with ranks of one dp group contiguous or strided, and any collect rank per group."""
    dp, tp = draw(st.integers(1, max_dp)), draw(st.integers(1, max_tp))
    strided = draw(st.booleans())
    dp_ranks = [(r % dp) if strided else (r // tp) for r in range(dp * tp)]
    chosen = [draw(st.integers(0, tp - 1)) for _ in range(dp)]
    collect = []
    seen = [0] * dp
    for d in dp_ranks:
        collect.append(seen[d] == chosen[d])
        seen[d] += 1
    return DPLayout(dp_ranks=tuple(dp_ranks), collect=tuple(collect))


def batch_of(size: int) -> TensorDict:
    return TensorDict(
        {
            "x": torch.arange(size, dtype=torch.float32) * 1.5,
            "uid": NonTensorStack.from_list([f"u{i}" for i in range(size)]),
        },
        batch_size=[size],
    )


def run_plan(mode, layout, args, kwargs, fn):
    """What a backend does: run ``fn(rank, *args, **kwargs)`` per call, then collect."""
    plan = mode.dispatch(layout, args, kwargs)
    outputs = [fn(call.rank, *call.args, **call.kwargs) for call in plan.calls]
    return plan, mode.collect(layout, plan, outputs)


@given(layouts(), st.integers(0, 11))
def test_dp_compute_equals_the_rowwise_function_on_the_whole_batch(layout, size):
    def worker(rank, batch, scale):
        if not layout.collect[rank]:
            return TensorDict(
                {"y": torch.full((batch.batch_size[0],), float("nan"))}, batch_size=batch.batch_size
            )
        out = batch.clone()
        out.set("y", batch["x"] * scale)
        return out

    plan, merged = run_plan(Dispatch.DP_COMPUTE, layout, (batch_of(size),), {"scale": 2.0}, worker)
    assert [c.rank for c in plan.calls] == list(range(layout.world_size))
    assert merged.batch_size[0] == size
    torch.testing.assert_close(merged["y"], batch_of(size)["x"] * 2.0)  # no NaN: only collect ranks merged
    assert merged.get("uid").tolist() == [f"u{i}" for i in range(size)]
    # TP/PP replicas of one dp rank receive the very same shard object (a backend sends it once)
    for d in range(layout.dp_size):
        shards = {id(plan.calls[r].args[0]) for r in layout.ranks_of(d)}
        assert len(shards) == 1


@given(st.integers(1, 5), st.integers(1, 9))
def test_dp_compute_shards_are_contiguous_in_dp_order(dp, size):
    layout = DPLayout.trivial(dp)
    plan = Dispatch.DP_COMPUTE.dispatch(layout, (batch_of(size),), {})
    seen = [x for call in plan.calls for x in call.args[0]["x"].tolist()]
    real = seen[:size]
    assert real == batch_of(size)["x"].tolist()
    assert (
        len({call.args[0].batch_size[0] for call in plan.calls}) == 1
    )  # equal shards (padding repeats rows)


@given(layouts(), st.integers(0, 11), st.sampled_from(["dp_compute", "dp_compute_metric"]))
def test_dp_modes_with_copy_false_plan_views_of_the_same_rows(layout, size, name):
    """``copy=False`` (backends that compact payloads): the same plan, each shard a row slice of the batch."""
    mode = (
        Dispatch.dp_compute(pad="repeat")
        if name == "dp_compute"
        else Dispatch.dp_compute_metric(pad="repeat")
    )
    assert mode.accepts_copy
    batch = batch_of(size)
    copies = mode.dispatch(layout, (batch,), {"scale": 2.0})
    views = mode.dispatch(layout, (batch,), {"scale": 2.0}, copy=False)
    assert views.context == copies.context
    padded = size % layout.dp_size != 0
    for c, v in zip(copies.calls, views.calls, strict=True):
        assert (v.rank, v.kwargs) == (c.rank, c.kwargs)
        assert v.args[0]["x"].tolist() == c.args[0]["x"].tolist()
        assert v.args[0].get("uid").tolist() == c.args[0].get("uid").tolist()
        shares = v.args[0]["x"].untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()
        assert shares == (not padded)  # a padded batch is sliced from its one padded copy instead
        if size:  # empty tensors have no storage to compare
            assert c.args[0]["x"].untyped_storage().data_ptr() != batch["x"].untyped_storage().data_ptr()
    for d in range(layout.dp_size):  # TP/PP peers still share one shard object
        assert len({id(views.calls[r].args[0]) for r in layout.ranks_of(d)}) == 1


def test_copy_is_ignored_by_modes_that_do_not_split():
    layout = DPLayout.trivial(2)
    x = torch.arange(4)
    for mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        assert not mode.accepts_copy
        assert all(c.args[0] is x for c in mode.dispatch(layout, (x,), {}, copy=False).calls)
    custom = Dispatch.custom(lambda lay, a, k: DispatchPlan([RankCall(0, a, k)]), lambda lay, p, o: o)
    assert custom.dispatch(layout, (x,), {}, copy=False).calls[0].args[0] is x


@given(st.integers(1, 6), st.integers(1, 13))
def test_dp_compute_metric_keeps_every_dp_rank(dp, size):
    """In verl, padding trimmed whole rank entries from the metric list; here every dp rank counts."""
    layout = DPLayout(
        dp_ranks=tuple(r // 2 for r in range(2 * dp)), collect=tuple(r % 2 == 1 for r in range(2 * dp))
    )
    mode = Dispatch.dp_compute_metric(pad="repeat")

    def worker(rank, batch):
        return {
            "rank/max": float(layout.dp_ranks[rank]),
            "rank/min": float(layout.dp_ranks[rank]),
            "ones": 1.0,
        }

    _, metrics = run_plan(mode, layout, (batch_of(size),), {}, worker)
    assert metrics == {"rank/max": float(dp - 1), "rank/min": 0.0, "ones": 1.0}


def test_dp_compute_metric_refuses_to_pad_training_data_by_default():
    with pytest.raises(ValueError):
        Dispatch.DP_COMPUTE_METRIC.dispatch(DPLayout.trivial(4), (batch_of(5),), {})


def test_dp_compute_metric_rejects_non_dict_outputs_naming_the_rank():
    layout = DPLayout.trivial(2)
    plan = Dispatch.DP_COMPUTE_METRIC.dispatch(layout, (batch_of(4),), {})
    with pytest.raises(TypeError, match="dp rank 1"):
        Dispatch.DP_COMPUTE_METRIC.collect(layout, plan, [{}, 3.0])


def test_dp_compute_metric_custom_reducer():
    layout = DPLayout.trivial(3)
    mode = Dispatch.dp_compute_metric(reduce=lambda parts: {"n": float(len(parts))})
    _, out = run_plan(mode, layout, (batch_of(3),), {}, lambda rank, b: {"a": 1.0})
    assert out == {"n": 3.0}


def test_dp_compute_needs_a_tensordict_and_equal_batch_sizes():
    layout = DPLayout.trivial(2)
    with pytest.raises(ValueError, match="TensorDict"):
        Dispatch.DP_COMPUTE.dispatch(layout, (1, 2), {})
    with pytest.raises(ValueError, match="share one"):
        Dispatch.DP_COMPUTE.dispatch(layout, (batch_of(2),), {"other": batch_of(4)})


def test_dp_compute_non_tensordict_outputs_come_back_in_dp_order():
    layout = DPLayout(dp_ranks=(1, 1, 0, 0), collect=(False, True, True, False))
    _, out = run_plan(Dispatch.DP_COMPUTE, layout, (batch_of(4),), {}, lambda rank, b: rank)
    assert out == [2, 1]
    _, none = run_plan(Dispatch.DP_COMPUTE, layout, (batch_of(4),), {}, lambda rank, b: None)
    assert none is None


def test_dp_modes_need_their_collect_ranks():
    layout = DPLayout.trivial(2)
    plan = Dispatch.DP_COMPUTE.dispatch(layout, (batch_of(2),), {})
    rank0_only = DispatchPlan([c for c in plan.calls if c.rank == 0], plan.context)
    with pytest.raises(ValueError, match=r"collect ranks \[1\]"):
        Dispatch.DP_COMPUTE.collect(layout, rank0_only, [batch_of(1)])


@given(st.integers(1, 6), st.integers(-3, 3))
def test_one_to_all_replicates_and_lists_in_rank_order(world, value):
    layout = DPLayout.trivial(world)
    plan, out = run_plan(Dispatch.ONE_TO_ALL, layout, (value,), {"k": "v"}, lambda rank, x, k: (rank, x, k))
    assert plan.uniform
    assert out == [(r, value, "v") for r in range(world)]


@given(st.integers(1, 6))
def test_all_to_all_gives_element_i_to_rank_i(world):
    layout = DPLayout.trivial(world)
    xs, ys = list(range(world)), [10 * i for i in range(world)]
    _, out = run_plan(Dispatch.ALL_TO_ALL, layout, (xs,), {"y": ys}, lambda rank, x, y: (rank, x + y))
    assert out == [(r, 11 * r) for r in range(world)]


def test_all_to_all_names_the_bad_argument():
    with pytest.raises(ValueError, match="argument 'y'"):
        Dispatch.ALL_TO_ALL.dispatch(DPLayout.trivial(3), ([1, 2, 3],), {"y": [1]})


def test_rank_zero_runs_once():
    plan, out = run_plan(Dispatch.RANK_ZERO, DPLayout.trivial(4), ("a",), {}, lambda rank, x: (rank, x))
    assert [c.rank for c in plan.calls] == [0]
    assert out == (0, "a")


def test_custom_pair_and_names():
    def dispatch_fn(layout, args, kwargs):
        return DispatchPlan([RankCall(r, (r * args[0],), {}) for r in range(layout.world_size) if r % 2 == 0])

    def collect_fn(layout, plan, outputs):
        return sum(outputs)

    mode = resolve_dispatch((dispatch_fn, collect_fn))
    _, out = run_plan(mode, DPLayout.trivial(5), (3,), {}, lambda rank, x: x)
    assert out == 0 + 6 + 12
    assert resolve_dispatch("DP_COMPUTE") is Dispatch.DP_COMPUTE
    with pytest.raises(ValueError, match="valid values: all_to_all, dp_compute"):
        resolve_dispatch("dp")
    with pytest.raises(TypeError):
        resolve_dispatch(3)
    with pytest.raises(ValueError, match="valid values: error, repeat"):
        Dispatch.dp_compute(pad="zeros")
    assert Execute("rank_zero") is Execute.RANK_ZERO


def test_layout_validation():
    with pytest.raises(ValueError, match="exactly one collect rank"):
        DPLayout(dp_ranks=(0, 0), collect=(True, True))
    with pytest.raises(ValueError, match="without gaps"):
        DPLayout(dp_ranks=(0, 2), collect=(True, True))
    with pytest.raises(ValueError, match="must match"):
        DPLayout(dp_ranks=(0,), collect=(True, False))
    layout = DPLayout.from_workers(
        [
            WorkerLayout(rank=r, world_size=4, dp_rank=r // 2, dp_size=2, is_collect_rank=r % 2 == 0)
            for r in (3, 1, 0, 2)
        ]
    )
    assert layout.dp_ranks == (0, 0, 1, 1) and layout.collect_ranks() == (0, 2)
    with pytest.raises(ValueError, match="disagree"):
        DPLayout.from_workers([WorkerLayout(0, 2, 0, 1, True), WorkerLayout(1, 2, 0, 2, False)])
    with pytest.raises(ValueError, match=r"expected 0\.\.1"):
        DPLayout.from_workers([WorkerLayout(0, 2, 0, 2, True), WorkerLayout(2, 2, 1, 2, True)])


@given(layouts())
def test_layout_ranks_partition_the_world(layout):
    groups = [layout.ranks_of(d) for d in range(layout.dp_size)]
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    assert all(layout.collect_ranks()[d] in groups[d] for d in range(layout.dp_size))
