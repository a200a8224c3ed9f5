"""Two simulated hosts x 2 processes: worker loops on 127.0.0.1 ports, attached, pickled (not shared-memory) path."""

from __future__ import annotations

import pytest
import torch
from _monarch_workers import ProbeWorker
from _procs import remember_pids
from tensordict import TensorDict

from ppo_core_monarch import MonarchConfig, attach_hosts, start_worker_loops
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = pytest.mark.monarch

HOSTS, PER_HOST = 2, 2


@pytest.fixture(scope="module")
def group():
    loops = start_worker_loops(HOSTS)
    remember_pids(loops.pids)
    try:
        cfg = MonarchConfig(shared_memory=False, call_timeout_s=120.0, ready_timeout_s=180.0)
        wg = MonarchWorkerGroup(
            ProbeWorker, procs_per_host=PER_HOST, hosts=attach_hosts(loops.addresses), config=cfg
        )
        try:
            yield wg
        finally:
            wg.shutdown()
    finally:
        loops.stop()


def test_topology_has_a_host_dimension(group):
    topo = group.topology
    assert topo.labels[0] == "hosts" and topo.sizes == (HOSTS, PER_HOST)
    assert (topo.num_hosts, topo.local_size, topo.world_size) == (HOSTS, PER_HOST, HOSTS * PER_HOST)
    assert not any(i.shared_memory for i in group.rank_info)


def test_each_worker_reports_the_predicted_host_and_local_rank(group):
    topo = group.topology
    for rank, w in enumerate(group.where()):
        assert int(w["RANK"]) == rank
        assert int(w["LOCAL_RANK"]) == w["local_rank"] == topo.local_rank_of(rank)
        assert int(w["GROUP_RANK"]) == topo.host_of(rank)
        assert (int(w["WORLD_SIZE"]), int(w["LOCAL_WORLD_SIZE"])) == (topo.world_size, PER_HOST)
    # processes of one simulated host are children of the same worker loop
    assert group.rank_info[0].coords == (0, 0) and group.rank_info[3].coords == (1, 1)


def test_gloo_all_reduce_across_hosts(group):
    n = group.world_size
    assert group.all_reduce(2.0) == [2.0 * n * (n + 1) / 2] * n


@pytest.mark.parametrize("n", [3, 9])
def test_dp_dispatch_across_hosts(group, n):
    batch = TensorDict({"x": torch.arange(n * 2).reshape(n, 2)}, batch_size=[n])
    out = group.score(batch)
    torch.testing.assert_close(out["score"], batch["x"].double() * 2)
    assert bool((out["rank"][1:] >= out["rank"][:-1]).all())


def test_dp_shards_planned_as_views_arrive_compact(group):
    # MonarchWorkerGroup.compacts_payloads: the shards are row slices of the batch, and the pickled path must
    # clone them, or every rank would receive the whole batch's storage
    assert group.compacts_payloads
    n = 4 * group.world_size
    batch = TensorDict({"x": torch.arange(n * 1024).reshape(n, 1024)}, batch_size=[n])
    for nbytes, storage in group.shard_bytes(batch):
        assert nbytes == storage == 4 * 1024 * 8


def test_views_are_sent_compactly(group):
    # a 2-row view of a large tensor must not ship the whole storage (it would still be correct, only slow)
    base = torch.arange(1 << 20)
    out = group.echo([base[r * 2 : r * 2 + 2] for r in range(group.world_size)])
    for rank, (r, t) in enumerate(out):
        assert r == rank and t.untyped_storage().nbytes() == t.nbytes
        torch.testing.assert_close(t, base[rank * 2 : rank * 2 + 2])
