"""A run's summary numbers and plot from its metric records (``metrics.jsonl``).

The summary numbers are validation means over the data sources (:func:`validation_mean`): the reward, the
accuracy (``acc``) and the GSM8K format rate (``format``). The plot (matplotlib, optional: without it no plot is
written) has one panel per quantity a run logged, so a run without some metrics simply has fewer panels:

- reward: train (sampled) and validation;
- validation accuracy and format rate;
- response length: train and validation means, and the fraction of responses cut at the length cap;
- entropy of the policy;
- KL to the reference (``actor/ref_kl``, the in-reward ``actor/reward_kl_penalty``, the loss's ``actor/kl_loss``);
- the rollout/training mismatch (``training/rollout_probs_diff_mean`` and ``_max``).

The reward panel is always drawn (empty when nothing was logged); a run without a reference model has no KL panel.
Records with none of these metrics give no plot at all (an empty one would look like a run that learned nothing).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_run", "validation_mean", "validation_reward"]

logger = logging.getLogger(__name__)

_VAL_MEAN = re.compile(r"^val-(?:core|aux)/(.+)/([^/]+)/mean@(\d+)$")


def validation_mean(record: Mapping[str, Any], variable: str = "reward") -> float | None:
    """Mean of a validation variable in a record: ``val-*/{source}/{variable}/mean@N`` at the largest ``N`` of each
    data source, averaged over the data sources (unweighted); None when the record holds none.

    Example:
        >>> validation_mean({"val-core/a/acc/mean@1": 0.5, "val-core/b/acc/mean@1": 1.0, "step": 3}, "acc")
        0.75
        >>> validation_mean({"val-aux/a/reward/mean@1": 0.5}, "acc") is None
        True
    """
    found: dict[str, tuple[int, float]] = {}
    for key, value in record.items():
        match = _VAL_MEAN.match(key)
        if match is None or match.group(2) != variable or value is None or not math.isfinite(float(value)):
            continue
        source, n = match.group(1), int(match.group(3))
        if source not in found or n > found[source][0]:
            found[source] = (n, float(value))
    if not found:
        return None
    return math.fsum(v for _, v in found.values()) / len(found)


def validation_reward(record: Mapping[str, Any]) -> float | None:
    """Mean validation reward of a record (:func:`validation_mean` of ``reward``).

    Example:
        >>> validation_reward({"val-aux/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 1.0, "step": 3})
        0.75
    """
    return validation_mean(record, "reward")


def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], float(r[key])) for r in records if r.get(key) is not None and "step" in r]


def _val_series(records: Sequence[Mapping[str, Any]], variable: str) -> list[tuple[float, float]]:
    return [
        (r["step"], v) for r in records if "step" in r and (v := validation_mean(r, variable)) is not None
    ]


# a line: (legend label, points, style); a panel: (y label, lines, always drawn, a fraction in [0, 1])
_Line = tuple[str, list[tuple[float, float]], str]


def _panels(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[_Line], bool, bool]]:
    def train(key: str) -> list[tuple[float, float]]:
        return _series(records, key)

    return [
        (
            "mean reward",
            [
                ("train reward (sampled)", train("critic/score/mean"), "-"),
                ("validation reward", _val_series(records, "reward"), "o-"),
            ],
            True,
            False,
        ),
        (
            "validation (held out)",
            [
                ("accuracy", _val_series(records, "acc"), "o-"),
                ("format rate (number after ####)", _val_series(records, "format"), "s--"),
            ],
            False,
            True,
        ),
        (
            "response length (tokens)",
            [
                ("train mean", train("response_length/mean"), "-"),
                ("validation mean", _val_series(records, "response_length"), "o-"),
            ],
            False,
            False,
        ),
        (
            "fraction at the length cap",
            [
                ("train", train("response_length/clip_ratio"), "-"),
                ("validation", _val_series(records, "response_clipped"), "o-"),
            ],
            False,
            True,
        ),
        ("entropy per token", [("policy entropy", train("actor/entropy"), "-")], False, False),
        (
            "KL per token",
            [
                ("KL(pi || pi_ref)", train("actor/ref_kl"), "-"),
                ("in-reward KL penalty", train("actor/reward_kl_penalty"), "--"),
                ("KL loss", train("actor/kl_loss"), ":"),
            ],
            False,
            False,
        ),
        (
            "|p_rollout - p_train|",
            [
                ("mean", train("training/rollout_probs_diff_mean"), "-"),
                ("max", train("training/rollout_probs_diff_max"), "--"),
            ],
            False,
            False,
        ),
    ]


def plot_run(records: Sequence[Mapping[str, Any]], path: str, title: str) -> str | None:
    """The run's curves against the step (see the module docstring), as a PNG at ``path``.

    Returns:
        ``path``, or None (logged) when matplotlib is not installed or the records hold none of these metrics
        (an empty plot would look like a run that learned nothing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logger.info("matplotlib is not installed: no plot")
        return None
    panels = _panels(records)
    if not any(series for _, lines, _, _ in panels for _, series, _ in lines):
        logger.info("no plotted metrics in the records: no plot")
        return None
    panels = [p for p in panels if p[2] or any(s for _, s, _ in p[1])]
    cols = 1 if len(panels) <= 2 else 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3 * rows), squeeze=False)
    steps = [x for _, lines, _, _ in panels for _, series, _ in lines for x, _ in series]
    for i, (label, lines, _, fraction) in enumerate(panels):
        ax = axes.flat[i]
        drawn = False
        for name, series, style in lines:
            if series:
                ax.plot(*zip(*series, strict=True), style, label=name)
                drawn = True
        ax.set_ylabel(label)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps:
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        if fraction:
            ax.set_ylim(-0.03, 1.03)
        if drawn and len(lines) > 1:
            ax.legend(loc="best", fontsize="small")
        if i + cols >= len(panels):  # nothing below it: the x axis is labelled here
            ax.set_xlabel("step")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
