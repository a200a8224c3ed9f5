"""Resident batches on the local backend: the store, handles, keeping outputs, reading declared keys, lifetime."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.batch import split_for_dp
from ppo_core.workers import (
    BatchRef,
    ColocatedWorker,
    Dispatch,
    ResidentBatchMissingError,
    ResidentStore,
    Worker,
    WorkerLostError,
    WorkerSpec,
    dp_row_ranges,
    register,
)


class Gen(Worker):
    """Makes rows from prompt indices and reads some of them back; ``tp`` > 1 declares DP x TP replicas."""

    def __init__(self, tp: int = 1, width: int = 6) -> None:
        super().__init__()
        self.width = width
        self.seen_keys: list[tuple[str, ...]] = []
        if tp > 1:
            self.set_dp_layout(self.rank // tp, self.world_size // tp, is_collect_rank=self.rank % tp == 0)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate(self, batch: TensorDict) -> TensorDict:
        idx = batch["index"]
        n = idx.shape[0]
        responses = idx[:, None] * 100 + torch.arange(self.width)[None, :]
        return TensorDict(
            {
                "index": idx,
                "responses": responses,
                "response_mask": torch.ones(n, self.width, dtype=torch.bool),
                "length": torch.full((n,), self.width) - (idx % 3),
                "prompts": torch.randn(n, 40, generator=torch.Generator().manual_seed(7)),
            },
            batch_size=[n],
        )

    @register(dispatch=Dispatch.DP_COMPUTE, reads=("responses", "response_mask"), may_read=("extra",))
    def log_prob(self, batch: TensorDict) -> TensorDict:
        self.seen_keys.append(tuple(sorted(batch.keys())))
        lp = (batch["responses"].double() * 0.01).where(batch["response_mask"], 0.0)
        return TensorDict({"old_log_probs": lp}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, reads=("old_log_probs", "advantages"))
    def update(self, batch: TensorDict) -> dict:
        self.seen_keys.append(tuple(sorted(batch.keys())))
        return {"loss": float((batch["old_log_probs"].sum(-1) * batch["advantages"]).sum())}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def nothing_off_rank_zero(self, batch: TensorDict) -> TensorDict | None:
        return batch if self.rank == 0 else None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def keys_seen(self) -> list:
        return self.seen_keys


def _prompts(n: int) -> TensorDict:
    return TensorDict({"index": torch.arange(n)}, batch_size=[n])


# ----- pure pieces -----------------------------------------------------------------------------------------
@given(rows=st.integers(0, 60), dp=st.integers(1, 9))
def test_dp_row_ranges_are_the_real_rows_split_for_dp_gives_each_rank(rows: int, dp: int) -> None:
    _, info = split_for_dp(_prompts(rows), dp, pad="repeat")
    ranges = dp_row_ranges(rows, dp)
    assert [hi - lo for lo, hi in ranges] == info.valid_counts
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_dp_row_ranges_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="rows must be >= 0"):
        dp_row_ranges(-1, 2)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        dp_row_ranges(3, 0)


def test_store_put_get_update_drop_and_end_step() -> None:
    store = ResidentStore()
    x = torch.arange(12).reshape(3, 4)
    store.put("a", TensorDict({"x": x}, batch_size=[3]), step=1)
    store.put("b", TensorDict({"y": torch.zeros(2)}, batch_size=[2]), step=2)
    assert store.get("a", ("x",))["x"].data_ptr() == x.data_ptr()  # no copy
    store.update("a", TensorDict({"z": torch.ones(3)}, batch_size=[3]))
    assert sorted(store.get("a").keys()) == ["x", "z"]
    assert list(store.get("a", ("x",), optional=("z", "nope")).keys()) == ["x", "z"]
    with pytest.raises(ResidentBatchMissingError, match=r"no key\(s\) \['w'\]"):
        store.get("a", ("w",))
    with pytest.raises(ValueError, match="already held"):
        store.put("a", TensorDict({"x": x}, batch_size=[3]), step=1)
    with pytest.raises(ValueError, match="holds 3 rows"):
        store.update("a", TensorDict({"z": torch.ones(2)}, batch_size=[2]))
    with pytest.raises(TypeError, match="tensors only"):
        store.put("c", TensorDict({"n": TensorDict({"q": torch.ones(1)}, [1])}, batch_size=[1]), step=0)
    assert store.nbytes() == x.nbytes + 3 * 4 + 2 * 4
    assert store.end_step(1) == ("a",) and store.ids() == ("b",)
    with pytest.raises(ResidentBatchMissingError, match="holds no resident batch a"):
        store.get("a")
    assert store.drop("b") and not store.drop("b")


def test_colocated_roles_share_one_store_per_rank() -> None:
    cw = ColocatedWorker({"actor": WorkerSpec(Gen), "ref": WorkerSpec(Gen)})
    assert cw.roles["actor"].resident_store is cw.roles["ref"].resident_store is cw.resident_store
    assert Gen().resident_store is not cw.resident_store


# ----- through a group ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("world", "rows"), [(1, 5), (2, 6), (3, 7), (4, 2)])
def test_kept_output_reads_back_exactly_as_the_by_value_path(world: int, rows: int) -> None:
    with LocalWorkerGroup(Gen, world_size=world) as wg:
        by_value = wg.generate(_prompts(rows))
        lp_by_value = wg.log_prob(by_value)
        ref, cols = wg.dispatch_resident("generate", _prompts(rows), columns=("length",), step=3)
        assert isinstance(ref, BatchRef) and ref.rows == rows and ref.step == 3
        assert ref.placement.row_ranges == dp_row_ranges(rows, world)
        assert ref.key_names == ("index", "responses", "response_mask", "length", "prompts")
        assert ref.spec("responses").shape == (6,) and ref.spec("responses").dtype == torch.int64
        assert torch.equal(cols["length"], by_value["length"]) and list(cols.keys()) == ["length"]
        assert len(pickle.dumps(ref)) < 2048
        lp = wg.log_prob(ref)  # the handle in, only the declared keys materialised on each rank
        assert torch.equal(lp["old_log_probs"], lp_by_value["old_log_probs"])
        seen = wg.keys_seen()
        assert all(s[-1] == ("response_mask", "responses") for s in seen)
        fetched = wg.fetch_resident(ref, ("responses", "index"))
        assert torch.equal(fetched["responses"], by_value["responses"]) and sorted(fetched.keys()) == [
            "index",
            "responses",
        ]


def test_outputs_added_in_place_and_controller_columns_scattered() -> None:
    rows = 7
    with LocalWorkerGroup(Gen, world_size=3) as wg:
        ref, _ = wg.dispatch_resident("generate", _prompts(rows), step=1)
        ref, _ = wg.dispatch_resident("log_prob", ref, into=ref)
        assert "old_log_probs" in ref.key_names
        adv = TensorDict({"advantages": torch.arange(rows, dtype=torch.float64)}, batch_size=[rows])
        ref = wg.scatter_resident(ref, adv)
        assert torch.equal(wg.fetch_resident(ref, ("advantages",))["advantages"], adv["advantages"])
        metrics = wg.update(ref)
        by_value = wg.generate(_prompts(rows))
        by_value.update(wg.log_prob(by_value))
        by_value.update(adv)
        full = float((by_value["old_log_probs"].sum(-1) * by_value["advantages"]).sum())
        # each rank's loss is a partial sum; the metric mean over 3 ranks times 3 is the whole sum
        assert metrics["loss"] * 3 == pytest.approx(full)
        assert wg.keys_seen()[0][1] == ("advantages", "old_log_probs")  # update read its two keys only
        # a TensorDict argument beside a handle is cut by the handle's row ranges, so it must match its rows
        with pytest.raises(ValueError, match="has 7 rows"):
            wg.update(ref, TensorDict({"x": torch.ones(3)}, batch_size=[3]))


def test_end_of_step_drops_and_a_dropped_batch_is_named() -> None:
    with LocalWorkerGroup(Gen, world_size=2) as wg:
        a, _ = wg.dispatch_resident("generate", _prompts(4), step=1)
        b, _ = wg.dispatch_resident("generate", _prompts(4), step=2)
        assert {r.id for r in wg.resident_refs()} == {a.id, b.id}
        wg.end_resident_step(1)
        assert wg.call_all("resident_ids") == [(b.id,), (b.id,)]
        assert [r.id for r in wg.resident_refs()] == [b.id]
        with pytest.raises(Exception, match=f"holds no resident batch {a.id}"):
            wg.log_prob(a)
        wg.drop_resident(b)
        assert wg.call_all("resident_ids") == [(), ()] and wg.resident_refs() == ()


def test_a_handle_from_another_group_or_layout_is_refused() -> None:
    with LocalWorkerGroup(Gen, world_size=2) as one, LocalWorkerGroup(Gen, world_size=2) as two:
        ref, _ = one.dispatch_resident("generate", _prompts(4))
        with pytest.raises(ValueError, match="reshard it first"):
            two.log_prob(ref)
    with LocalWorkerGroup(WorkerSpec(Gen, kwargs={"tp": 2}), world_size=4) as tp:
        ref, _ = tp.dispatch_resident("generate", _prompts(5))
        assert ref.placement.layout.dp_ranks == (0, 0, 1, 1) and ref.placement.row_ranges == ((0, 3), (3, 5))
        assert tp.call_all("resident_ids") == [(ref.id,)] * 4  # TP replicas keep their shard too
        assert torch.equal(tp.fetch_resident(ref, ("index",))["index"], torch.arange(5))
        moved = BatchRef(
            id=ref.id,
            rows=ref.rows,
            keys=ref.keys,
            placement=type(ref.placement)(
                group=ref.placement.group,
                layout=type(ref.placement.layout).trivial(4),
                row_ranges=dp_row_ranges(5, 4),
            ),
        )
        with pytest.raises(ValueError, match="laid out for dp ranks"):
            tp.log_prob(moved)


def test_colocated_roles_read_each_others_resident_batches() -> None:
    spec = WorkerSpec(ColocatedWorker, kwargs={"roles": {"actor": WorkerSpec(Gen), "ref": WorkerSpec(Gen)}})
    with LocalWorkerGroup(spec, world_size=2) as wg:
        actor, ref_role = wg.role("actor"), wg.role("ref")
        batch, _ = actor.dispatch_resident("generate", _prompts(5))
        batch, _ = ref_role.dispatch_resident("log_prob", batch, into=batch)
        assert "old_log_probs" in batch.key_names
        assert actor.traffic is wg.traffic and ref_role.resident_group_id == wg.resident_group_id
        assert [r.id for r in wg.resident_refs()] == [batch.id]


def test_a_method_that_does_not_return_rows_cannot_be_kept() -> None:
    with LocalWorkerGroup(Gen, world_size=2) as wg:
        with pytest.raises(ValueError, match="need 'dp_compute'"):
            wg.dispatch_resident("update", _prompts(4))
        ref, _ = wg.dispatch_resident("generate", _prompts(4))
        with pytest.raises(ValueError, match=r"into=.* must be a resident batch of this group"):
            wg.dispatch_resident("generate", _prompts(6), into=ref)
        with pytest.raises(Exception, match="returned None on this rank"):
            wg.dispatch_resident("nothing_off_rank_zero", _prompts(4))


def test_a_lost_rank_names_the_resident_batch_it_held() -> None:
    with LocalWorkerGroup(Gen, world_size=2) as wg:
        ref, _ = wg.dispatch_resident("generate", _prompts(5), step=1)
        lost = WorkerLostError(ranks=(1,), method="log_prob", report="process 1 exited")
        named = wg._name_lost_batches(lost)
        assert named.batches == (ref.id,) and isinstance(named, WorkerLostError)
        assert f"held resident batch(es) {ref.id} (rows 3:5 of 5, on rank 1)" in str(named)
        assert pickle.loads(pickle.dumps(named)).report == named.report


def test_controller_bytes_are_counted_per_call_and_direction() -> None:
    rows = 64
    with LocalWorkerGroup(WorkerSpec(Gen, kwargs={"width": 256}), world_size=2) as wg:
        wg.traffic.take()
        batch = wg.generate(_prompts(rows))
        lp = wg.log_prob(batch)
        by_value = wg.traffic.take()
        batch_bytes = sum(t.nbytes for t in batch.values())
        assert by_value["received"] >= batch_bytes + lp["old_log_probs"].nbytes
        assert by_value["sent"] >= batch_bytes  # the whole batch went out again for two keys
        ref, _ = wg.dispatch_resident("generate", _prompts(rows), columns=("length",))
        ref, _ = wg.dispatch_resident("log_prob", ref, into=ref)
        by_ref = wg.traffic.take()
        assert by_ref["total"] < by_value["total"] / 50
        calls = wg.traffic.calls()
        assert calls == ()
        wg.log_prob(ref)
        assert [c.method for c in wg.traffic.calls()] == ["log_prob", "log_prob"]
