"""Two simulated hosts x 2 processes: worker loops on 127.0.0.1 ports, attached, pickled (not shared-memory) path;
last, a host whose worker loop is SIGKILLed surfaces as ``WorkerLost`` within a bound (the fault of
``test_faults.py`` that needs hosts)."""

from __future__ import annotations

import time

import pytest
import torch
from _monarch_workers import ProbeWorker
from _procs import pids_alive, remember_pids
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core_monarch import GroupBroken, MonarchConfig, WorkerLost, attach_hosts, start_worker_loops
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = pytest.mark.monarch

HOSTS, PER_HOST = 2, 2
HOST_BOUND_S = 15.0  # supervision poll 1 s, host_lost_timeout_s 3 s, with slack for a loaded 2-core machine
CFG = MonarchConfig(
    shared_memory=False,
    call_timeout_s=120.0,
    ready_timeout_s=180.0,
    shutdown_timeout_s=15.0,
    host_lost_timeout_s=3.0,
    lost_shutdown_timeout_s=2.0,
)


class _Hosts:
    """Worker loops and a group on them, started on first use and shared by the module's tests; once a test has
    broken the group (a killed host) the next gets new ones."""

    def __init__(self) -> None:
        self.loops = None
        self.group: MonarchWorkerGroup | None = None

    def get(self) -> MonarchWorkerGroup:
        if self.group is None or self.group.broken is not None:
            self.stop()
            self.loops = start_worker_loops(HOSTS)
            remember_pids(self.loops.pids)
            self.group = MonarchWorkerGroup(
                ProbeWorker, procs_per_host=PER_HOST, hosts=attach_hosts(self.loops.addresses), config=CFG
            )
        return self.group

    def stop(self) -> None:
        try:
            if self.group is not None:
                self.group.shutdown()
        finally:
            if self.loops is not None:
                self.loops.stop()
            self.group = self.loops = None


@pytest.fixture(scope="module")
def hosts():
    started = _Hosts()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def group(hosts):
    return hosts.get()


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


def test_resident_rows_move_between_hosts_and_the_controllers_workers(group):
    """A kept output stays on the 4 ranks of the 2 hosts; a dp = 4 -> dp = 2 reshard into the controller's own
    workers and back (TCP across processes) moves the rows with only plans and handles through the controller."""
    n = 4096
    batch = TensorDict({"x": torch.arange(n * 64).reshape(n, 64)}, batch_size=[n])
    ref, cols = group.dispatch_resident("score", batch, columns=("rank",), step=5)
    assert cols["rank"].tolist() == [r for r in range(4) for _ in range(n // 4)]
    with LocalWorkerGroup(ProbeWorker, world_size=2) as local:
        group.traffic.take()
        here = local.reshard(ref, source=group)
        back = group.reshard(here, source=local, keys=("score",))
        through = group.traffic.take()["total"] + local.traffic.take()["total"]
        assert through < 64 * 1024 < ref.nbytes()
        assert torch.equal(local.fetch_resident(here, ("score",))["score"], batch["x"].double() * 2)
        assert torch.equal(group.fetch_resident(back, ("score",))["score"], batch["x"].double() * 2)
    group.end_resident_step(5)
    assert group.call_all("resident_ids") == [()] * group.world_size


def test_killed_host_becomes_worker_lost(hosts):
    # last in the module: it breaks the shared group
    wg = hosts.get()
    lost = {r for r in range(wg.world_size) if wg.topology.host_of(r) == 1}
    call = wg.call_all_async("sleep", 30.0)
    time.sleep(0.5)
    start = time.monotonic()
    hosts.loops.kill(1)
    with pytest.raises(WorkerLost) as info:
        call.result()
    elapsed = time.monotonic() - start
    assert elapsed < HOST_BOUND_S, f"host loss detected after {elapsed:.2f} s"
    assert lost & set(info.value.ranks)
    with pytest.raises(GroupBroken):
        wg.call_all("where")
    loop_pids = hosts.loops.pids
    hosts.stop()
    assert pids_alive(loop_pids) == []
