"""Bytes through the controller for one GRPO-shaped null-compute step, by value against resident batches, in one
run; prints one JSON object.

Both paths make the same calls a GRPO ``train_step`` makes (no critic, no reference, outcome reward), on workers
that compute nothing (tensors of the right shapes and dtypes):

- ``by_value`` (what ``BasePPOTrainer`` does today): prompts ``[B, Lp]`` go out; ``generate_sequences`` returns
  ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``response_mask``; the whole batch goes out
  again to ``compute_log_prob`` (``old_log_probs`` ``[B, Lr]`` back); the controller adds token-level scores,
  rewards, advantages and returns ``[B, Lr]`` and sends the whole batch to ``update_actor``.
- ``resident``: prompts go out as dataset indices ``[B]``; the generation stays in the workers (the response
  lengths come back); the reward runs on the ranks holding the responses (``[B]`` scores back); log-probs are
  added in place; GRPO outcome advantages are computed on the controller from the ``[B]`` scores and scattered
  ``[B]``; ``update_actor`` gets the handle; the step's batches are dropped at its end.

Bytes are the groups' transport counters (``WorkerGroup.traffic``: each rank's copy counted, tensors plus the
pickle of the rest). ``--backend local`` (default) runs the ranks in this process (bytes only: nothing crosses a
process, so its times say nothing); ``--backend monarch`` runs ``--procs`` Monarch processes on this machine and
also reports the median step time of each path; ``--hosts 2`` simulates two hosts (worker loops on 127.0.0.1,
pickled over TCP as across a network).

Usage:
    python benchmarks/resident_bytes.py [--rows 512] [--n 8] [--lp 1024] [--lr 1024 4096] [--procs 2]
        [--backend local|monarch] [--hosts 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core.workers import Dispatch, Worker, WorkerSpec, register

# The worker class lives in this script: Monarch pickles classes of __main__ by value.


class NullActor(Worker):
    """GRPO actor whose methods return tensors of the right shapes and compute nothing."""

    def __init__(self, lp: int, lr: int, prompts: int) -> None:
        super().__init__()
        self.lp, self.lr = lp, lr
        self.dataset = torch.randint(3, 1000, (prompts, lp))  # the prompt dataset every rank can read

    def _generate(self, prompt: torch.Tensor, prompt_mask: torch.Tensor) -> TensorDict:
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

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: TensorDict) -> TensorDict:
        return self._generate(batch["input_ids"], batch["attention_mask"])

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_from_index(self, batch: TensorDict) -> TensorDict:
        prompt = self.dataset[batch["index"]]
        out = self._generate(prompt, torch.ones_like(prompt))
        out.set("response_length", out["response_mask"].sum(-1))
        return out

    @register(dispatch=Dispatch.DP_COMPUTE, reads=("responses", "response_mask"))
    def reward(self, batch: TensorDict) -> TensorDict:
        score = (batch["response_mask"].sum(-1) % 3).float()
        return TensorDict({"score": score}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE, reads=("input_ids", "attention_mask", "responses"))
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        return TensorDict(
            {"old_log_probs": torch.zeros(batch["responses"].shape)}, batch_size=batch.batch_size
        )

    @register(
        dispatch=Dispatch.DP_COMPUTE_METRIC,
        reads=("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages"),
    )
    def update_actor(self, batch: TensorDict) -> dict:
        adv = batch["advantages"]
        if adv.dim() == 1:  # outcome advantages arrive per row; every response token gets its row's value
            adv = adv[:, None].expand_as(batch["old_log_probs"])
        return {"actor/pg_loss": float((adv * batch["response_mask"]).sum())}


def _grpo_outcome(scores: torch.Tensor, n: int) -> torch.Tensor:
    """``[B]`` outcome advantages: each score minus its group's mean over its group's std (groups of ``n`` rows)."""
    g = scores.view(-1, n)
    return ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)).reshape(-1)


def step_by_value(wg, rows: int, n: int, lp: int) -> None:
    prompts = TensorDict(
        {
            "input_ids": torch.randint(3, 1000, (rows, lp)),
            "attention_mask": torch.ones(rows, lp, dtype=torch.int64),
        },
        batch_size=[rows],
    )
    batch = wg.generate_sequences(prompts)
    scores = (batch["response_mask"].sum(-1) % 3).float()  # the controller-side reward reads the responses
    batch.update(wg.compute_log_prob(batch))
    adv = _grpo_outcome(scores, n)[:, None] * batch["response_mask"]
    token_scores = torch.zeros_like(batch["old_log_probs"])
    for key in ("token_level_scores", "token_level_rewards"):
        batch.set(key, token_scores)
    batch.set("advantages", adv.float())
    batch.set("returns", adv.float())
    wg.update_actor(batch)


def step_resident(wg, rows: int, n: int, step: int) -> None:
    index = TensorDict({"index": torch.arange(rows // n).repeat_interleave(n)}, batch_size=[rows])
    ref, _lengths = wg.dispatch_resident(
        "generate_from_index", index, columns=("response_length",), step=step
    )
    ref, cols = wg.dispatch_resident("reward", ref, into=ref, columns=("score",))
    ref, _ = wg.dispatch_resident("compute_log_prob", ref, into=ref)
    adv = _grpo_outcome(cols["score"], n)
    ref = wg.scatter_resident(ref, TensorDict({"advantages": adv}, batch_size=[rows]))
    wg.update_actor(ref)
    wg.end_resident_step(step)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lp", type=int, default=1024)
    ap.add_argument("--lr", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--procs", type=int, default=2, help="ranks per host")
    ap.add_argument("--hosts", type=int, default=1, help="monarch: > 1 simulates hosts (worker loops, TCP)")
    ap.add_argument("--backend", choices=("local", "monarch"), default="local")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here (benchmarks/results/<script>.json)")
    args = ap.parse_args()
    out = {
        "rows": args.rows,
        "n": args.n,
        "lp": args.lp,
        "procs": args.procs,
        "backend": args.backend,
        "runs": [],
    }
    for lr in args.lr:
        spec = WorkerSpec(NullActor, kwargs={"lp": args.lp, "lr": lr, "prompts": args.rows // args.n})
        with _group(args.backend, spec, args.procs, args.hosts) as wg:
            result = {"lr": lr}
            for name, step in (
                ("by_value", lambda s: step_by_value(wg, args.rows, args.n, args.lp)),
                ("resident", lambda s: step_resident(wg, args.rows, args.n, s)),
            ):
                step(0)  # warm: layouts, allocations
                wg.traffic.take()
                times = []
                for s in range(1, args.repeats + 1):
                    start = time.perf_counter()
                    step(s)
                    times.append(time.perf_counter() - start)
                taken = wg.traffic.take()
                per_step = {k: v // args.repeats for k, v in taken.items()}
                result[name] = {
                    "controller_bytes": per_step["total"],
                    "sent": per_step["sent"],
                    "received": per_step["received"],
                    "bytes_per_row": round(per_step["total"] / args.rows, 1),
                    "median_step_s": round(statistics.median(times), 4) if args.backend != "local" else None,
                }
            result["ratio_by_value_over_resident"] = round(
                result["by_value"]["controller_bytes"] / result["resident"]["controller_bytes"], 1
            )
            out["runs"].append(result)
    emit(out, args.out)


if __name__ == "__main__":
    main()
