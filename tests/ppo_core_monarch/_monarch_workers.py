"""Worker classes for the Monarch tests (imported by the worker processes: the conftest puts this directory on
``PYTHONPATH``)."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ppo_core.workers import Dispatch, Worker, register


class ProbeWorker(Worker):
    """Reports where it runs and echoes data; ``tp`` > 1 declares DP x TP peers (consecutive ranks share a shard)."""

    def __init__(self, tp: int = 1, fail_on_rank: int | None = None) -> None:
        super().__init__()
        if fail_on_rank is not None and self.rank == fail_on_rank:
            raise RuntimeError(f"constructor fails on rank {self.rank} on purpose")
        if tp > 1:
            self.set_dp_layout(self.rank // tp, self.world_size // tp, is_collect_rank=self.rank % tp == 0)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        keys = (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
        env = {k: os.environ.get(k) for k in keys}
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **env,
        }

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        t = torch.tensor([value * (self.rank + 1)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def echo(self, x):
        return (self.rank, x)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, batch: TensorDict) -> TensorDict:
        n = batch.batch_size[0]
        return TensorDict(
            {
                "score": batch["x"].double() * 2,
                "dp_rank": torch.full((n,), self.dp_rank),
                "rank": torch.full((n,), self.rank),
            },
            batch_size=[n],
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def torch_threads(self) -> int:
        return torch.get_num_threads()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def shard_bytes(self, batch: TensorDict) -> tuple[int, int]:
        """``(bytes of the received x, bytes of the storage behind it)``: equal when the shard came compact."""
        return batch["x"].nbytes, batch["x"].untyped_storage().nbytes()

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def stats(self, batch: TensorDict) -> dict:
        return {"rows": float(batch.batch_size[0])}

    @register(dispatch=Dispatch.RANK_ZERO)
    def first(self) -> int:
        return self.rank

    def boom(self, message: str, rank: int | None = None) -> int:
        if rank is None or rank == self.rank:
            raise ValueError(message)
        return self.rank

    def exit_on(self, rank: int, delay_s: float = 0.0) -> int:
        if self.rank == rank:
            time.sleep(delay_s)
            os._exit(1)
        time.sleep(delay_s + 0.5)
        return self.rank

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def big(self, rows: int, cols: int) -> torch.Tensor:
        return torch.full((rows, cols), float(self.rank))


class ResidentProbe(ProbeWorker):
    """Makes rows that stay in the worker (resident batches) and reports which rank read which rows."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def make(self, batch: TensorDict) -> TensorDict:
        i = batch["index"]
        return TensorDict(
            {"index": i, "tokens": i[:, None] * 10 + torch.arange(4), "weight": i.double() / 3},
            batch_size=batch.batch_size,
        )

    @register(dispatch=Dispatch.DP_COMPUTE, reads=("index",))
    def read_index(self, batch: TensorDict) -> TensorDict:
        keys = torch.full_like(batch["index"], len(batch.keys()))
        return TensorDict(
            {"index": batch["index"], "rank": torch.full_like(batch["index"], self.rank), "n_keys": keys},
            batch_size=batch.batch_size,
        )
