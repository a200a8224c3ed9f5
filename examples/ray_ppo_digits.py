"""The digit-sum PPO example of ``ppo_digits.py`` on Ray: 2 Ray actors, one DDP rank each (gloo), same trainer.

A whole backend in one file, written from docs/backends.md: ``RayWorkerGroup`` runs one rank per Ray actor and
keeps the protocol's failure contract (a rank that raises fails the call at once, even while its peer waits in
DDP's all-reduce; a passed deadline raises; shutdown kills stuck actors instead of waiting for them). The
trainer is ``BasePPOTrainer`` unchanged; the task, models, warm-up and config come from ``ppo_digits.py``.

Run (starts a local Ray with 2 CPUs):
    python examples/ray_ppo_digits.py                                 # PPO, 150 steps, actor + critic on 2 ranks
    python examples/ray_ppo_digits.py --steps 3 --fail-at-update 3    # rank 1 raises in its 3rd update_actor
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import socket
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
# Ray's worker processes import ppo_digits (and this file) by name: they inherit this path from ray.init
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, _HERE)

import ppo_digits as task  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from ppo_core.trainer import BasePPOTrainer, read_metrics_jsonl  # noqa: E402
from ppo_core.workers import (  # noqa: E402
    ColocatedWorker,
    Dispatch,
    PendingCall,
    RankLocation,
    WorkerCallError,
    WorkerGroup,
    WorkerGroupError,
    WorkerLostError,
    WorkerSpec,
    register,
    resolve_method,
    worker_context,
)
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker  # noqa: E402


# ------------------------------------------------------------------------------ 1. the backend: ~100 lines
@ray.remote(num_cpus=1)
class RankActor:
    """One rank: builds its worker inside ``worker_context`` and runs its methods; errors come back as values."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.worker = rank, world_size, None

    def location(self) -> tuple[str, int, str, int]:
        """``(host, pid, ip, free port)``: where errors say this rank runs, and a rendezvous for rank 0."""
        with socket.socket() as s:
            s.bind(("", 0))
            return socket.gethostname(), os.getpid(), ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, method: str, payload: tuple) -> tuple:
        try:
            if method == "__setup__":  # DDP set-up: rank 0's address, then the constructor (joins the group)
                spec, env = payload
                os.environ.update(env)
                torch.set_num_threads(1)
                with worker_context(rank=self.rank, world_size=self.world_size, local_rank=0):
                    self.worker = spec.build()
                return (True, None)
            args, kwargs = payload
            return (True, resolve_method(self.worker, method)(*args, **kwargs))
        except Exception as exc:
            return (False, f"{type(exc).__name__}: {exc}", traceback.format_exc())


class RayCall(PendingCall):
    """The Ray futures of one call: the first rank to fail raises at once; outputs in ``plan.calls`` order."""

    def __init__(self, group: RayWorkerGroup, method: str, refs: list, ranks: list[int]) -> None:
        self.group, self.method, self.ranks = group, method, ranks
        self.waiting = {ref: i for i, ref in enumerate(refs)}
        self.outputs: list = [None] * len(refs)
        self.error: Exception | None = None

    def result(self, timeout: float | None = None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.error is None and self.waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(self.waiting), num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"{self.method}: ranks {list(self.pending_ranks)} did not answer")
            self._take(ready[0])
        if self.error is not None:
            raise self.error
        return self.outputs

    def _take(self, ref) -> None:
        i = self.waiting.pop(ref)
        rank, where = self.ranks[i], self.group.rank_locations([self.ranks[i]])
        try:
            ok, *value = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the actor's process died
            self.error = WorkerLostError(ranks=[rank], method=self.method, report=str(exc), locations=where)
            return
        if ok:
            self.outputs[i] = value[0]
        else:
            host, pid = where[0].host, where[0].pid
            self.error = WorkerCallError(
                rank, self.method, value[0], host=host, pid=pid, remote_traceback=value[1]
            )

    def done(self) -> bool:
        return self.error is not None or not self.waiting or self.settle(0)

    @property
    def pending_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.ranks[i] for i in self.waiting.values()))

    def settle(self, timeout: float) -> bool:
        if not self.waiting:
            return True
        ready, _ = ray.wait(list(self.waiting), num_returns=len(self.waiting), timeout=timeout)
        return len(ready) == len(self.waiting)


class RayWorkerGroup(WorkerGroup):
    """``world_size`` ranks, one Ray actor each (DDP over gloo between them when ``world_size > 1``)."""

    def __init__(self, spec: WorkerSpec, world_size: int = 2, *, call_timeout_s: float = 600.0) -> None:
        self.call_timeout_s = call_timeout_s
        self.actors = [RankActor.remote(r, world_size) for r in range(world_size)]
        found = ray.get([a.location.remote() for a in self.actors], timeout=call_timeout_s)
        self.where = [RankLocation(r, host, pid) for r, (host, pid, _, _) in enumerate(found)]
        env = {"MASTER_ADDR": found[0][2], "MASTER_PORT": str(found[0][3])}
        # every rank is constructed at once: each blocks in init_process_group until all have joined
        refs = [a.run.remote("__setup__", (spec, env)) for a in self.actors]
        try:
            RayCall(self, "setup", refs, list(range(world_size))).result(call_timeout_s)
        except Exception as exc:
            # a rank may be stuck in init_process_group: kill it, do not ask it to close
            self._mark_broken(exc)
            self._shutdown()
            raise
        super().__init__(spec)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def rank_locations(self, ranks) -> tuple[RankLocation, ...]:
        return tuple(self.where[r] for r in ranks)

    def _submit(self, method: str, plan) -> RayCall:
        # one object per distinct argument list: TP/PP peers share their shard *per element*, so key by ids
        puts: dict = {}
        refs = []
        for call in plan.calls:
            key = (tuple(map(id, call.args)), tuple((k, id(v)) for k, v in call.kwargs.items()))
            if key not in puts:
                puts[key] = ray.put((call.args, call.kwargs))
            refs.append(self.actors[call.rank].run.remote(method, puts[key]))
        return RayCall(self, method, refs, [call.rank for call in plan.calls])

    def _shutdown(self) -> None:
        if self.broken is None:  # close the workers (bounded); a broken group's stuck ranks are not waited on
            ray.wait(
                [a.run.remote("close", ((), {})) for a in self.actors],
                num_returns=len(self.actors),
                timeout=30,
            )
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


# ------------------------------------------------------------------- 2. the trainer: workers only
class FlakyActor(TorchActorWorker):
    """The reference actor, except that rank 1 raises in its ``fail_at_update``-th update (0: never)."""

    def __init__(self, *args, fail_at_update: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.updates = fail_at_update, 0

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, batch):
        self.updates += 1
        if self.rank == 1 and self.updates == self.fail_at:  # rank 0 goes on into DDP's all-reduce and waits
            raise RuntimeError(f"rank 1 fails on purpose at t={time.time():.6f}")
        return super().update_actor(batch)


class RayDigitsTrainer(BasePPOTrainer):
    """Actor and critic colocated on 2 Ray actors (``ColocatedWorker``: one process holds both roles)."""

    def __init__(self, config: dict, weights: dict, fail_at_update: int = 0, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.weights, self.fail_at_update = weights, fail_at_update

    def init_workers(self) -> None:
        cfg, w = self.config, self.weights
        roles = {
            "actor": WorkerSpec(
                FlakyActor,
                (functools.partial(task.policy_from, w), cfg.actor.worker),
                {"fail_at_update": self.fail_at_update},
            ),
            "critic": WorkerSpec(
                TorchCriticWorker, (functools.partial(task.critic_from, w), cfg.critic.worker)
            ),
        }
        group = RayWorkerGroup(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}), world_size=2)
        self.actor_wg, self.critic_wg = group.role("actor"), group.role("critic")


def start_ray() -> None:
    """A local Ray with 2 CPUs (one per rank), after this file set the ``PYTHONPATH`` its workers inherit."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--fail-at-update", type=int, default=0, help="rank 1 raises in this update_actor (0: never)"
    )
    known, rest = p.parse_known_args(argv)
    args = task.parse_args(rest)
    args.fail_at_update = known.fail_at_update
    if args.out_dir == "runs/ppo_digits":
        args.out_dir = "runs/ray_ppo_digits"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = not ray.is_initialized()
    if started:
        start_ray()
    g = torch.Generator().manual_seed(args.seed)
    trainer = RayDigitsTrainer(
        task.make_config(args),
        task.format_warmup(args.warmup_steps, g),
        args.fail_at_update,
        train_dataset=task.make_dataset(100_000, g),
        val_dataset=task.make_dataset(128, g),
        reward_fn=task.digit_sum_reward,
        pad_token_id=task.PAD,
    )
    summary: dict = {"error": None, "surfaced_after_s": None}
    start = time.monotonic()
    try:
        trainer.fit()
    except WorkerGroupError as err:  # the same except for every backend: typed, naming rank, host and pid
        if not args.fail_at_update:
            raise
        raised_at = float(re.search(r"at t=([0-9.]+)", str(err)).group(1))
        summary.update(error=err, surfaced_after_s=time.time() - raised_at)
        print(
            f"{type(err).__name__} {summary['surfaced_after_s']:.1f} s after rank 1 raised: {str(err).splitlines()[0]}"
        )
    finally:
        stop = time.monotonic()
        trainer.shutdown()
        summary["shutdown_s"] = time.monotonic() - stop
        if started:
            ray.shutdown()
    rewards = [r["critic/score/mean"] for r in read_metrics_jsonl(args.out_dir) if "critic/score/mean" in r]
    summary["rewards"] = rewards
    if rewards:
        print(
            f"PPO on 2 Ray actors: mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} in {len(rewards)} steps"
        )
    print(f"{time.monotonic() - start:.0f} s; shutdown took {summary['shutdown_s']:.2f} s")
    return summary


if __name__ == "__main__":
    main()
