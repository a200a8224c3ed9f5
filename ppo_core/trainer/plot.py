"""A run's summary numbers and plot from its metric records (``metrics.jsonl``): validation reward, reward and KL
curves (matplotlib, optional: without it no plot is written)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_run", "validation_reward"]

logger = logging.getLogger(__name__)

_VAL_REWARD = re.compile(r"^val-(?:core|aux)/(.+)/reward/mean@(\d+)$")


def validation_reward(record: Mapping[str, Any]) -> float | None:
    """Mean validation reward of a record: ``val-*/{source}/reward/mean@N`` at the largest ``N``, averaged over
    the data sources; None when the record holds no validation.

    Example:
        >>> validation_reward({"val-aux/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 1.0, "step": 3})
        0.75
    """
    found: dict[str, tuple[int, float]] = {}
    for key, value in record.items():
        match = _VAL_REWARD.match(key)
        if match is None or value is None or not math.isfinite(float(value)):
            continue
        source, n = match.group(1), int(match.group(2))
        if source not in found or n > found[source][0]:
            found[source] = (n, float(value))
    if not found:
        return None
    return math.fsum(v for _, v in found.values()) / len(found)


def plot_run(records: Sequence[Mapping[str, Any]], path: str, title: str) -> str | None:
    """Train reward, validation reward and KL to the reference against the step, as a PNG at ``path``.

    Returns:
        ``path``, or None (logged) when matplotlib is not installed or the records hold none of these metrics
        (an empty plot would look like a run that learned nothing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no plot")
        return None
    train = [(r["step"], r["critic/score/mean"]) for r in records if r.get("critic/score/mean") is not None]
    val = [(r["step"], v) for r in records if (v := validation_reward(r)) is not None]
    kl = [(r["step"], r["actor/ref_kl"]) for r in records if r.get("actor/ref_kl") is not None]
    if not (train or val or kl):
        logger.info("no reward or KL metrics in the records: no plot")
        return None
    fig, (ax_r, ax_kl) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    if train:
        ax_r.plot(*zip(*train, strict=True), label="train reward (sampled)")
    if val:
        ax_r.plot(*zip(*val, strict=True), "o-", label="validation reward")
    ax_r.set_ylabel("mean reward")
    ax_r.legend(loc="lower right")
    ax_r.set_title(title)
    if kl:
        ax_kl.plot(*zip(*kl, strict=True), color="tab:red")
    ax_kl.set_ylabel("KL(pi || pi_ref) per token")
    ax_kl.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
