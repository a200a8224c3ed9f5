"""Megatron parallel state over 4 Monarch processes on gloo: TP=2 x DP=2 and PP=2 x DP=2 layouts, dispatch and
collection of the dp groups, and vocab-parallel log-probs across the real TP group (issues 7 and 8, CPU part).
Both layouts run on one group of processes, one after the other."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("monarch")

import torch.distributed as dist
from tensordict import TensorDict

import ppo_core_monarch  # noqa: F401  (before monarch: fast failure detection)
from ppo_core.workers import ColocatedWorker, Dispatch, Worker, WorkerSpec, register
from ppo_core.workers.megatron import (
    ParallelConfig,
    destroy_megatron_parallel,
    init_megatron_parallel,
    megatron_layout,
    vocab_parallel_log_probs,
)
from ppo_core_monarch import MonarchConfig
from ppo_core_monarch.group import MonarchWorkerGroup

pytestmark = [pytest.mark.monarch, pytest.mark.slow]

# worker processes import MegatronProbe from this module by name
_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)

WORLD = 4


class MegatronProbe(Worker):
    """Megatron's parallel state as the megatron workers initialise it, without building a model (CPU).

    Two probes with different layouts share the processes of one group (colocated roles): megatron holds one
    layout at a time, so the constructor only declares its data-parallel layout and :meth:`activate` makes its
    layout megatron's, replacing the other probe's groups (the default process group stays).
    """

    def __init__(self, tp: int, pp: int) -> None:
        super().__init__()
        self.parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.mlayout = megatron_layout(self.rank, self.world_size, self.parallel)
        self.set_dp_layout(self.mlayout.dp_rank, self.mlayout.dp_size, self.mlayout.is_collect_rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def activate(self) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.mlayout = init_megatron_parallel(
            self.parallel, rank=self.rank, world_size=self.world_size, device=torch.device("cpu")
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def groups(self) -> dict:
        from megatron.core import parallel_state as ps

        def ranks(group) -> list[int]:
            return sorted(dist.get_process_group_ranks(group))

        return {
            "layout": self.mlayout,
            "tp": ranks(ps.get_tensor_model_parallel_group()),
            "pp": ranks(ps.get_pipeline_model_parallel_group()),
            "dp": ranks(ps.get_data_parallel_group()),
        }

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch: TensorDict) -> TensorDict:
        from megatron.core import parallel_state as ps

        shard = batch["logits"].chunk(self.mlayout.tp_size, dim=-1)[self.mlayout.tp_rank]
        lp = vocab_parallel_log_probs(shard, batch["labels"], ps.get_tensor_model_parallel_group())
        n = int(batch.batch_size[0])
        return TensorDict(
            {
                "log_probs": lp,
                "rank": torch.full((n,), self.rank),
                "dp_rank": torch.full((n,), self.dp_rank),
                "row": batch["row"],
            },
            batch_size=[n],
        )

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def count(self, batch: TensorDict) -> dict:
        return {"rows": float(batch.batch_size[0]), "dp_rank": float(self.dp_rank)}

    def close(self) -> None:
        destroy_megatron_parallel()


LAYOUTS = {"tp2xdp2": (2, 1), "pp2xdp2": (1, 2)}


@pytest.fixture(scope="module")
def group():
    """Both layouts' probes on one group of WORLD processes (starting them, megatron imported, is the slow part)."""
    roles = {
        name: WorkerSpec(MegatronProbe, kwargs={"tp": tp, "pp": pp}) for name, (tp, pp) in LAYOUTS.items()
    }
    cfg = MonarchConfig(device="cpu", call_timeout_s=120.0, ready_timeout_s=180.0)
    wg = MonarchWorkerGroup(
        WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), procs_per_host=WORLD, config=cfg
    )
    try:
        yield wg
    finally:
        wg.shutdown()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_dispatch_and_collect_over_monarch(group, name):
    tp, pp = LAYOUTS[name]
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    probe = group.role(name)
    probe.activate()
    info = probe.groups()
    for rank, got in enumerate(info):
        want = megatron_layout(rank, WORLD, parallel)
        assert got["layout"] == want
        # megatron's groups hold exactly the ranks megatron_layout puts together
        same = {
            "tp": lambda o, w=want: (o.dp_rank, o.pp_rank) == (w.dp_rank, w.pp_rank),
            "pp": lambda o, w=want: (o.dp_rank, o.tp_rank) == (w.dp_rank, w.tp_rank),
            "dp": lambda o, w=want: (o.tp_rank, o.pp_rank) == (w.tp_rank, w.pp_rank),
        }
        for kind, pred in same.items():
            expected = [r for r in range(WORLD) if pred(megatron_layout(r, WORLD, parallel))]
            assert got[kind] == expected, (rank, kind)
    layout = probe.layout
    assert layout.dp_size == 2
    collect = layout.collect_ranks()
    assert [megatron_layout(r, WORLD, parallel).is_collect_rank for r in collect] == [True, True]
    assert collect == ((0, 2) if tp == 2 else (2, 3))  # TP rank 0 / last pipeline stage of each dp group

    g = torch.Generator().manual_seed(0)
    n, vocab = 7, 10  # 7 rows over 2 dp groups: padded to 8, the padding removed on the way back
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=g)
    batch = TensorDict({"logits": logits, "labels": labels, "row": torch.arange(n)}, batch_size=[n])
    out = probe.score(batch)
    assert out["row"].tolist() == list(range(n))  # rows come back in order
    ref = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(out["log_probs"], ref, rtol=1e-12, atol=1e-12)
    assert set(out["rank"].tolist()) == set(collect)
    assert out["dp_rank"].tolist() == sorted(out["dp_rank"].tolist())  # contiguous shards in dp order
    assert probe.count(TensorDict({"x": torch.zeros(6)}, batch_size=[6])) == {"rows": 3.0, "dp_rank": 0.5}
