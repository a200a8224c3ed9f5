"""Every Monarch failure names where its ranks run (host and pid, not only mesh coordinates), is the backend-neutral
``ppo_core.workers`` error too, and a rank that raises while its peer waits in an all-reduce fails the call at once
and breaks the group.

The first tests drive ``GroupCall`` with stand-in futures (no processes); the last starts a real mesh. A real mesh's
timeout and lost worker name their host and pid in ``test_faults.py`` (one mesh for both that and the fault).
"""

from __future__ import annotations

import time

import pytest
from _monarch_workers import ProbeWorker

from ppo_core.workers import (
    CallTimeoutError,
    GroupBrokenError,
    RankLocation,
    WorkerCallError,
    WorkerLostError,
)
from ppo_core_monarch import (
    CallTimeout,
    GroupBroken,
    MonarchConfig,
    RemoteWorkerError,
    WorkerLost,
)
from ppo_core_monarch.calls import CallPart, GroupCall
from ppo_core_monarch.group import MonarchWorkerGroup, _ranks_in_report
from ppo_core_monarch.supervision import MeshWatch
from ppo_core_monarch.topology import MeshTopology

TOPOLOGY = MeshTopology(labels=("hosts", "procs"), sizes=(2, 2))
# far below gloo's 30-minute all-reduce timeout; the group's failure grace is 2 s
FAIL_FAST_BOUND_S = 30.0


def _where(ranks):
    return [RankLocation(r, f"node{TOPOLOGY.host_of(r)}", 4000 + r) for r in ranks]


class _Hung:
    """A Monarch future that never resolves."""

    def get(self, timeout=None):
        time.sleep(min(timeout or 0.0, 0.01))
        raise TimeoutError


class SupervisionError(Exception):
    """Stands in for Monarch's (``is_supervision_error`` also matches by name)."""


class _Dead:
    def get(self, timeout=None):
        raise SupervisionError(
            "actor mesh failed at {'hosts': 1/2, 'procs': 1/2}: process exited with code 1"
        )


def _call(futures, *, timeout_s=30.0, watch=None, broken=None):
    parts = [CallPart(f, (r,), (i,), mesh=False) for i, (r, f) in enumerate(futures)]
    return GroupCall(
        method="step",
        parts=parts,
        n_outputs=len(parts),
        timeout_s=timeout_s,
        watch=watch or MeshWatch("ppo_worker_test"),
        wait_slice_s=0.01,
        on_broken=(broken if broken is not None else []).append,
        locate=lambda report: _ranks_in_report(report, TOPOLOGY),
        where=_where,
    )


def test_call_timeout_names_host_and_pid_of_every_pending_rank():
    broken = []
    with pytest.raises(CallTimeout) as info:
        _call([(1, _Hung()), (2, _Hung())], timeout_s=0.05, broken=broken).result()
    err = info.value
    assert err.pending_ranks == (1, 2) and err.broken and broken == [err]
    assert "1 (host node0, pid 4001)" in str(err) and "2 (host node1, pid 4002)" in str(err)
    assert err.locations == tuple(_where([1, 2]))
    assert isinstance(err, CallTimeoutError) and isinstance(err, TimeoutError)


def test_a_short_wait_names_them_too_and_does_not_break():
    broken = []
    with pytest.raises(CallTimeout) as info:
        _call([(3, _Hung())], broken=broken).result(timeout=0.02)
    assert not info.value.broken and broken == [] and "rank 3 (host node1, pid 4003)" in str(info.value)


def test_a_lost_process_names_its_host_and_pid():
    with pytest.raises(WorkerLost) as info:
        _call([(0, _Hung()), (3, _Dead())]).result()
    err = info.value
    assert err.ranks == (3,) and err.locations == (RankLocation(3, "node1", 4003),)
    assert "rank 3 (host node1, pid 4003)" in str(err) and isinstance(err, WorkerLostError)


def test_a_failure_reported_by_the_fault_hook_names_host_and_pid():
    watch = MeshWatch("ppo_worker_test")
    watch.reports.append("proc mesh ppo_worker_test failed at {'hosts': 0/2, 'procs': 1/2}: killed")
    watch.event.set()
    with pytest.raises(WorkerLost, match=r"rank 1 \(host node0, pid 4001\)"):
        _call([(1, _Hung())], watch=watch).result()


def test_monarch_errors_are_the_backend_neutral_ones():
    assert issubclass(RemoteWorkerError, WorkerCallError)
    assert issubclass(WorkerLost, WorkerLostError)
    assert issubclass(CallTimeout, CallTimeoutError)
    assert issubclass(GroupBroken, GroupBrokenError)


# ----- real processes --------------------------------------------------------------------------------------------
CFG = MonarchConfig(
    ready_timeout_s=180.0, shutdown_timeout_s=15.0, host_lost_timeout_s=3.0, lost_shutdown_timeout_s=2.0
)


@pytest.mark.monarch
def test_a_rank_that_raises_while_its_peer_waits_in_an_all_reduce_fails_fast_and_breaks_the_group():
    wg = MonarchWorkerGroup(ProbeWorker, procs_per_host=2, config=CFG)
    try:
        info = {i.rank: i for i in wg.rank_info}
        assert wg.all_reduce(1.0) == [3.0, 3.0]  # joins the gloo group on both ranks
        start = time.monotonic()
        with pytest.raises(
            RemoteWorkerError
        ) as raised:  # rank 1 fails before the all-reduce, rank 0 waits in it
            wg.run("all_reduce", "all_to_all", ([1.0, "not a number"],))
        elapsed = time.monotonic() - start
        err = raised.value
        assert elapsed < FAIL_FAST_BOUND_S, f"surfaced after {elapsed:.1f} s"
        assert (err.rank, err.host, err.pid) == (1, info[1].host, info[1].pid)
        assert err.group_broken and err.unanswered == (RankLocation(0, info[0].host, info[0].pid),)
        assert f"pid {info[0].pid}" in str(err) and wg.broken is err
        with pytest.raises(GroupBroken):
            wg.call_all("where")
    finally:
        start = time.monotonic()
        wg.shutdown()
        assert time.monotonic() - start < 4 * CFG.shutdown_timeout_s
