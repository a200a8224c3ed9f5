"""Resident batches on Monarch processes: kept outputs, declared reads, a gloo reshard between colocated roles of
different layouts, a TCP reshard between a Monarch group and the controller's own workers, and a lost rank
that names the batch it held."""

from __future__ import annotations

import pytest
import torch
from _monarch_workers import ResidentProbe
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import ColocatedWorker, WorkerSpec, dp_row_ranges
from ppo_core_monarch import MonarchConfig, WorkerLost
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = pytest.mark.monarch

CFG = MonarchConfig(
    call_timeout_s=120.0,
    ready_timeout_s=180.0,
    shutdown_timeout_s=15.0,
    host_lost_timeout_s=3.0,
    lost_shutdown_timeout_s=2.0,
)


@pytest.fixture(scope="module")
def group():
    roles = {"dp": WorkerSpec(ResidentProbe), "tp": WorkerSpec(ResidentProbe, kwargs={"tp": 2})}
    wg = MonarchWorkerGroup(
        WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), procs_per_host=2, config=CFG
    )
    yield wg
    wg.shutdown()


def _index(n: int) -> TensorDict:
    return TensorDict({"index": torch.arange(n)}, batch_size=[n])


def test_kept_rows_are_read_by_declared_keys_and_resharded_by_gloo(group) -> None:
    dp, tp = group.role("dp"), group.role("tp")
    ref, cols = dp.dispatch_resident("make", _index(7), columns=("weight",), step=1)
    assert ref.placement.row_ranges == dp_row_ranges(7, 2)
    assert torch.equal(cols["weight"], torch.arange(7).double() / 3)
    read = dp.read_index(ref)
    assert read["index"].tolist() == list(range(7)) and set(read["n_keys"].tolist()) == {1}
    assert read["rank"].tolist() == [0] * 4 + [1] * 3
    group.traffic.take()
    moved = tp.reshard(ref, source=dp)  # same processes, both ranks run: torch.distributed point-to-point
    assert group.traffic.take()["total"] < 64 * 1024
    assert moved.placement.layout.dp_ranks == (0, 0) and moved.placement.row_ranges == ((0, 7),)
    got = tp.fetch_resident(moved, ("tokens", "index"))
    assert torch.equal(got["tokens"], dp.fetch_resident(ref, ("tokens",))["tokens"])
    assert group.call_all("dp.resident_ids") == [(ref.id, moved.id)] * 2
    group.role("dp").end_resident_step(1)
    assert group.call_all("dp.resident_ids") == [(), ()]


def test_rows_move_by_tcp_between_monarch_processes_and_the_controllers_workers(group) -> None:
    dp = group.role("dp")
    ref, _ = dp.dispatch_resident("make", _index(9), step=2)
    with LocalWorkerGroup(ResidentProbe, world_size=3) as local:
        here = local.reshard(ref, source=dp)
        assert here.placement.group == local.resident_group_id and here.placement.row_ranges == (
            (0, 3),
            (3, 6),
            (6, 9),
        )
        whole = dp.fetch_resident(ref, ref.key_names)
        got = local.fetch_resident(here, here.key_names)
        assert all(torch.equal(got[k], whole[k]) for k in ref.key_names)
        back = dp.reshard(here, source=local, keys=("tokens",))
        assert torch.equal(dp.fetch_resident(back, ("tokens",))["tokens"], whole["tokens"])
    dp.end_resident_step(2)


def test_a_lost_rank_names_the_resident_batch_it_held(group) -> None:
    """Last in the module: it breaks the shared group (the fixture shuts it down)."""
    dp = group.role("dp")
    ref, _ = dp.dispatch_resident("make", _index(5))
    with pytest.raises(WorkerLost) as info:
        dp.call_all("exit_on", 1, 0.0)
    assert ref.id in info.value.batches and f"{ref.id} (rows 3:5 of 5, on rank 1)" in str(info.value)
