"""The digit-sum PPO example of ``ppo_digits.py`` on PyTorch Monarch: 2 processes, DDP over gloo, same trainer.

Only the backend changes: ``MonarchPPOTrainer`` spawns one Monarch process per rank, holding the actor and the
critic (colocated), and the workers average their gradients with DDP. The task, the models, the format warm-up
and the PPO config are imported from ``ppo_digits.py``.

Run (one machine, 2 processes):
    python examples/monarch_ppo_digits.py
    python examples/monarch_ppo_digits.py --algo grpo --procs-per-host 2
Simulated hosts (worker loops on 127.0.0.1, attached like remote machines; 2 hosts x 1 process):
    python examples/monarch_ppo_digits.py --simulate-hosts 2 --procs-per-host 1
Real hosts: on each machine run ``python -m ppo_core_monarch.serve --address tcp://$(hostname):$PORT``, then
    python examples/monarch_ppo_digits.py --hosts tcp://node0:PORT,tcp://node1:PORT --procs-per-host 8
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# the worker processes unpickle functions of ppo_digits.py: they need this directory on their path
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, _HERE)

import ppo_core_monarch  # noqa: E402  (before monarch, which reads its supervision poll at import)

# isort: split
import ppo_digits as task  # noqa: E402
import torch  # noqa: E402

from ppo_core.trainer import read_metrics_jsonl  # noqa: E402
from ppo_core.workers import WorkerSpec  # noqa: E402
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker  # noqa: E402
from ppo_core_monarch.trainer import MonarchPPOTrainer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs-per-host", type=int, default=2, help="Monarch processes (DDP ranks) per host")
    p.add_argument("--hosts", default=None, help="comma-separated worker-loop addresses (tcp://host:port)")
    p.add_argument(
        "--simulate-hosts", type=int, default=0, help="start this many local worker loops as hosts"
    )
    known, rest = p.parse_known_args(argv)
    args = task.parse_args(rest)
    for k, v in vars(known).items():
        setattr(args, k, v)
    if args.out_dir == "runs/ppo_digits":
        args.out_dir = "runs/monarch_ppo_digits"
    return args


def roles_for(weights: dict[str, torch.Tensor]):
    """``config -> {"actor": spec, "critic": spec}``: the same workers as the local example."""

    def roles(cfg) -> dict[str, WorkerSpec]:
        out = {
            "actor": WorkerSpec(
                TorchActorWorker, (functools.partial(task.policy_from, weights), cfg.actor.worker)
            )
        }
        if cfg.use_critic:
            out["critic"] = WorkerSpec(
                TorchCriticWorker, (functools.partial(task.critic_from, weights), cfg.critic.worker)
            )
        return out

    return roles


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.time()
    g = torch.Generator().manual_seed(args.seed)
    weights = task.format_warmup(args.warmup_steps, g)

    loops = ppo_core_monarch.start_worker_loops(args.simulate_hosts) if args.simulate_hosts else None
    addresses = loops.addresses if loops else (args.hosts.split(",") if args.hosts else None)
    trainer = MonarchPPOTrainer(
        task.make_config(args),
        roles=roles_for(weights),
        procs_per_host=args.procs_per_host,
        hosts=(lambda: ppo_core_monarch.attach_hosts(addresses)) if addresses else None,
        monarch=ppo_core_monarch.MonarchConfig(device="auto", torch_threads=args.threads),
        train_dataset=task.make_dataset(100_000, g),
        val_dataset=task.make_dataset(128, g),
        reward_fn=task.digit_sum_reward,
        pad_token_id=task.PAD,
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        if loops is not None:
            loops.stop()
    wall = time.time() - start

    records = read_metrics_jsonl(args.out_dir)
    rewards = [r["critic/score/mean"] for r in records if r.get("critic/score/mean") is not None]
    tail = rewards[-10:]
    summary = {
        "algo": args.algo,
        "world_size": trainer.groups[0].world_size,
        "initial_reward": rewards[0],
        "final_reward": sum(tail) / len(tail),
        "wall_seconds": wall,
    }
    png = os.path.join(args.out_dir, "reward_kl.png")
    task.plot(records, png, f"{args.algo.upper()} on Monarch, {summary['world_size']} ranks ({wall:.0f} s)")
    print(
        f"{args.algo} on Monarch ({summary['world_size']} ranks): mean reward {summary['initial_reward']:.3f} -> "
        f"{summary['final_reward']:.3f} (mean of the last {len(tail)} steps) in {wall:.0f} s"
    )
    print(f"metrics: {os.path.join(args.out_dir, 'metrics.jsonl')}")
    print(f"plot:    {png}")
    return summary


if __name__ == "__main__":
    main()
