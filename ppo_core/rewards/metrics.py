"""Per-data-source means of a training batch's reward and of the reward function's numeric extra infos.

Validation already groups by data source (``val-core/{source}/...``). ``BasePPOTrainer`` adds
``reward_metrics_by_source(sources, scores, extra_infos)`` to every training step's metrics
(``reward/{source}/score/mean``, ``reward/{source}/acc/mean``...); a loop of your own can do the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch

__all__ = ["reward_metrics_by_source"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (Real, bool)) and math.isfinite(float(value))


def reward_metrics_by_source(
    data_sources: Sequence[str],
    scores: torch.Tensor | Sequence[float],
    extra_infos: Mapping[str, Sequence[Any]] | None = None,
    *,
    prefix: str = "reward",
) -> dict[str, float]:
    """``{prefix}/{source}/score/mean`` and ``{prefix}/{source}/{name}/mean`` for every numeric extra info.

    Args:
        data_sources: ``[B]`` data source of each response.
        scores: ``[B]`` sequence scores (or ``[B, R]`` token-level scores, summed over the response).
        extra_infos: ``{name: [B] values}``; a name is averaged over the rows where its value is a finite number
            (strings such as ``pred``, None and NaN are skipped; a name with no number for a source is omitted).
        prefix: first component of every metric name.

    Returns:
        Flat ``{name: float}`` metrics, plus ``{prefix}/{source}/count`` (responses of that source).

    Example:
        >>> reward_metrics_by_source(["a", "b", "a"], [1.0, 0.0, 0.0], {"acc": [1.0, 0.0, 0.0], "pred": ["1", "", "2"]})
        {'reward/a/count': 2.0, 'reward/a/score/mean': 0.5, 'reward/a/acc/mean': 0.5, 'reward/b/count': 1.0, 'reward/b/score/mean': 0.0, 'reward/b/acc/mean': 0.0}
    """
    values = torch.as_tensor(scores, dtype=torch.float64)
    if values.dim() == 2:
        values = values.sum(-1)
    size = len(data_sources)
    if values.shape != (size,):
        raise ValueError(f"scores must have shape [B]={size} or [B, R], got {tuple(values.shape)}")
    infos = dict(extra_infos or {})
    for name, column in infos.items():
        if len(column) != size:
            raise ValueError(f"extra_infos[{name!r}] has {len(column)} values for {size} responses")
    rows: dict[str, list[int]] = {}
    for i, source in enumerate(data_sources):
        rows.setdefault(str(source), []).append(i)
    out: dict[str, float] = {}
    for source, index in rows.items():
        base = f"{prefix}/{source}"
        out[f"{base}/count"] = float(len(index))
        out[f"{base}/score/mean"] = float(values[index].mean())
        for name, column in infos.items():
            numbers = [float(column[i]) for i in index if _is_number(column[i])]
            if numbers:
                out[f"{base}/{name}/mean"] = math.fsum(numbers) / len(numbers)
    return out
