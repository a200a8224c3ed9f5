"""The step-time breakdown of a run (``ppo-core train --timings-json FILE``), from its ``metrics.jsonl``.

The trainer times every stage of a step (``timing_s/gen``, ``timing_s/update_actor``...); this module groups them
into the stages of a PPO step, adds "everything else" (the step's time minus its stages: batching, transfers,
metrics), and the token throughput:

============== =========================================================================================
stage          trainer timers
============== =========================================================================================
generation     ``gen``
reward         ``reward`` (starting it) + ``reward_wait`` (what it still needed after the passes below)
old_log_probs  ``old_log_prob``
reference      ``ref``
values         ``values``
advantages     ``adv`` (in-reward KL and the estimator)
critic_update  ``update_critic``
actor_update   ``update_actor``
============== =========================================================================================

A step's time excludes validation and checkpoints (the trainer runs them after the step). The first steps pay
one-time costs (CUDA graph capture, compilation, allocator growth): ``warmup_steps`` of them are left out of the
means, and shown in ``per_step``.

Example:
    >>> rec = {"step": 1, "timing_s/step": 2.0, "timing_s/gen": 1.5, "perf/total_num_tokens": 1000.0}
    >>> step_time_breakdown([rec], warmup_steps=0)["mean_s"]["everything_else"]
    0.5
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["STAGES", "step_time_breakdown"]

STAGES: dict[str, tuple[str, ...]] = {
    "generation": ("gen",),
    "reward": ("reward", "reward_wait"),
    "old_log_probs": ("old_log_prob",),
    "reference": ("ref",),
    "values": ("values",),
    "advantages": ("adv",),
    "critic_update": ("update_critic",),
    "actor_update": ("update_actor",),
}
"""Stage of the breakdown -> the trainer's timers it sums (see the module docstring)."""


def _stages_of(record: Mapping[str, Any]) -> dict[str, float]:
    out = {
        stage: sum(float(record.get(f"timing_s/{t}") or 0.0) for t in timers)
        for stage, timers in STAGES.items()
    }
    step = float(record["timing_s/step"])
    out["everything_else"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    return out


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def step_time_breakdown(
    records: Sequence[Mapping[str, Any]],
    *,
    warmup_steps: int = 1,
    num_responses: int | None = None,
) -> dict[str, Any]:
    """The breakdown of the training steps among ``records`` (``metrics.jsonl`` lines).

    Args:
        records: the run's metric records; those with ``timing_s/step`` are training steps.
        warmup_steps: the first steps left out of the means (kept in ``per_step``); fewer when the run is shorter
            (at least one step is averaged).
        num_responses: responses per step (prompts x n), for the generated tokens per second.

    Returns:
        ``{"steps", "warmup_steps", "mean_s" (stage -> seconds, plus "step"), "share" (stage -> fraction of the
        step), "tokens_per_s" ({"step": prompt + response tokens / step time, "generation": response tokens /
        generation time}), "per_step" ([{"global_step", stage -> seconds, "step"}])}``.

    Raises:
        ValueError: no training step among ``records``.
    """
    steps = [r for r in records if r.get("timing_s/step") is not None]
    if not steps:
        raise ValueError("records hold no training step (no timing_s/step): nothing to break down")
    skip = min(max(0, int(warmup_steps)), len(steps) - 1)
    per_step = [{"global_step": int(r["step"]), **_stages_of(r)} for r in steps]
    kept = per_step[skip:]
    names = [*STAGES, "everything_else", "step"]
    mean = {name: _mean([s[name] for s in kept]) for name in names}
    share = {
        name: mean[name] / mean["step"] if mean["step"] > 0 else 0.0 for name in [*STAGES, "everything_else"]
    }
    tokens = [float(r.get("perf/total_num_tokens") or 0.0) for r in steps[skip:]]
    tokens_per_s = {"step": _mean(tokens) / mean["step"] if mean["step"] > 0 else 0.0}
    lengths = [r.get("response_length/mean") for r in steps[skip:]]
    if num_responses and all(v is not None for v in lengths) and mean["generation"] > 0:
        tokens_per_s["generation"] = _mean([float(v) for v in lengths]) * num_responses / mean["generation"]
    return {
        "steps": len(steps),
        "warmup_steps": skip,
        "mean_s": mean,
        "share": share,
        "tokens_per_s": tokens_per_s,
        "per_step": per_step,
    }
