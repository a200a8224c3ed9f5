"""Bytes through the controller for real GRPO ``train_step`` calls on null-compute workers, by value against
resident batches, in one run; prints one JSON object.

Both paths run ``BasePPOTrainer.train_step`` (GRPO, no critic, no reference, ``rollout.n`` responses a prompt) on
an actor whose methods return tensors of the right shapes and compute nothing, with the reward wrapped in a
``WorkerReward`` (it reads the response mask):

- ``by_value`` (the default trainer): the prompts ``[B, Lp]`` go out, the generation comes back, the whole batch
  goes out again to ``compute_log_prob`` and ``update_actor``; the reward, the advantages and the data metrics run
  on the controller.
- ``resident`` (``trainer.resident_batches``): the prompts go out as ``[B]`` dataset indices (their token ids sent
  once, at the first step, not counted below), the generation stays in the workers, the reward runs on the ranks
  holding the responses, log-probs are added in place, GRPO's outcome advantages go out as ``[B]`` values, the data
  metrics come back as per-rank partials.

Bytes are the step's ``perf/controller_bytes`` (the groups' transport counters: each rank's copy counted, tensors
plus the pickle of the rest), averaged over ``--repeats`` steps after a first one. ``--backend local`` (default) runs
the ranks in this process (bytes only); ``--backend monarch`` runs ``--procs`` Monarch processes a host and also
reports the step time and the controller's CPU time a step (``time.process_time`` of this process: median, minimum
and maximum over the measured steps) and the stages' median seconds; ``--hosts 2`` simulates two hosts (worker
loops on 127.0.0.1, pickled over TCP as across a network), ``--hosts 1 2`` runs both and gives each path's median
step time on 2 hosts over 1 (the time target: within 10%). The target of ``docs/resident-batches.md``: at most ``64 B x rows + 1 MB`` a resident step,
whatever ``Lr``.

Usage:
    python benchmarks/resident_bytes.py [--rows 2048] [--n 8] [--lp 1024] [--lr 1024 4096] [--procs 2]
        [--backend local|monarch] [--hosts 1 [2]] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core.trainer import BasePPOTrainer, WorkerReward
from ppo_core.workers import Dispatch, Worker, WorkerSpec, register
from ppo_core.workers.ppo import ACTOR_UPDATE_KEYS, FORWARD_KEYS, GENERATE_KEYS

# The worker class lives in this script: Monarch pickles classes of __main__ by value.


class NullActor(Worker):
    """GRPO actor whose methods return tensors of the right shapes and compute nothing."""

    def __init__(self, lr: int) -> None:
        super().__init__()
        self.lr = lr

    @register(dispatch=Dispatch.DP_COMPUTE, reads=GENERATE_KEYS)
    def generate_sequences(self, batch: TensorDict) -> TensorDict:
        prompt, prompt_mask = batch["input_ids"], batch["attention_mask"]
        b = prompt.shape[0]
        responses = torch.ones(b, self.lr, dtype=torch.int64)
        mask = torch.ones(b, self.lr, dtype=torch.int64)
        return TensorDict(
            {
                "prompts": prompt,
                "responses": responses,
                "input_ids": torch.cat([prompt, responses], -1),
                "attention_mask": torch.cat([prompt_mask, mask], -1),
                "response_mask": mask,
            },
            batch_size=[b],
        )

    @register(dispatch=Dispatch.DP_COMPUTE, reads=FORWARD_KEYS)
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        shape = batch["responses"].shape
        return TensorDict({"old_log_probs": torch.zeros(shape)}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, reads=ACTOR_UPDATE_KEYS)
    def update_actor(self, batch: TensorDict) -> dict:
        return {"actor/pg_loss": float((batch["advantages"] * batch["response_mask"]).sum())}


def null_reward(batch: TensorDict) -> torch.Tensor:
    """A score from the response lengths (0, 1 or 2): something to normalise, nothing to compute."""
    return (batch["response_mask"].sum(-1) % 3).float()


class NullTrainer(BasePPOTrainer):
    """The trainer on a null actor group, built by ``group_factory``; records each step's metrics."""

    def __init__(self, *args, group_factory, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group_factory = group_factory
        self.steps: list[dict] = []

    def init_workers(self) -> None:
        self.actor_wg = self.group_factory()

    def train_step(self, batch, epoch):
        cpu = time.process_time()
        metrics = super().train_step(batch, epoch)
        metrics["controller_cpu_s"] = (
            time.process_time() - cpu
        )  # this process: the controller (and, local, the ranks)
        self.steps.append(metrics)
        return metrics


def run_trainer(
    group_factory, *, rows: int, n: int, lp: int, steps: int, resident: bool, log_dir: str
) -> list:
    """``steps`` GRPO ``train_step`` calls; each step's metrics."""
    prompts = rows // n
    g = torch.Generator().manual_seed(0)
    dataset = [{"input_ids": torch.randint(3, 1000, (lp,), generator=g).tolist()} for _ in range(prompts)]
    cfg = {
        "data": {"train_batch_size": prompts, "shuffle": False},
        "rollout": {"n": n},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "actor": {"use_kl_loss": False, "world_size": 1},
        "trainer": {
            "total_epochs": steps,
            "total_training_steps": steps,
            "save_freq": 0,
            "test_freq": 0,
            "resume_mode": "disable",
            "default_local_dir": log_dir,
            "loggers": [],
            "progress_bar": False,
            "resident_batches": resident,
        },
    }
    reward = WorkerReward(null_reward, reads=("response_mask",))
    trainer = NullTrainer(cfg, train_dataset=dataset, reward_fn=reward, group_factory=group_factory)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.steps


@contextlib.contextmanager
def _group(backend: str, spec: WorkerSpec, procs: int, hosts: int):
    if backend == "local":
        from ppo_core.backends import LocalWorkerGroup

        with LocalWorkerGroup(spec, world_size=procs * hosts) as wg:
            yield wg
        return
    from benchmarks._groups import monarch_group  # Monarch only where asked for

    with monarch_group(spec, procs=procs, hosts=hosts) as wg:
        yield wg


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def _measure(wg, args, name: str) -> dict:
    """One path's ``--repeats`` measured steps (after a first one) on the worker group ``wg``."""
    with tempfile.TemporaryDirectory() as log_dir:
        steps = run_trainer(
            lambda: _Borrowed(wg),
            rows=args.rows,
            n=args.n,
            lp=args.lp,
            steps=args.repeats + 1,
            resident=name == "resident",
            log_dir=log_dir,
        )
    measured = steps[1:]  # the first step also ships the prompt table (resident) and warms up
    sent = [m["perf/controller_bytes_sent"] for m in measured]
    received = [m["perf/controller_bytes_received"] for m in measured]
    total = [a + b for a, b in zip(sent, received, strict=True)]
    timed = args.backend != "local"
    out = {
        "controller_bytes": int(statistics.mean(total)),
        "sent": int(statistics.mean(sent)),
        "received": int(statistics.mean(received)),
        "bytes_per_row": round(statistics.mean(total) / args.rows, 1),
        "first_step_bytes": int(steps[0]["perf/controller_bytes"]),
        "median_controller_cpu_s": (
            round(statistics.median(m["controller_cpu_s"] for m in measured), 4) if timed else None
        ),
        "median_step_s": (
            round(statistics.median(m["perf/time_per_step"] for m in measured), 4) if timed else None
        ),
    }
    if timed:
        out["step_s"] = _spread([m["perf/time_per_step"] for m in measured])
        out["controller_cpu_s"] = _spread([m["controller_cpu_s"] for m in measured])
        # where the step's wall time goes (the stages' timers; medians)
        stages = sorted({k for m in measured for k in m if k.startswith("timing_s/")})
        out["stage_median_s"] = {
            k[len("timing_s/") :]: round(statistics.median(m.get(k, 0.0) for m in measured), 4)
            for k in stages
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lp", type=int, default=1024)
    ap.add_argument("--lr", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--procs", type=int, default=2, help="ranks per host")
    ap.add_argument(
        "--hosts", type=int, nargs="+", default=[1], help="monarch: > 1 simulates hosts (worker loops, TCP)"
    )
    ap.add_argument("--backend", choices=("local", "monarch"), default="local")
    ap.add_argument("--repeats", type=int, default=3, help="steps measured after a first one")
    ap.add_argument("--paths", nargs="+", choices=("by_value", "resident"), default=["by_value", "resident"])
    ap.add_argument("--out", help="also write the JSON here (benchmarks/results/<script>.json)")
    args = ap.parse_args()
    budget = 64 * args.rows + 1_000_000
    out = {
        "rows": args.rows,
        "n": args.n,
        "lp": args.lp,
        "procs": args.procs,
        "hosts": args.hosts if len(args.hosts) > 1 else args.hosts[0],
        "backend": args.backend,
        "repeats": args.repeats,
        "target_bytes": budget,
        "runs": [],
    }
    for lr in args.lr:
        spec = WorkerSpec(NullActor, kwargs={"lr": lr})
        by_hosts = {}
        for hosts in args.hosts:
            with _group(args.backend, spec, args.procs, hosts) as wg:
                result = {"lr": lr, "hosts": hosts}
                for name in args.paths:
                    result[name] = _measure(wg, args, name)
            if "resident" in result:
                result["resident"]["within_target"] = result["resident"]["controller_bytes"] <= budget
            if "by_value" in result and "resident" in result:
                result["ratio_by_value_over_resident"] = round(
                    result["by_value"]["controller_bytes"] / result["resident"]["controller_bytes"], 1
                )
            by_hosts[hosts] = result
            out["runs"].append(result)
        if args.backend != "local" and 1 in by_hosts and len(by_hosts) > 1:
            # the time target: the same job on more (simulated) hosts within 10% of one host
            for hosts, result in by_hosts.items():
                if hosts == 1:
                    continue
                for name in args.paths:
                    ratio = result[name]["step_s"]["median"] / by_hosts[1][name]["step_s"]["median"]
                    result[name]["median_step_over_1_host"] = round(ratio, 3)
                    if name == "resident":
                        result[name]["within_10_percent_of_1_host"] = ratio <= 1.10
    emit(out, args.out)


class _Borrowed:
    """A worker group lent to one trainer: everything forwards to it, except ``shutdown`` (the benchmark keeps
    the group for the next path)."""

    def __init__(self, group) -> None:
        self._group = group

    def __getattr__(self, name: str):
        return getattr(self._group, name)

    def shutdown(self) -> None:
        """Keep the group running."""


if __name__ == "__main__":
    main()
