"""Fault injection: each failure surfaces as its typed error within a stated bound; nothing hangs or leaks.

Bounds (supervision poll 1 s, set by ``import ppo_core_monarch``; ``host_lost_timeout_s`` 3 s here and in
test_group_hosts.py), with slack for a loaded 2-core machine:

- method raises                      -> RemoteWorkerError   (tested in test_group_local.py)
- ``os._exit(1)`` on one rank         -> WorkerLost           within EXIT_BOUND_S
- method hangs past the deadline     -> CallTimeout          within deadline + HANG_SLACK_S
- host worker loop SIGKILLed          -> WorkerLost           (tested in test_group_hosts.py, on its hosts)
"""

from __future__ import annotations

import time

import pytest
from _monarch_workers import ProbeWorker
from _procs import pids_alive

from ppo_core.workers import RankLocation, WorkerSpec
from ppo_core_monarch import (
    CallTimeout,
    GroupBroken,
    MonarchConfig,
    RemoteWorkerError,
    WorkerLost,
)
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = pytest.mark.monarch

EXIT_BOUND_S = 6.0
HANG_DEADLINE_S = 2.0
HANG_SLACK_S = 1.5

CFG = MonarchConfig(
    ready_timeout_s=180.0, shutdown_timeout_s=15.0, host_lost_timeout_s=3.0, lost_shutdown_timeout_s=2.0
)


def _wait_gone(pids, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids_alive(pids)


def test_process_exit_becomes_worker_lost_naming_host_and_pid_and_breaks_the_group():
    """Also what a real mesh's errors say (``test_error_context.py`` drives ``GroupCall`` without processes): a
    short wait and the lost worker both name the rank's host and pid."""
    wg = MonarchWorkerGroup(ProbeWorker, procs_per_host=2, config=CFG)
    where = {i.rank: i for i in wg.rank_info}
    pids = [i.pid for i in wg.rank_info]
    try:
        assert wg.rank_locations([0, 1]) == tuple(
            RankLocation(r, where[r].host, where[r].pid) for r in (0, 1)
        )
        call = wg.run_async("sleep", "all_to_all", ([0.0, 1.0],))
        with pytest.raises(CallTimeout) as timeout:
            call.result(timeout=0.2)
        assert timeout.value.pending_ranks == (1,) and f"pid {where[1].pid}" in str(timeout.value)
        assert where[1].host in str(timeout.value)
        assert call.result() == [0, 1]  # a short wait breaks nothing

        start = time.monotonic()
        with pytest.raises(WorkerLost) as info:
            wg.call_all("exit_on", 1, 0.0)
        elapsed = time.monotonic() - start
        assert elapsed < EXIT_BOUND_S, f"os._exit detected after {elapsed:.2f} s"
        assert 1 in info.value.ranks and "exit_on" in str(info.value)
        assert f"pid {where[1].pid}" in str(info.value)
        assert RankLocation(1, where[1].host, where[1].pid) in info.value.locations
        # a broken group refuses at once
        start = time.monotonic()
        with pytest.raises(GroupBroken):
            wg.call_all("where")
        assert time.monotonic() - start < 0.5
        assert wg.broken is info.value
    finally:
        wg.shutdown()
        wg.shutdown()  # idempotent
    assert _wait_gone(pids) == []


def test_hang_past_deadline_becomes_call_timeout_naming_pending_ranks():
    cfg = MonarchConfig.from_dict({**CFG.to_dict(), "call_timeout_s": HANG_DEADLINE_S})
    wg = MonarchWorkerGroup(ProbeWorker, procs_per_host=2, config=cfg)
    pids = [i.pid for i in wg.rank_info]
    try:
        wg.call_all("sleep", 0.0)  # warm: the deadline measures the hang, not the first call
        start = time.monotonic()
        with pytest.raises(CallTimeout) as info:  # rank 0 answers at once, rank 1 hangs
            wg.run("sleep", "all_to_all", ([0.0, 30.0],))
        elapsed = time.monotonic() - start
        assert HANG_DEADLINE_S <= elapsed < HANG_DEADLINE_S + HANG_SLACK_S
        assert info.value.broken and info.value.pending_ranks == (1,)
        with pytest.raises(GroupBroken):
            wg.call_all("where")
    finally:
        start = time.monotonic()
        wg.shutdown()
        shutdown_s = time.monotonic() - start
    assert shutdown_s < 2 * CFG.shutdown_timeout_s
    assert _wait_gone(pids) == []


def test_constructor_failure_names_the_rank_and_leaves_no_process():
    with pytest.raises(RemoteWorkerError) as info:
        MonarchWorkerGroup(WorkerSpec(ProbeWorker, kwargs={"fail_on_rank": 1}), procs_per_host=2, config=CFG)
    assert info.value.rank == 1 and "setup" in info.value.method
    assert "on purpose" in str(info.value)
