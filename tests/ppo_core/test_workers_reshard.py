"""plan_reshard (property-tested against a row-by-row simulation) and its TCP executor on the local backend."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import ColocatedWorker, Dispatch, DPLayout, Worker, WorkerSpec, register
from ppo_core.workers.reshard import plan_reshard
from ppo_core.workers.reshard_exec import allocate, pack, unpack_into
from ppo_core.workers.resident import KeySpec, Placement, dp_row_ranges


@st.composite
def layouts(draw) -> DPLayout:
    """A DP x replica layout: ``dp`` shards, each held by ``tp`` consecutive ranks, one of them collected."""
    dp, tp = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    collect = [draw(st.integers(0, tp - 1)) for _ in range(dp)]
    return DPLayout(
        dp_ranks=tuple(r // tp for r in range(dp * tp)),
        collect=tuple(r % tp == collect[r // tp] for r in range(dp * tp)),
    )


@given(src=layouts(), dst=layouts(), rows=st.integers(0, 50), same=st.booleans())
def test_every_row_reaches_every_consumer_rank_once_in_dp_order(src, dst, rows, same) -> None:
    if same and src.world_size != dst.world_size:
        same = False  # one set of processes has one world size
    placement = Placement(group="a", layout=src, row_ranges=dp_row_ranges(rows, src.dp_size))
    plan = plan_reshard(placement, dst, group=None if same else "b")
    assert plan.same_group == same and plan.target.rows == rows
    assert plan.target.row_ranges == dp_row_ranges(rows, dst.dp_size)
    # simulate: producer rank r holds the global row ids of its dp rank's range
    held = {r: list(range(*placement.rows_of_rank(r))) for r in range(src.world_size)}
    for r in range(dst.world_size):
        lo, hi = plan.target.rows_of_rank(r)
        got: list[int | None] = [None] * (hi - lo)
        offsets = []
        for t in plan.receives_of(r):
            assert t.rows > 0
            shard = held[t.src_rank]
            assert t.src_start >= 0 and t.src_start + t.rows <= len(shard)
            for i in range(t.rows):
                assert got[t.dst_start + i] is None  # never delivered twice
                got[t.dst_start + i] = shard[t.src_start + i]
            offsets.append(t.dst_start)
        assert got == list(range(lo, hi))  # every row once, in order
        assert offsets == sorted(offsets)
        if same:  # a rank that holds rows itself copies them locally
            for t in plan.receives_of(r):
                if r in src.ranks_of(src.dp_ranks[t.src_rank]):
                    assert t.src_rank == r
    dst_ranks = [t.dst_rank for t in plan.transfers]
    assert dst_ranks == sorted(dst_ranks)


def test_replicas_share_the_sending() -> None:
    src = DPLayout(dp_ranks=(0, 0), collect=(True, False))  # one dp rank held by 2 replicas
    placement = Placement(group="a", layout=src, row_ranges=((0, 4),))
    plan = plan_reshard(placement, DPLayout(dp_ranks=(0, 0), collect=(True, False)), group="b")
    assert [t.src_rank for t in plan.transfers] == [0, 1]
    assert len(pickle.dumps(plan)) < 4096


def test_plan_reshard_rejects_other_arguments() -> None:
    with pytest.raises(TypeError, match="placement must be a Placement"):
        plan_reshard("g", DPLayout.trivial(1))
    placement = Placement(group="a", layout=DPLayout.trivial(1), row_ranges=((0, 1),))
    with pytest.raises(TypeError, match="layout must be a DPLayout"):
        plan_reshard(placement, 2)
    with pytest.raises(ValueError, match="contiguous in dp order"):
        Placement(group="a", layout=DPLayout.trivial(2), row_ranges=((0, 1), (2, 3)))


@given(rows=st.integers(0, 6), start=st.integers(0, 3), n=st.integers(0, 3))
def test_pack_then_unpack_moves_exactly_the_rows(rows, start, n) -> None:
    n = max(0, min(n, rows - start))
    start = min(start, rows)
    g = torch.Generator().manual_seed(rows * 7 + start)
    data = TensorDict(
        {
            "f": torch.randn(rows, 3, generator=g),
            "b": torch.rand(rows, 2, generator=g) > 0.5,
            "i": torch.randint(0, 9, (rows,), generator=g),
            "h": torch.randn(rows, 2, 2, generator=g).to(torch.bfloat16),
        },
        batch_size=[rows],
    )
    keys = [(k, KeySpec(dtype=v.dtype, shape=tuple(v.shape[1:]))) for k, v in data.items()]
    buf = pack(data, keys, start, n)
    assert buf.dtype == torch.uint8 and buf.numel() == sum(n * s.row_nbytes() for _, s in keys)
    out = allocate(keys, n + 1)
    unpack_into(out, keys, buf, 1, n)
    for k, _ in keys:
        assert torch.equal(out[k][1 : 1 + n], data[k][start : start + n])


# ----- executed on the local backend (TCP) ---------------------------------------------------------------------
class Holder(Worker):
    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        if tp > 1:
            self.set_dp_layout(self.rank // tp, self.world_size // tp, is_collect_rank=self.rank % tp == 0)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def make(self, batch: TensorDict) -> TensorDict:
        i = batch["index"]
        return TensorDict(
            {
                "index": i,
                "tokens": i[:, None] * 10 + torch.arange(5),
                "mask": (i[:, None] + torch.arange(3)) % 2 == 0,
            },
            batch_size=batch.batch_size,
        )

    @register(dispatch=Dispatch.DP_COMPUTE, reads=("index",))
    def where(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"rank": torch.full_like(batch["index"], self.rank)}, batch_size=batch.batch_size)


def _index(n: int) -> TensorDict:
    return TensorDict({"index": torch.arange(n)}, batch_size=[n])


@pytest.mark.parametrize(("src", "dst", "rows"), [(4, 2, 9), (2, 3, 7), (3, 1, 0), (1, 4, 5)])
def test_a_reshard_across_groups_moves_rows_worker_to_worker(src, dst, rows) -> None:
    with LocalWorkerGroup(Holder, world_size=src) as a, LocalWorkerGroup(Holder, world_size=dst) as b:
        ref, _ = a.dispatch_resident("make", _index(rows), step=2)
        whole = a.fetch_resident(ref, ref.key_names)
        a.traffic.take(), b.traffic.take()
        moved = b.reshard(ref, source=a)
        bytes_through = a.traffic.take()["total"] + b.traffic.take()["total"]
        assert moved.placement.group == b.resident_group_id and moved.step == 2 and moved.rows == rows
        assert moved.placement.row_ranges == dp_row_ranges(rows, dst) and moved.keys == ref.keys
        got = b.fetch_resident(moved, moved.key_names)
        assert all(torch.equal(got[k], whole[k]) for k in ref.key_names)
        assert bytes_through < 64 * 1024  # plans, handles and addresses only
        # the consumer's methods read their rows from the new batch
        assert torch.equal(
            b.where(moved)["rank"],
            torch.tensor(
                [r for r, (lo, hi) in enumerate(moved.placement.row_ranges) for _ in range(lo, hi)],
                dtype=torch.int64,
            ),
        )


def test_a_reshard_inside_colocated_roles_changes_the_layout() -> None:
    spec = WorkerSpec(
        ColocatedWorker,
        kwargs={"roles": {"actor": WorkerSpec(Holder), "critic": WorkerSpec(Holder, kwargs={"tp": 2})}},
    )
    with LocalWorkerGroup(spec, world_size=4) as wg:
        actor, critic = wg.role("actor"), wg.role("critic")
        ref, _ = actor.dispatch_resident("make", _index(7))
        moved = critic.reshard(ref, source=actor, keys=("index", "tokens"))
        assert moved.placement.layout.dp_ranks == (0, 0, 1, 1) and moved.key_names == ("index", "tokens")
        assert moved.placement.row_ranges == ((0, 4), (4, 7))
        got = critic.fetch_resident(moved, ("tokens",))
        assert torch.equal(got["tokens"], actor.fetch_resident(ref, ("tokens",))["tokens"])
        with pytest.raises(ValueError, match="needs ranks that run concurrently"):
            critic.reshard(ref, source=actor, executor="p2p")


def test_reshard_refuses_a_batch_the_source_does_not_hold() -> None:
    with LocalWorkerGroup(Holder, world_size=2) as a, LocalWorkerGroup(Holder, world_size=2) as b:
        ref, _ = a.dispatch_resident("make", _index(4))
        with pytest.raises(ValueError, match="not held by the source group"):
            b.reshard(ref)
        with pytest.raises(ValueError, match="executor must be"):
            b.reshard(ref, source=a, executor="rdma")
        with pytest.raises(ValueError, match="moves rows inside one group"):
            b.reshard(ref, source=a, executor="p2p")
