"""The controller's share of a step's metrics and advantages at ``--rows`` rows, by value against resident
batches, in one run; prints one JSON object.

What each path runs on the controller between the workers' calls (the functions the steps call, on a synthetic
step batch: random response lengths, ``rollout.n`` rows a prompt, scores at the last valid token):

- ``by_value`` (``BasePPOTrainer.train_step``): the reward metrics, the in-reward KL penalty (PPO:
  ``apply_kl_penalty`` over ``[B, Lr]``), the advantages (``compute_advantages``: GRPO or GAE with its
  whitening over ``[B, Lr]``) and the data, timing and throughput metrics of the whole batch
  (``compute_data_metrics`` ...).
- ``resident`` (``trainer.resident_batches``): what ``resident_train_step`` does with what the ranks sent: the
  rows' group ids and data sources (read per prompt, repeated), the reward metrics, the KL controller's mean of the ``[B]`` per-row KL, the outcome advantages from ``[B]`` row sums
  (GRPO: ``outcome_advantages``) or the reduction of the ranks' per-row whitening partials (GAE:
  ``reduce_row_moments``), and the reduction of the ranks' ``DataMetricParts`` (``step_end_metrics`` with
  ``parts``). The ranks' own work (their parts, made beforehand from ``--dp`` contiguous shards) is not timed.

Each is timed ``--repeats`` times (``time.perf_counter``, this process); the JSON gives the median, minimum and
maximum seconds. The target of ``docs/resident-batches.md``: at 8192 rows the resident controller's metrics and
advantages take under 0.1 s.

Usage:
    python benchmarks/resident_controller.py [--rows 8192] [--n 8] [--lp 1024] [--lr 4096] [--dp 4]
        [--algos grpo ppo] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._meta import emit
from ppo_core.advantages._common import broadcast_rows
from ppo_core.kl_control import apply_kl_penalty, build_kl_controller
from ppo_core.masked_moments import reduce_row_moments, row_moments, whiten_with
from ppo_core.metrics import compute_data_metrics
from ppo_core.metrics.partial import data_metric_parts, lengths_of_parts, reduce_data_metric_parts
from ppo_core.metrics.timing import compute_throughput_metrics, compute_timing_metrics
from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.trainer.config import AlgorithmConfig
from ppo_core.trainer.resident_step import outcome_advantages, repeat_labels
from ppo_core.trainer.reward import scores_to_token_level
from ppo_core.trainer.steps import compute_advantages
from ppo_core.workers.resident_ops import ROW_KL, ROW_REWARD_SUM, ROW_VALID, gae_rows, shape_rewards

TIMING = {"gen": 1.0, "old_log_prob": 1.0, "update_actor": 1.0, "step": 4.0}
"""Stage seconds for the timing metrics (their values do not change the work)."""


def make_batch(rows: int, n: int, lp: int, lr: int, seed: int = 0) -> tuple[TensorDict, torch.Tensor]:
    """A step's batch after the log-prob, reference and value passes (``[B, Lp + Lr]`` attention mask, ``[B, Lr]``
    response mask, old / reference log-probs and values) and its ``[B]`` sequence scores."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, lr + 1, (rows,), generator=g)
    response_mask = (torch.arange(lr)[None, :] < lengths[:, None]).to(torch.int64)
    prompt_lengths = torch.randint(1, lp + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(lp)[None, :] >= (lp - prompt_lengths)[:, None]).to(torch.int64)
    batch = TensorDict(
        {
            "attention_mask": torch.cat([prompt_mask, response_mask], -1),
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(rows, lr, generator=g),
            "ref_log_probs": -torch.rand(rows, lr, generator=g),
            "values": torch.randn(rows, lr, generator=g),
        },
        batch_size=[rows],
    )
    batch.set("uid", NonTensorStack(*[str(i // n) for i in range(rows)]))
    scores = torch.randint(0, 3, (rows,), generator=g).float()
    return batch, scores


def _algorithm(algo: str) -> AlgorithmConfig:
    return AlgorithmConfig(adv_estimator="gae" if algo == "ppo" else "grpo", use_kl_in_reward=algo == "ppo")


def by_value(batch: TensorDict, scores: torch.Tensor, algo: str) -> dict[str, float]:
    """The by-value step's controller work on the whole batch (a fresh copy of its inputs each time)."""
    batch = batch.clone(recurse=False)
    metrics = reward_metrics_by_source(["bench"] * len(scores), scores, {})
    mask = batch["response_mask"].bool()
    batch.set("token_level_scores", scores_to_token_level(scores, mask))
    if algo == "ppo":
        batch, kl = apply_kl_penalty(batch, build_kl_controller({"type": "adaptive", "kl_coef": 1e-3}))
        metrics.update(kl)
    else:
        batch.set("token_level_rewards", batch["token_level_scores"])
    batch = compute_advantages(batch, _algorithm(algo))
    metrics.update(compute_data_metrics(batch, use_critic=algo == "ppo"))
    metrics.update(compute_timing_metrics(batch, TIMING))
    metrics.update(compute_throughput_metrics(batch, TIMING, n_gpus=1))
    return metrics


def rank_parts(batch: TensorDict, scores: torch.Tensor, algo: str, dp: int) -> dict:
    """What the ``dp`` ranks send the controller (made at the ranks and once by the controller to get the
    advantages the ranks then hold: not timed): per rank the ``[b]`` reward columns, with GAE the per-row whitening
    partials, and the ``DataMetricParts`` of the rows with their advantages."""
    sizes = [len(c) for c in torch.arange(len(scores)).chunk(dp)]
    shards = [s.clone(recurse=False) for s in batch.split(sizes)]
    beta = 1e-3 if algo == "ppo" else None
    columns, moments = [], []
    for shard, part in zip(shards, scores.split(sizes), strict=True):
        shaped = shape_rewards(shard, TensorDict({"row_scores": part}, batch_size=[len(part)]), beta)
        shard.update(shaped)
        columns.append(shaped.select(*(k for k in (ROW_REWARD_SUM, ROW_VALID, ROW_KL) if k in shaped)))
        if algo == "ppo":
            shard.update(gae_rows(shard, 1.0, 1.0, whiten=False))
            moments.append(row_moments(shard["advantages"], shard["response_mask"].bool()))
    cols = torch.cat(columns)
    if algo == "ppo":
        whole = reduce_row_moments(moments)
        for shard in shards:
            mask = shard["response_mask"].bool()
            shard.set("advantages", whiten_with(shard["advantages"], mask, whole))
    else:
        per_row = outcome_advantages(
            cols[ROW_REWARD_SUM], cols[ROW_VALID], list(batch.get("uid").tolist()), _algorithm(algo)
        )
        for shard, rows in zip(shards, per_row.split(sizes), strict=True):
            adv = broadcast_rows(rows, shard["response_mask"].bool(), torch.float32)
            shard.set("advantages", adv)
            shard.set("returns", adv.clone())
    parts = [data_metric_parts(shard, use_critic=algo == "ppo") for shard in shards]
    prompt_uids = list(batch.get("uid").tolist())[:: len(scores) // len(set(batch.get("uid").tolist()))]
    return {"columns": cols, "moments": moments, "parts": parts, "prompt_uids": prompt_uids}


def resident(batch: TensorDict, scores: torch.Tensor, algo: str, sent: dict) -> dict[str, float]:
    """The resident step's controller work on what the ranks sent."""
    n = len(scores) // len(sent["prompt_uids"])
    metrics = reward_metrics_by_source(repeat_labels(["bench"] * len(sent["prompt_uids"]), n), scores, {})
    cols = sent["columns"]
    if algo == "ppo":
        kl_ctrl = build_kl_controller({"type": "adaptive", "kl_coef": 1e-3})
        current_kl = float(cols[ROW_KL].mean())
        kl_ctrl.update(current_kl, n_steps=len(scores))
        metrics["actor/reward_kl_penalty"] = current_kl
        moments = reduce_row_moments(sent["moments"])
        metrics["whitening/count"] = float(moments.count)
    else:
        uids = repeat_labels(sent["prompt_uids"], n)  # as the step reads them: per prompt
        outcome_advantages(cols[ROW_REWARD_SUM], cols[ROW_VALID], uids, _algorithm(algo))
    parts = sent["parts"]
    lengths = lengths_of_parts(parts)
    metrics.update(reduce_data_metric_parts(parts, use_critic=algo == "ppo"))
    metrics.update(compute_timing_metrics(None, TIMING, lengths=lengths))
    metrics.update(compute_throughput_metrics(None, TIMING, n_gpus=1, lengths=lengths))
    return metrics


def _timed(fn, repeats: int) -> dict[str, float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {
        "median_s": round(statistics.median(seconds), 4),
        "min_s": round(min(seconds), 4),
        "max_s": round(max(seconds), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lp", type=int, default=1024)
    ap.add_argument("--lr", type=int, default=4096)
    ap.add_argument(
        "--dp", type=int, default=4, help="data-parallel ranks whose parts the controller reduces"
    )
    ap.add_argument("--algos", nargs="+", choices=("grpo", "ppo"), default=["grpo", "ppo"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here (benchmarks/results/<script>.json)")
    args = ap.parse_args()
    batch, scores = make_batch(args.rows, args.n, args.lp, args.lr)
    out = {
        "rows": args.rows,
        "n": args.n,
        "lp": args.lp,
        "lr": args.lr,
        "dp": args.dp,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "target_s": 0.1,
        "runs": [],
    }
    for algo in args.algos:
        sent = rank_parts(batch, scores, algo, args.dp)
        value_metrics = by_value(batch, scores, algo)
        resident_metrics = resident(batch, scores, algo, sent)
        # the two paths compute the same data metrics (the reductions' order aside)
        shared = [k for k in value_metrics if k in resident_metrics and k.startswith(("critic/", "response"))]
        worst = max(
            abs(resident_metrics[k] - value_metrics[k]) / max(abs(value_metrics[k]), 1.0) for k in shared
        )
        result = {
            "algo": algo,
            "by_value": _timed(lambda a=algo: by_value(batch, scores, a), args.repeats),
            "resident": _timed(lambda a=algo, s=sent: resident(batch, scores, a, s), args.repeats),
            "metrics_compared": len(shared),
            "max_metric_rel_diff": float(f"{worst:.3g}"),
        }
        result["resident"]["within_target"] = result["resident"]["median_s"] < out["target_s"]
        result["ratio_by_value_over_resident"] = round(
            result["by_value"]["median_s"] / max(result["resident"]["median_s"], 1e-9), 1
        )
        out["runs"].append(result)
    emit(out, args.out)


if __name__ == "__main__":
    main()
