"""The figure ``docs/images/smollm2_h100_rollout_correction.png`` from the three runs' ``metrics.jsonl`` here.

Three runs of ``examples/configs/smollm2_grpo.yaml`` on one H100 (``fast``: no correction; ``tis``: token-level
truncated importance sampling, ``rollout_is=token``, threshold 2; ``exact``: exact on-policy mode), one panel each
for the training reward (``critic/score/mean``), the rollout/training mismatch
(``training/rollout_probs_diff_max``, log scale) and the step time (``timing_s/step``). The exact run's mismatch is
exactly 0 at every step, which a log scale cannot show: it is drawn at the panel's floor and the legend says so.

Usage: ``python docs/smollm2_h100/rollout_correction/plot.py`` (matplotlib).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from ppo_core.trainer import read_metrics_jsonl

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "images" / "smollm2_h100_rollout_correction.png"
RUNS = {
    "fast (no correction)": ("fast", "C0-o"),
    "tis (token IS, threshold 2)": ("tis", "C1-s"),
    "exact (exact on-policy mode)": ("exact", "C2-^"),
}
FLOOR = 1e-7
"""Where a mismatch of exactly 0 is drawn on the log-scale panel (below every nonzero value of the runs)."""


def steps(name: str) -> list[dict]:
    """The run's training-step records (validation-only records have no step time)."""
    return [r for r in read_metrics_jsonl(HERE / f"{name}.metrics.jsonl") if "timing_s/step" in r]


def main() -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for label, (name, style) in RUNS.items():
        records = steps(name)
        x = [r["step"] for r in records]
        axes[0].plot(x, [r["critic/score/mean"] for r in records], style, label=label)
        diff = [r["training/rollout_probs_diff_max"] for r in records]
        zero = all(d == 0 for d in diff)
        diff_label = f"{label}: exactly 0, drawn at {FLOOR:g}" if zero else label
        axes[1].plot(x, [max(d, FLOOR) for d in diff], style, label=diff_label)
        axes[2].plot(x, [r["timing_s/step"] for r in records], style, label=label)
    axes[1].set_yscale("log")
    for ax, ylabel in zip(
        axes,
        (
            "training reward (critic/score/mean)",
            "training/rollout_probs_diff_max",
            "s / step (timing_s/step)",
        ),
        strict=True,
    ):
        ax.set_ylabel(ylabel)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        "GRPO on SmolLM2-135M-Instruct (examples/configs/smollm2_grpo.yaml), one H100, fp32, same seed; "
        "exact stopped after step 6"
    )
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    plt.close(fig)
    return OUT


if __name__ == "__main__":
    print(main())
