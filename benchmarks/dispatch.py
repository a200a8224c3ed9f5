"""Dispatch cost of ``MonarchWorkerGroup`` against raw Monarch and Ray actors, in one run; prints one JSON object.

Two workloads on ``--workers`` processes of this machine:

- ``empty``: a call with no arguments that returns None, to every worker;
- ``dp``: a PPO-shaped batch (``B x T`` int64 ``input_ids`` and ``attention_mask`` plus float32 ``old_log_probs``:
  42 MB at the default 1024 x 2048) split into one compact shard per worker; each worker returns a
  ``(B / workers, T)`` float32 tensor.

Engines: (a) ``ours``: ``MonarchWorkerGroup`` (``DP_COMPUTE`` dispatch: split, shared memory on one host, merge);
(b) ``monarch``: raw Monarch actors, one ``call_one`` per shard, all issued before any wait (the fastest
plain-message pattern, see docs); (c) ``ray``: Ray actors (the engine under verl's ``RayWorkerGroup``), when
``ray`` is importable, measured after the Monarch engines have stopped (Ray's daemons load a small machine). Times are medians in milliseconds over rounds that alternate the engines (so load drift on a shared machine
hits all of them); ratios compare engines within this run.

Usage:
    python benchmarks/dispatch.py [--workers 4] [--batch 1024] [--seqlen 2048] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import ppo_core_monarch  # noqa: F401  (before monarch, which reads its supervision poll at import)

# isort: split
import torch
from monarch.actor import Actor, endpoint
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core.workers import Dispatch, Worker, register
from ppo_core_monarch.group import MonarchWorkerGroup

# The worker classes live in this script: Monarch and Ray pickle classes of __main__ by value.


class BenchWorker(Worker):
    """ppo-core worker: the DP method returns a ``(B / workers, T)`` float tensor."""

    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute(self, batch: TensorDict) -> torch.Tensor:
        return batch["old_log_probs"] * 2


class RawActor(Actor):
    """The same two methods as raw Monarch endpoints."""

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def compute(self, batch: TensorDict) -> torch.Tensor:
        return batch["old_log_probs"] * 2


class _RayWorker:
    def noop(self) -> None:
        return None

    def compute(self, batch: TensorDict) -> torch.Tensor:
        return batch["old_log_probs"] * 2


def _batch(b: int, t: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "input_ids": torch.randint(0, 32000, (b, t), generator=gen),
            "attention_mask": torch.ones(b, t, dtype=torch.int64),
            "old_log_probs": torch.randn(b, t, generator=gen),
        },
        batch_size=[b],
    )


def _shards(batch: TensorDict, n: int) -> list[TensorDict]:
    return [s.clone() for s in batch.split(batch.batch_size[0] // n)]


def _ours(stack: contextlib.ExitStack, batch: TensorDict, n: int) -> dict:
    wg = stack.enter_context(MonarchWorkerGroup(BenchWorker, procs_per_host=n))
    return {"empty": lambda: wg.call_all("noop"), "dp": lambda: torch.cat(wg.compute(batch))}


def _monarch(stack: contextlib.ExitStack, batch: TensorDict, n: int) -> dict:
    from monarch.actor import this_host

    procs = this_host().spawn_procs(per_host={"procs": n})
    stack.callback(lambda: procs.stop().get(timeout=60))
    actors = procs.spawn("bench_raw", RawActor)
    actors.initialized.get(timeout=300)
    flat = actors.flatten("rank")
    singles = [flat.slice(rank=r) for r in range(n)]

    def dp() -> torch.Tensor:
        futures = [a.compute.call_one(s) for a, s in zip(singles, _shards(batch, n), strict=True)]
        return torch.cat([f.get(timeout=300) for f in futures])

    return {"empty": lambda: actors.noop.call().get(timeout=300), "dp": dp}


def _ray(stack: contextlib.ExitStack, batch: TensorDict, n: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False)
    stack.callback(ray.shutdown)
    actors = [ray.remote(_RayWorker).remote() for _ in range(n)]
    ray.get([a.noop.remote() for a in actors])

    def dp() -> torch.Tensor:
        return torch.cat(
            ray.get([a.compute.remote(s) for a, s in zip(actors, _shards(batch, n), strict=True)])
        )

    return {"empty": lambda: ray.get([a.noop.remote() for a in actors]), "dp": dp}


def _check(engines: dict, expected: torch.Tensor) -> None:
    for name, ops in engines.items():
        if not torch.equal(ops["dp"](), expected):
            raise AssertionError(f"{name} returned wrong data")


def _interleaved_medians(engines: dict, op: str, rounds: int) -> dict[str, float]:
    """Median ms per engine; rounds alternate the engines so that load drift on a shared machine hits all."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 2):
        for name, ops in engines.items():
            start = time.perf_counter()
            ops[op]()
            if r >= 2:  # two warm-up rounds
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: round(statistics.median(ts), 3) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument(
        "--repeats", type=int, default=9, help="rounds of the DP call (x5 for the empty call)"
    )
    parser.add_argument(
        "--out", default=None, help="also write the JSON (with commit, date, device) to this file"
    )
    args = parser.parse_args(argv)
    batch = _batch(args.batch, args.seqlen)
    expected = batch["old_log_probs"] * 2
    # Ray runs in a second phase: its daemons (raylet, GCS, idle workers) keep a 2-core machine busy and would
    # slow the Monarch engines measured next to them (and the idle Monarch processes would slow Ray).
    empty, dp = {}, {}
    with contextlib.ExitStack() as stack:
        engines = {"ours": _ours(stack, batch, args.workers), "monarch": _monarch(stack, batch, args.workers)}
        _check(engines, expected)
        empty.update(_interleaved_medians(engines, "empty", args.repeats * 5))
        dp.update(_interleaved_medians(engines, "dp", args.repeats))
    with contextlib.ExitStack() as stack:
        ray_ops = _ray(stack, batch, args.workers)
        if ray_ops is not None:
            engines = {"ray": ray_ops}
            _check(engines, expected)
            empty.update(_interleaved_medians(engines, "empty", args.repeats * 5))
            dp.update(_interleaved_medians(engines, "dp", args.repeats))
    result: dict = {
        "workers": args.workers,
        "batch_mb": round(sum(v.nbytes for v in batch.values()) / 1e6, 1),
        "cpus": os.cpu_count(),
        **{name: {"empty_ms": empty[name], "dp_ms": dp[name]} for name in empty},
    }
    result.setdefault("ray", None)
    ours, raw, ray_ = result["ours"], result["monarch"], result["ray"]
    result["ratios"] = {
        "ours_empty_over_monarch": round(ours["empty_ms"] / raw["empty_ms"], 3),
        "ours_dp_over_monarch": round(ours["dp_ms"] / raw["dp_ms"], 3),
    }
    if ray_ is not None:
        result["ratios"]["ours_dp_over_ray"] = round(ours["dp_ms"] / ray_["dp_ms"], 3)
        result["ratios"]["ours_empty_over_ray"] = round(ours["empty_ms"] / ray_["empty_ms"], 3)
    result["targets_met"] = {
        "empty_within_1.5x_monarch": result["ratios"]["ours_empty_over_monarch"] <= 1.5,
        "dp_at_most_half_of_ray": None if ray_ is None else result["ratios"]["ours_dp_over_ray"] <= 0.5,
    }
    emit(result, args.out, indent=None)


if __name__ == "__main__":
    main()
