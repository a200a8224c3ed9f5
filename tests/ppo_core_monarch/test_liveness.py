"""Exits of worker processes on the controller's machine, read from ``/proc`` (no Monarch needed): a process that
exited (a zombie its parent has not reaped, or gone) is not running; only ranks in this process's pid namespace are
probed; a pending call with an exited rank raises ``WorkerLost`` naming it, even when Monarch never reports it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ppo_core.workers import RankLocation
from ppo_core_monarch import WorkerLost
from ppo_core_monarch.calls import CallPart, GroupCall
from ppo_core_monarch.liveness import LocalExitProbe, process_namespace, process_running
from ppo_core_monarch.supervision import MeshWatch

pytestmark = pytest.mark.skipif(process_namespace() is None, reason="needs Linux /proc")


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _until(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_running_exited_unreaped_and_reaped_processes():
    assert process_running(os.getpid())
    child = _child("import time; time.sleep(60)")
    try:
        assert process_running(child.pid)
    finally:
        child.kill()
    # killed but not waited for: a zombie, which has exited
    assert _until(lambda: not process_running(child.pid))
    child.wait()
    assert not process_running(child.pid)  # reaped: no /proc entry at all


def test_probe_sees_only_ranks_of_this_namespace_and_rate_limits_itself():
    here = process_namespace()
    child = _child("import time; time.sleep(60)")
    try:
        probe = LocalExitProbe(
            [
                (0, os.getpid(), here),
                (1, child.pid, here),
                (2, child.pid, "other-boot/pid:[1]"),
                (3, 1, None),
            ],
            interval_s=0.0,
        )
        assert probe.local_ranks == (0, 1)
        assert probe.exited([0, 1, 2, 3]) == ()
        child.kill()
        assert _until(lambda: probe.exited([0, 1, 2, 3]) == (1,))
        slow = LocalExitProbe([(1, child.pid, here)], interval_s=60.0)
        assert slow.exited([1]) == (1,)
        assert slow.exited([1]) == ()  # the next look is a minute away
        assert slow.exited([]) == ()
    finally:
        child.kill()
        child.wait()


class _Hung:
    def get(self, timeout=None):
        time.sleep(min(timeout or 0.0, 0.01))
        raise TimeoutError


def test_a_pending_call_with_an_exited_local_rank_raises_worker_lost_at_once():
    here = process_namespace()
    child = _child("import os; os._exit(3)")
    child.wait()
    probe = LocalExitProbe([(0, os.getpid(), here), (1, child.pid, here)], interval_s=0.0)
    broken: list[BaseException] = []
    call = GroupCall(
        method="step",
        parts=[CallPart(_Hung(), (r,), (r,), mesh=False) for r in (0, 1)],
        n_outputs=2,
        timeout_s=30.0,
        watch=MeshWatch("ppo_worker_liveness"),  # Monarch never reports anything
        wait_slice_s=0.01,
        on_broken=broken.append,
        locate=lambda report: (),
        where=lambda ranks: [RankLocation(r, "here", 1000 + r) for r in ranks],
        exited=probe.exited,
    )
    start = time.monotonic()
    with pytest.raises(WorkerLost) as info:
        call.result()
    assert time.monotonic() - start < 5.0
    assert info.value.ranks == (1,) and broken == [info.value]
    assert "rank 1 (host here, pid 1001)" in str(info.value) and "exited" in str(info.value)
