"""A resident batch resharded from a dp = 4 producer to a dp = 2 consumer, worker to worker; prints one JSON object.

One Monarch group of ``--hosts`` x ``--procs`` processes (``--hosts 2``: two simulated hosts, worker loops on
127.0.0.1) runs two colocated roles: ``producer`` (every rank its own dp rank) and ``consumer`` (pairs of
ranks share a dp rank, as TP = 2 would). The producer keeps ``--mb`` MB of rows; the consumer reshards them with
each executor (``p2p``: torch.distributed gloo point-to-point; ``tcp``: sockets) and the bytes through the
controller (the groups' transport counter: plans, handles, addresses) are reported with the wall time and the
bandwidth of the rows that cross processes (a consumer rank copies the rows it already holds locally). The consumer's copy is checked against the producer's rows.

Usage:
    python benchmarks/resident_reshard.py [--hosts 2] [--procs 2] [--mb 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# isort: split
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._groups import monarch_group
from benchmarks._meta import emit
from ppo_core.workers import ColocatedWorker, Dispatch, Worker, WorkerSpec, register
from ppo_core.workers.reshard import plan_reshard

WIDTH = 4096  # int64 columns per row: 32 KiB a row


class Holder(Worker):
    """Keeps rows of ``WIDTH`` int64; ``tp`` > 1 makes consecutive ranks share a dp rank."""

    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        if tp > 1:
            self.set_dp_layout(self.rank // tp, self.world_size // tp, is_collect_rank=self.rank % tp == 0)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def make(self, batch: TensorDict) -> TensorDict:
        i = batch["index"]
        return TensorDict({"tokens": i[:, None] * WIDTH + torch.arange(WIDTH)}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, reads=("tokens",))
    def check(self, batch: TensorDict, first: int) -> dict:
        return {"sum": float(batch["tokens"].double().sum())}


def _group(hosts: int, procs: int):
    roles = {"producer": WorkerSpec(Holder), "consumer": WorkerSpec(Holder, kwargs={"tp": 2})}
    return monarch_group(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), procs=procs, hosts=hosts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", help="also write the JSON here (benchmarks/results/<script>.json)")
    args = ap.parse_args()
    rows = args.mb * 2**20 // (WIDTH * 8)
    out = {"hosts": args.hosts, "procs": args.procs, "rows": rows, "mb": args.mb, "executors": {}}
    with _group(args.hosts, args.procs) as wg:
        producer, consumer = wg.role("producer"), wg.role("consumer")
        index = TensorDict({"index": torch.arange(rows)}, batch_size=[rows])
        ref, _ = producer.dispatch_resident("make", index, step=1)
        expected = float((torch.arange(rows)[:, None] * WIDTH + torch.arange(WIDTH)).double().sum())
        out["producer_dp"], out["consumer_dp"] = ref.placement.dp_size, consumer.layout.dp_size
        plan = plan_reshard(ref.placement, consumer.layout)
        moved_rows = sum(t.rows for t in plan.transfers if t.src_rank != t.dst_rank)  # the rest: local copies
        out["moved_between_processes_mb"] = moved_rows * WIDTH * 8 / 2**20
        for executor in ("p2p", "tcp"):
            times, through = [], []
            for _ in range(args.repeats):
                wg.traffic.take()
                start = time.perf_counter()
                moved = consumer.reshard(ref, source=producer, executor=executor)
                times.append(time.perf_counter() - start)
                through.append(wg.traffic.take()["total"])
                summed = (
                    consumer.check(moved, 0)["sum"] * consumer.layout.dp_size
                )  # metric mean over dp ranks
                if summed != expected:
                    raise RuntimeError(f"{executor}: the resharded rows differ ({summed} != {expected})")
                consumer.drop_resident(moved)
            t = statistics.median(times)
            out["executors"][executor] = {
                "median_s": round(t, 3),
                "moved_gb_per_s": round(out["moved_between_processes_mb"] / 1024 / t, 3),
                "controller_bytes": max(through),
            }
    emit(out, args.out)


if __name__ == "__main__":
    main()
