"""WorkerGroup protocol through the local backend: binding, rank context, TP layouts, colocation, async, errors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import (
    ColocatedWorker,
    CompletedCall,
    Dispatch,
    Execute,
    FuturesCall,
    GroupResult,
    Worker,
    WorkerCallError,
    WorkerSpec,
    get_registration,
    register,
    registered_methods,
    resolve_method,
    worker_context,
)


class Counter(Worker):
    closed = 0

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.value = start + self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def get(self) -> int:
        return self.value

    @register(dispatch=Dispatch.RANK_ZERO)
    def leader(self) -> int:
        return self.rank

    @register(dispatch=Dispatch.ALL_TO_ALL, blocking=False)
    def add(self, x: int) -> int:
        self.value += x
        return self.value

    @register(dispatch=Dispatch.ONE_TO_ALL, execute=Execute.RANK_ZERO)
    def only_zero(self) -> int:
        return self.rank

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, batch: TensorDict) -> TensorDict:
        return TensorDict(
            {"y": batch["x"] * 2, "rank": torch.full_like(batch["x"], self.rank)}, batch.batch_size
        )

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def double_later(self, batch: TensorDict) -> TensorDict:
        return self.double(batch)

    @register()
    def fail(self, on_rank: int) -> None:
        if self.rank == on_rank:
            raise KeyError("boom")

    def unregistered(self) -> str:
        return "plain"

    def close(self) -> None:
        Counter.closed += 1


class TensorParallel(Counter):
    """DP x TP=2: ranks (0, 1) are dp rank 0, (2, 3) dp rank 1; the second rank of each pair is collected."""

    def __init__(self) -> None:
        super().__init__()
        self.set_dp_layout(
            dp_rank=self.rank // 2, dp_size=self.world_size // 2, is_collect_rank=self.rank % 2 == 1
        )
        self.seen: list[float] = []

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, batch: TensorDict) -> TensorDict:
        self.seen = batch["x"].tolist()
        return super().double(batch)

    @register()
    def shard_seen(self) -> list[float]:
        return self.seen


def test_registered_methods_are_bound_by_name():
    with LocalWorkerGroup(WorkerSpec(Counter, kwargs={"start": 10}), world_size=3) as wg:
        assert wg.get() == [10, 11, 12]
        assert wg.leader() == 0
        assert wg.only_zero() == [0]
        handle = wg.add([1, 2, 3])
        assert isinstance(handle, GroupResult)  # the call runs on the group's call thread (its deadline)
        assert handle.result() == [11, 13, 15] and handle.done()
        assert wg.call_rank(2, "unregistered") == "plain"
        assert wg.call_all("get") == [11, 13, 15]
        assert wg.dispatch("get") == [11, 13, 15]
        assert not hasattr(wg, "unregistered")
        with pytest.raises(ValueError, match="registered: add, double, double_later"):
            wg.dispatch("unregistered")
        with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
            wg.call_rank(3, "get")


@settings(max_examples=20)
@given(st.integers(1, 4), st.integers(0, 9))
def test_dp_compute_through_a_group_matches_the_whole_batch(world, size):
    with LocalWorkerGroup(Counter, world_size=world) as wg:
        x = torch.arange(size, dtype=torch.float32)
        out = wg.double(TensorDict({"x": x}, batch_size=[size]))
    torch.testing.assert_close(out["y"], 2 * x)
    if size:
        assert out["rank"].tolist() == sorted(out["rank"].tolist())  # rank order


def test_non_blocking_dp_results_are_unpadded_too():
    """In verl, a non-blocking DataProtoFuture output was never trimmed; a GroupResult always is."""
    with LocalWorkerGroup(Counter, world_size=4) as wg:
        handle = wg.double_later(TensorDict({"x": torch.arange(5.0)}, batch_size=[5]))
        assert isinstance(handle, GroupResult)
        out = handle.result()
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_tensor_parallel_peers_get_the_same_shard_and_one_is_collected():
    with LocalWorkerGroup(TensorParallel, world_size=4) as wg:
        assert wg.layout.dp_ranks == (0, 0, 1, 1) and wg.layout.collect_ranks() == (1, 3)
        out = wg.double(TensorDict({"x": torch.arange(6.0)}, batch_size=[6]))
        assert wg.shard_seen() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [3.0, 4.0, 5.0]]
    assert out["rank"].tolist() == [1.0, 1.0, 1.0, 3.0, 3.0, 3.0]
    torch.testing.assert_close(out["y"], 2 * torch.arange(6.0))


class _RecordingGroup(LocalWorkerGroup):
    """The local backend, recording the arguments ``_submit`` is handed."""

    def _submit(self, method, plan):
        self.submitted = [call.args for call in plan.calls]
        return super()._submit(method, plan)


class _CompactingGroup(_RecordingGroup):
    """A backend that promises to compact payloads itself (as ``MonarchWorkerGroup`` does)."""

    compacts_payloads = True


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("compacting", [False, True])
def test_only_backends_that_compact_payloads_get_dp_shards_as_views(compacting):
    batch = TensorDict({"x": torch.arange(6.0)}, batch_size=[6])
    with (_CompactingGroup if compacting else _RecordingGroup)(Counter, world_size=3) as wg:
        out = wg.double(batch)
    submitted = wg.submitted
    assert [args[0]["x"].tolist() for args in submitted] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert all(_shares_storage(args[0]["x"], batch["x"]) == compacting for args in submitted)
    torch.testing.assert_close(out["y"], 2 * batch["x"])  # same result either way


def test_role_views_follow_their_group_on_compacting_payloads():
    roles = {"actor": WorkerSpec(Counter)}
    with _CompactingGroup(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world_size=2) as group:
        actor = group.role("actor")
        assert actor.compacts_payloads and not LocalWorkerGroup.compacts_payloads
        batch = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
        actor.double(batch)
        assert all(_shares_storage(args[0]["x"], batch["x"]) for args in group.submitted)


def test_worker_errors_name_rank_and_method():
    with LocalWorkerGroup(Counter, world_size=3) as wg:
        with pytest.raises(WorkerCallError, match=r"rank 1 failed in 'fail': KeyError") as info:
            wg.fail(1)
        assert info.value.rank == 1 and info.value.method == "fail"
        assert isinstance(info.value.__cause__, KeyError)
        with pytest.raises(ValueError, match="has no method 'nope'"):
            wg.call_all("nope")


def test_await_and_async_variants():
    with LocalWorkerGroup(Counter, world_size=2) as wg:

        async def main():
            a = await wg.call_all_async("get")
            b = await wg.call_rank_async(1, "get")
            c = await wg.dispatch_async("leader")
            return a, b, c

        assert asyncio.run(main()) == ([0, 1], 1, 0)


def test_await_of_a_pending_call_does_not_block_the_loop():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(lambda: (time.sleep(0.05), 7)[1])
    result = GroupResult(FuturesCall([future]), lambda outs: outs[0] + 1)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not result.done():
                ticks += 1
                await asyncio.sleep(0.001)

        value, _ = await asyncio.gather(result, ticker())
        return value, ticks

    value, ticks = asyncio.run(main())
    pool.shutdown()
    assert value == 8 and ticks > 0


def test_await_uses_the_pending_calls_own_wait_async_or_a_thread():
    class NativeCall(CompletedCall):
        awaited = False

        async def wait_async(self):
            NativeCall.awaited = True
            return [41]

    class DuckCall:  # not a PendingCall: no wait_async
        def result(self, timeout=None):
            return [9]

        def done(self):
            return True

    async def main():
        return await GroupResult(NativeCall([0]), lambda o: o[0] + 1), await GroupResult(DuckCall(), sum)

    assert asyncio.run(main()) == (42, 9)
    assert NativeCall.awaited  # the backend's own wait, not result() in a helper thread


def test_futures_call_timeout():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(time.sleep, 0.2)
    with pytest.raises(TimeoutError, match="1 of 1 ranks"):
        FuturesCall([future]).result(timeout=0.01)
    pool.shutdown()


def test_shutdown_is_idempotent_and_closes_each_worker_once():
    Counter.closed = 0
    wg = LocalWorkerGroup(Counter, world_size=3)
    wg.shutdown()
    wg.shutdown()
    assert Counter.closed == 3 and wg.closed
    with pytest.raises(RuntimeError, match="shut down"):
        wg.get()


class Critic(Worker):
    @register()
    def get(self) -> str:  # same name as Counter.get: colocated roles keep their own names
        return f"critic{self.rank}"

    @register(dispatch=Dispatch.DP_COMPUTE)
    def values(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"v": batch["x"] + 100}, batch.batch_size)


def test_colocated_roles_share_processes_and_keep_method_names():
    Counter.closed = 0
    roles = {"actor": WorkerSpec(Counter, kwargs={"start": 5}), "critic": WorkerSpec(Critic)}
    group = LocalWorkerGroup(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world_size=2)
    actor, critic = group.role("actor"), group.role("critic")
    assert actor.get() == [5, 6] and critic.get() == ["critic0", "critic1"]
    assert critic.values(TensorDict({"x": torch.zeros(4)}, batch_size=[4]))["v"].tolist() == [100.0] * 4
    assert actor.worker_cls is Counter and not hasattr(critic, "double")
    assert group.workers[1].roles["actor"].rank == 1  # roles see their rank
    assert actor.layout.dp_size == 2
    with pytest.raises(ValueError, match="valid roles: actor, critic"):
        group.role("ref")
    actor.shutdown()  # the processes are shared: shutting one role down shuts the group down, once
    critic.shutdown()
    group.shutdown()
    assert Counter.closed == 2 and group.closed and critic.closed
    with pytest.raises(RuntimeError, match="shut down"):
        critic.get()
    with pytest.raises(ValueError, match="needs a group of ColocatedWorker"):
        LocalWorkerGroup(Counter).role("actor")


def test_registered_name_clashing_with_the_group_api_is_refused():
    class Bad(Worker):
        @register()
        def shutdown(self) -> None:
            pass

    with pytest.raises(ValueError, match=r"'shutdown'.*clashes"):
        LocalWorkerGroup(Bad)


def test_registration_inheritance():
    class Child(Counter):
        def get(self) -> int:  # overridden without @register: no longer group-callable
            return -1

    names = registered_methods(Child)
    assert "get" not in names and "double" in names
    assert get_registration(Counter.add).blocking is False
    with pytest.raises(TypeError):
        register()(3)


def test_worker_context_and_environment(monkeypatch):
    with worker_context(rank=2, world_size=4, local_rank=1):
        w = Worker()
    assert (w.rank, w.world_size, w.local_rank, w.dp_rank, w.dp_size, w.is_collect_rank) == (
        2,
        4,
        1,
        2,
        4,
        True,
    )
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert Worker().worker_layout().rank == 1
    with pytest.raises(ValueError, match="rank must be in"), worker_context(rank=4, world_size=4):
        pass
    with pytest.raises(ValueError, match="dp_rank must be in"):
        w.set_dp_layout(dp_rank=2, dp_size=2, is_collect_rank=True)


def test_resolve_method_through_roles():
    cw = ColocatedWorker({"a": WorkerSpec(Counter)})
    assert resolve_method(cw, "a.get")() == 0
    with pytest.raises(ValueError, match="unknown role 'b'"):
        resolve_method(cw, "b.get")
    with pytest.raises(ValueError, match="no method '__init__'"):
        resolve_method(cw, "__init__")
