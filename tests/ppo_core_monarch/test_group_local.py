"""MonarchWorkerGroup on one host: a 1 x 4 mesh running two colocated roles (pure DP and DP=2 x TP=2)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time

import pytest
import torch
from _monarch_workers import ProbeWorker
from tensordict import TensorDict

from ppo_core.workers import ColocatedWorker, WorkerCallError, WorkerSpec
from ppo_core_monarch import CallTimeout, MonarchConfig, RemoteWorkerError
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = pytest.mark.monarch

WORLD = 4


@pytest.fixture(scope="module")
def group():
    roles = {"dp": WorkerSpec(ProbeWorker), "tp": WorkerSpec(ProbeWorker, kwargs={"tp": 2})}
    cfg = MonarchConfig(call_timeout_s=120.0, ready_timeout_s=180.0)
    wg = MonarchWorkerGroup(
        WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), procs_per_host=WORLD, config=cfg
    )
    yield wg
    wg.shutdown()


def _batch(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n * 3, dtype=torch.int64).reshape(n, 3)}, batch_size=[n])


def test_every_rank_sits_where_the_topology_says(group):
    topo = group.topology
    assert (topo.world_size, topo.num_hosts, topo.local_size) == (WORLD, 1, WORLD)
    where = group.role("dp").where()
    ports = {w["MASTER_PORT"] for w in where}
    assert len(ports) == 1 and int(next(iter(ports))) > 0
    for rank, w in enumerate(where):
        assert w["rank"] == rank == int(w["RANK"])
        assert w["local_rank"] == topo.local_rank_of(rank) == int(w["LOCAL_RANK"])
        assert int(w["GROUP_RANK"]) == topo.host_of(rank) == 0
        assert (int(w["WORLD_SIZE"]), int(w["LOCAL_WORLD_SIZE"])) == (WORLD, WORLD)
    assert len({w["pid"] for w in where}) == WORLD
    assert [i.rank for i in group.rank_info] == list(range(WORLD))


def test_gloo_all_reduce_sums_over_ranks(group):
    # rank r contributes 1.5 * (r + 1): the sum is 1.5 * W (W + 1) / 2 on every rank
    assert group.role("dp").all_reduce(1.5) == [1.5 * WORLD * (WORLD + 1) / 2] * WORLD


def test_all_to_all_and_rank_zero(group):
    dp = group.role("dp")
    assert dp.echo([f"v{r}" for r in range(WORLD)]) == [(r, f"v{r}") for r in range(WORLD)]
    assert dp.first() == 0
    assert group.call_rank(2, "dp.where")["rank"] == 2


@pytest.mark.parametrize("n", [1, 4, 7, 13])
def test_dp_compute_returns_rows_in_order(group, n):
    batch = _batch(n)
    out = group.role("dp").score(batch)
    assert out.batch_size[0] == n
    torch.testing.assert_close(out["score"], batch["x"].double() * 2)
    # ranks see contiguous chunks in dp order: the dp rank column never decreases
    assert bool((out["dp_rank"][1:] >= out["dp_rank"][:-1]).all())


def test_tp_peers_get_the_same_shard_and_only_collect_ranks_answer(group):
    tp = group.role("tp")
    assert tp.layout.dp_size == WORLD // 2
    batch = _batch(6)
    out = tp.score(batch)
    torch.testing.assert_close(out["score"], batch["x"].double() * 2)
    assert set(out["rank"].tolist()) == {0, 2}  # collect ranks of the two dp groups


def test_remote_exception_names_rank_host_method_and_traceback(group):
    with pytest.raises(RemoteWorkerError) as info:
        group.call_all("dp.boom", "kaboom", rank=2)
    err = info.value
    assert (err.rank, err.method) == (2, "dp.boom")
    assert err.host == group.rank_info[2].host and err.pid == group.rank_info[2].pid
    assert "ValueError" in err.exc_type and "kaboom" in str(err)
    assert "_monarch_workers.py" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert isinstance(err, WorkerCallError) and isinstance(err.__cause__, ValueError)
    # the group stays usable after an application error
    assert group.call_all("dp.boom", "x", rank=99) == list(range(WORLD))


def test_workers_share_the_cores_of_their_host_by_default(group):
    # torch's default (a thread per core in every worker) oversubscribes the host; the automatic setting
    # splits the cores, unless OMP_NUM_THREADS says otherwise
    omp = os.environ.get("OMP_NUM_THREADS", "")
    expected = int(omp) if omp.isdigit() and int(omp) > 0 else max(1, len(os.sched_getaffinity(0)) // WORLD)
    assert group.call_all("dp.torch_threads") == [expected] * WORLD


def test_large_results_come_back_through_shared_memory(group):
    out = group.call_all("dp.big", 256, 512)
    for rank, t in enumerate(out):
        assert t.shape == (256, 512) and bool((t == rank).all())


def test_short_wait_raises_unbroken_timeout_and_call_can_be_waited_again(group):
    call = group.call_all_async("dp.sleep", 1.0)
    with pytest.raises(CallTimeout) as info:
        call.result(timeout=0.05)
    assert not info.value.broken and set(info.value.pending_ranks) <= set(range(WORLD))
    assert call.result() == list(range(WORLD))
    assert group.broken is None


def test_async_api_from_asyncio(group):
    dp = group.role("dp")
    assert dp.layout.dp_size == WORLD  # a role view asks its layout once, outside the loop

    async def main():
        a = dp.call_all_async("where")
        b = dp.run_async("score", "dp_compute", (_batch(5),))
        heartbeat = asyncio.create_task(asyncio.sleep(0.01))
        where, scored = await asyncio.gather(a, b)
        await heartbeat  # the loop kept running while the calls were pending
        return where, scored

    where, scored = asyncio.run(main())
    assert [w["rank"] for w in where] == list(range(WORLD))
    assert scored.batch_size[0] == 5


def test_blocking_result_inside_event_loop_is_refused(group):
    """A usage error, refused at once: not a rank's failure, so the group neither waits out its failure grace on
    the other ranks nor breaks, and the call and later calls go on."""
    from ppo_core.workers import BlockingWaitInEventLoopError

    async def main():
        call = group.call_all_async("dp.first")
        start = time.monotonic()
        with pytest.raises(BlockingWaitInEventLoopError, match="event loop"):
            call.result()
        refused_in = time.monotonic() - start
        return refused_in, await call

    refused_in, out = asyncio.run(main())
    assert out == list(range(WORLD))
    assert refused_in < 0.5 * group.failure_grace_s
    assert group.broken is None
    assert group.call_all("dp.first") == list(range(WORLD))


def test_hosts_from_a_local_monarch_job():
    from monarch.job import LocalJob

    from ppo_core_monarch import job_hosts

    job = LocalJob(hosts=("trainers",))
    job.apply()
    with MonarchWorkerGroup(
        ProbeWorker, procs_per_host=2, hosts=job_hosts(job, "trainers", owned=False)
    ) as wg:
        assert wg.topology.num_hosts == 1  # LocalJob maps every name to this machine: no host dimension
        assert [int(w["RANK"]) for w in wg.where()] == [0, 1]
    assert wg.closed


def test_controller_log_records_keep_their_message(group, caplog):
    """After a group started (Monarch then knows this process as its ``<root>`` actor), the controller's log
    records are not rewritten with ``[actor=<root>]`` prefixes, once per handler."""
    log = logging.getLogger("ppo_core_monarch.test")
    extra = logging.StreamHandler(
        io.StringIO()
    )  # a second handler: Monarch's filter would rewrite the record twice
    logging.getLogger().addHandler(extra)
    try:
        with caplog.at_level(logging.INFO, logger="ppo_core_monarch.test"):
            assert len(group.role("dp").where()) == WORLD  # a call from the controller, in Monarch's context
            log.info("controller message")
    finally:
        logging.getLogger().removeHandler(extra)
    assert caplog.messages[-1] == "controller message"
