"""Deadlines and fail-fast in the worker-group protocol: every call has a deadline, a failed rank fails the call at
once, peers stuck after a failure break the group, shutdown never waits on stuck work, errors say where ranks run.

Two backends: ``LocalWorkerGroup`` (ranks run one after another on the group's call thread) and ``_ThreadRanks``,
a minimal backend written here from docs/backends.md with every rank on its own thread, so that ranks run at the
same time and one can wait in a collective (a ``threading.Barrier``) for a peer that has failed.
No assertion here is about speed: a "prompt" answer is one that comes while the blocked work is still blocked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import socket
import threading
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import (
    CallTimeoutError,
    ColocatedWorker,
    FuturesCall,
    GroupBrokenError,
    GroupResult,
    RankLocation,
    Worker,
    WorkerCallError,
    WorkerGroup,
    WorkerGroupError,
    WorkerLostError,
    WorkerSpec,
    register,
    resolve_method,
    worker_context,
)
from ppo_core.workers.errors import describe_ranks

# generous bound on waits that must end: only reached when the code under test is broken
NEVER_S = 60.0
HERE = (socket.gethostname(), os.getpid())


class Gate(Worker):
    """Ranks that return, raise, block until released, or meet in a barrier (a stand-in for an all-reduce)."""

    release = threading.Event()
    barrier: threading.Barrier | None = None
    closed: ClassVar[list[int]] = []

    @register()
    def rank_of(self) -> int:
        return self.rank

    @register()
    def thread(self) -> int:
        return threading.get_ident()

    @register()
    def block_on(self, rank: int) -> int:
        if self.rank == rank:
            Gate.release.wait(NEVER_S)
        return self.rank

    @register()
    def fail_on(self, rank: int, then_all_reduce: bool = False) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} fails on purpose")
        if then_all_reduce:
            Gate.barrier.wait(NEVER_S)  # never complete: the failed rank does not arrive
        return self.rank

    def close(self) -> None:
        Gate.closed.append(self.rank)


@pytest.fixture(autouse=True)
def _gates():
    Gate.release = threading.Event()
    Gate.barrier = None
    Gate.closed = []
    yield
    Gate.release.set()  # let every blocked rank finish, so no test leaves a thread behind
    if Gate.barrier is not None:
        Gate.barrier.abort()


def _in_thread(fn, timeout_s: float = NEVER_S):
    """Run ``fn`` on a helper thread: ``(returned, value)``; ``returned`` is False if it was still running."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn)
    try:
        return True, future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return False, None
    finally:
        pool.shutdown(wait=False)


class _ThreadRanks(WorkerGroup):
    """A backend whose ranks run concurrently, one thread each (what a process backend looks like from here)."""

    def __init__(self, spec: WorkerSpec, world_size: int, **timeouts: float | None) -> None:
        for name, value in timeouts.items():
            setattr(self, name, value)
        self._pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(world_size)]
        self.workers = []
        for rank in range(world_size):
            with worker_context(rank=rank, world_size=world_size):
                self.workers.append(spec.build())
        super().__init__(spec)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def rank_locations(self, ranks):
        return tuple(RankLocation(r, "threads", 1000 + r) for r in ranks)

    def _run(self, rank: int, method: str, args: tuple, kwargs: dict):
        try:
            return resolve_method(self.workers[rank], method)(*args, **kwargs)
        except Exception as exc:
            raise WorkerCallError(rank, method, repr(exc), host="threads", pid=1000 + rank) from exc

    def _submit(self, method, plan):
        futures = [
            self._pools[c.rank].submit(self._run, c.rank, method, c.args, c.kwargs) for c in plan.calls
        ]
        return FuturesCall(futures, [c.rank for c in plan.calls])

    def _shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)


# ----- deadlines ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["local", "threads"])
def test_a_hung_rank_passes_the_deadline_names_its_host_and_pid_and_breaks_the_group(backend):
    if backend == "local":
        wg = LocalWorkerGroup(Gate, world_size=3, call_timeout_s=0.3)
        where = RankLocation(1, *HERE)
    else:
        wg = _ThreadRanks(WorkerSpec(Gate), 3, call_timeout_s=0.3)
        where = RankLocation(1, "threads", 1001)
    assert wg.rank_of() == [0, 1, 2]
    with pytest.raises(CallTimeoutError) as info:
        wg.block_on(1)
    err = info.value
    assert not Gate.release.is_set()  # raised while rank 1 still hangs
    assert err.broken and err.method == "block_on" and err.timeout_s == 0.3
    assert 1 in err.pending_ranks and where in err.locations
    assert where.place in str(err) and isinstance(err, TimeoutError) and isinstance(err, WorkerGroupError)
    assert wg.broken is err
    with pytest.raises(GroupBrokenError, match="broken") as refused:
        wg.rank_of()
    assert refused.value.__cause__ is err
    returned, _ = _in_thread(wg.shutdown)
    assert returned and not Gate.release.is_set()  # shutdown did not wait for the hung rank
    assert wg.closed


def test_a_short_wait_does_not_break_the_group_and_the_call_can_be_waited_again():
    with LocalWorkerGroup(Gate, world_size=2, call_timeout_s=NEVER_S) as wg:
        handle = wg.call_all_async("block_on", 0)
        with pytest.raises(CallTimeoutError) as info:
            handle.result(timeout=0.05)
        assert not info.value.broken and wg.broken is None and info.value.pending_ranks == (0, 1)
        Gate.release.set()
        assert handle.result() == [0, 1]
        assert wg.rank_of() == [0, 1]


def test_await_honours_the_deadline_too():
    wg = LocalWorkerGroup(Gate, world_size=2, call_timeout_s=0.3)

    async def main():
        with pytest.raises(CallTimeoutError) as info:
            await wg.call_all_async("block_on", 1)
        return info.value

    returned, err = _in_thread(lambda: asyncio.run(main()))  # asyncio.run also joins its helper threads
    assert returned and err.broken and err.pending_ranks == (1,)
    assert not Gate.release.is_set()
    wg.shutdown()


def test_without_a_deadline_local_calls_run_inline_in_the_callers_thread():
    with LocalWorkerGroup(Gate, world_size=2, call_timeout_s=None) as wg:
        assert wg.call_timeout_s is None
        assert wg.thread() == [threading.get_ident()] * 2
    with LocalWorkerGroup(Gate, world_size=2) as wg:
        assert threading.get_ident() not in wg.thread()  # the call thread, so that a hang can time out


def test_local_calls_run_with_the_callers_grad_mode():
    class Grad(Worker):
        @register()
        def grad_enabled(self) -> bool:
            return torch.is_grad_enabled()

    with LocalWorkerGroup(Grad, world_size=2) as wg:
        assert wg.grad_enabled() == [True, True]
        with torch.no_grad():
            assert wg.grad_enabled() == [False, False]


@pytest.mark.parametrize("bad", [0, -1.0, "60", True, float("nan")])
def test_call_timeout_must_be_positive_seconds_or_none(bad):
    with pytest.raises(ValueError, match="call_timeout_s must be a positive number"):
        LocalWorkerGroup(Gate, call_timeout_s=bad)


# ----- fail-fast ------------------------------------------------------------------------------------------------
def test_a_failed_rank_fails_the_call_while_its_peers_wait_in_a_collective_and_breaks_the_group():
    Gate.barrier = threading.Barrier(3)
    wg = _ThreadRanks(WorkerSpec(Gate), 3, call_timeout_s=NEVER_S, failure_grace_s=0.2)
    with pytest.raises(WorkerCallError) as info:
        wg.call_all_async("fail_on", 2, then_all_reduce=True).result(timeout=NEVER_S / 2)
    err = info.value
    assert Gate.barrier.n_waiting == 2  # ranks 0 and 1 are still in the "all-reduce"
    assert (err.rank, err.method, err.host, err.pid) == (2, "fail_on", "threads", 1002)
    assert isinstance(err.__cause__, ValueError) and "on purpose" in str(err)
    assert err.group_broken and [loc.rank for loc in err.unanswered] == [0, 1]
    assert "rank 2 failed in 'fail_on'" in str(err) and "host threads, pid 1000" in str(err)
    assert wg.broken is err
    with pytest.raises(GroupBrokenError):
        wg.rank_of()
    returned, _ = _in_thread(wg.shutdown)
    assert returned and Gate.barrier.n_waiting == 2


@pytest.mark.parametrize("backend", ["local", "threads"])
def test_a_failed_rank_whose_peers_answer_leaves_the_group_usable(backend):
    wg = (
        LocalWorkerGroup(Gate, world_size=3)
        if backend == "local"
        else _ThreadRanks(WorkerSpec(Gate), 3, failure_grace_s=NEVER_S)
    )
    with wg:
        with pytest.raises(WorkerCallError, match="rank 1 failed in 'fail_on'") as info:
            wg.fail_on(1)
        assert not info.value.group_broken and wg.broken is None
        assert wg.rank_of() == [0, 1, 2]


def test_local_ranks_after_a_failed_one_do_not_run():
    class Trace(Gate):
        seen: ClassVar[list[int]] = []

        @register()
        def fail_on(self, rank: int, then_all_reduce: bool = False) -> int:
            Trace.seen.append(self.rank)
            return super().fail_on(rank)

    with LocalWorkerGroup(Trace, world_size=4) as wg:
        with pytest.raises(WorkerCallError) as info:
            wg.fail_on(1)
        assert Trace.seen == [0, 1] and (info.value.host, info.value.pid) == HERE
        assert wg.rank_of() == [0, 1, 2, 3]


def test_futures_call_raises_the_first_failure_without_waiting_for_the_others():
    hung, failed = concurrent.futures.Future(), concurrent.futures.Future()
    failed.set_exception(WorkerCallError(3, "step", "ValueError: x"))
    call = FuturesCall([hung, failed], ranks=[2, 3])
    with pytest.raises(WorkerCallError, match="rank 3"):
        call.result(timeout=NEVER_S / 2)
    assert call.pending_ranks == (2,) and not call.settle(0.01)
    hung.set_result(1)
    assert call.settle(0.0) and call.pending_ranks == ()


def test_role_views_share_the_deadline_and_the_broken_state():
    roles = {"a": WorkerSpec(Gate), "b": WorkerSpec(Gate)}
    group = LocalWorkerGroup(
        WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world_size=2, call_timeout_s=0.3
    )
    a, b = group.role("a"), group.role("b")
    assert a.call_timeout_s == 0.3 and b.failure_grace_s == group.failure_grace_s
    with pytest.raises(CallTimeoutError, match=r"a\.block_on"):
        a.block_on(0)
    assert b.broken is group.broken is not None
    with pytest.raises(GroupBrokenError):
        b.rank_of()
    _in_thread(b.shutdown)
    assert group.closed


def test_a_healthy_local_group_closes_its_workers_after_the_calls_already_submitted():
    wg = LocalWorkerGroup(Gate, world_size=2)
    handle = wg.call_all_async("block_on", 0)
    threading.Timer(0.2, Gate.release.set).start()
    wg.shutdown()
    assert handle.done() and handle.result() == [0, 1] and Gate.closed == [0, 1]


# ----- the errors ---------------------------------------------------------------------------------------------------
locations = st.builds(
    RankLocation,
    rank=st.integers(0, 4096),
    host=st.none() | st.text("abcdefgh-.0123456789", min_size=1, max_size=12),
    pid=st.none() | st.integers(1, 2**22),
)


@given(st.lists(locations, max_size=5, unique_by=lambda loc: loc.rank))
def test_describe_ranks_names_every_rank_host_and_pid(locs):
    text = describe_ranks([loc.rank for loc in locs], locs)
    for loc in locs:
        assert f"{loc.rank} (host {loc.host if loc.host else '?'}, pid {loc.pid if loc.pid else '?'})" in text
    assert text.startswith("ranks " if len(locs) > 1 else "rank " if locs else "no rank")


@given(
    st.lists(locations, min_size=1, max_size=4, unique_by=lambda loc: loc.rank),
    st.text(min_size=1, max_size=20),
    st.floats(0.001, 1e5),
    st.booleans(),
)
def test_errors_name_every_host_and_pid_and_survive_pickling(locs, method, timeout_s, broken):
    ranks = [loc.rank for loc in locs]
    errors = [
        CallTimeoutError(
            method=method, pending_ranks=ranks, timeout_s=timeout_s, broken=broken, locations=locs
        ),
        WorkerLostError(ranks=ranks, method=method, report="gone", locations=locs),
        WorkerCallError(
            locs[0].rank, method, "E: m", host=locs[0].host, pid=locs[0].pid, remote_traceback="tb"
        ),
    ]
    for err in errors:
        named = locs if not isinstance(err, WorkerCallError) else locs[:1]
        if isinstance(err, WorkerCallError) and locs[0].host is None and locs[0].pid is None:
            named = []  # a backend that knows neither: the message does not pretend to
            assert "(on host" not in str(err)
        for loc in named:
            assert str(loc.pid if loc.pid is not None else "?") in str(err)
            assert (loc.host if loc.host is not None else "?") in str(err)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert isinstance(back, WorkerGroupError)


def test_a_group_result_without_a_group_only_waits():
    future = concurrent.futures.Future()
    result = GroupResult(FuturesCall([future]), lambda outs: outs[0])
    assert result.deadline is None
    with pytest.raises(CallTimeoutError) as info:
        result.result(timeout=0.01)
    assert not info.value.broken and info.value.pending_ranks == (0,)
    future.set_result(5)
    assert result.result() == 5
