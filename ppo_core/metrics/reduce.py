"""Reduce lists of metric values (per micro-batch, per rank, per step) to one number per metric."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["reduce_metrics"]

logger = logging.getLogger(__name__)

_NONFINITE_POLICIES = ("warn", "raise")
"""What :func:`reduce_metrics` does with a NaN/inf value: keep it and log a warning naming it, or raise."""


def _aggregation(key: str) -> str:
    # The last path component decides: "response_length/max" takes the max, but "critic/terminal_reward" (which
    # merely contains "min") is averaged. verl's substring test would take its min.
    last = key.rsplit("/", 1)[-1]
    return last if last in ("max", "min") else "mean"


def _as_float(key: str, value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"metric {key!r} must hold numbers, got {type(value).__name__}") from exc


def reduce_metrics(
    metrics: Sequence[Mapping[str, object]] | Mapping[str, Sequence[object]],
    *,
    weights: Sequence[float] | None = None,
    return_counts: bool = False,
    nonfinite: str = "warn",
) -> dict[str, float] | tuple[dict[str, float], dict[str, int]]:
    """One value per metric: the max for keys ending in ``/max``, the min for ``/min``, else the (weighted) mean.

    Args:
        metrics: a list of ``{name: value}`` dicts (one per micro-batch or rank; a key may be missing from some),
            or a ``{name: [values]}`` dict. Values are numbers or 0-d tensors.
        weights: one non-negative weight per dict of a list (e.g. valid rows per rank,
            ``PadInfo.valid_counts``); a dict of weight 0 is ignored entirely (a rank that held only padding).
        return_counts: also return how many values each metric was reduced from.
        nonfinite: a NaN or inf value (of a dict with a positive weight) is kept, so the metric is NaN or inf as
            in verl, and a warning names each such metric and the positions of its values (``"warn"``), or
            ``ValueError`` names them (``"raise"``). Never silent: a diverged quantity should not pass unnoticed,
            but a NaN gradient norm of one skipped step should not end a run either.

    Returns:
        ``{name: value}``, without the metrics that have no value (an empty list, or only zero weights: verl
        reports NaN there), and ``{name: count}`` when ``return_counts``.

    Example:
        >>> reduce_metrics([{"loss": 1.0, "len/max": 3}, {"loss": 3.0, "len/max": 5}])
        {'loss': 2.0, 'len/max': 5.0}
        >>> reduce_metrics([{"loss": 1.0}, {"loss": 3.0}], weights=[3, 1])
        {'loss': 1.5}
    """
    if nonfinite not in _NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {', '.join(_NONFINITE_POLICIES)}, got {nonfinite!r}")
    if isinstance(metrics, Mapping):
        if weights is not None:
            raise ValueError("weights apply to a list of metric dicts, not to a dict of lists")
        entries = {key: [(_as_float(key, v), 1.0) for v in values] for key, values in metrics.items()}
    else:
        if weights is None:
            weights = [1.0] * len(metrics)
        if len(weights) != len(metrics):
            raise ValueError(f"weights has {len(weights)} entries but metrics has {len(metrics)} dicts")
        entries: dict[str, list[tuple[float, float]]] = {}
        for i, (row, weight) in enumerate(zip(metrics, weights, strict=True)):
            weight = float(weight)
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weights must be finite and >= 0, got weights[{i}] = {weight}")
            for key, value in row.items():
                entries.setdefault(key, []).append((_as_float(key, value), weight))
    reduced: dict[str, float] = {}
    counts: dict[str, int] = {}
    bad: dict[str, list[int]] = {}
    for key, pairs in entries.items():
        kept = [(v, w) for v, w in pairs if w > 0]
        if not kept:
            continue
        positions = [i for i, (v, w) in enumerate(pairs) if w > 0 and not math.isfinite(v)]
        if positions:
            bad[key] = positions
        values = np.array([v for v, _ in kept], dtype=np.float64)
        how = _aggregation(key)
        if how == "max":
            reduced[key] = float(np.max(values))
        elif how == "min":
            reduced[key] = float(np.min(values))
        else:
            w = np.array([w for _, w in kept], dtype=np.float64)
            reduced[key] = float(np.sum(values * w) / np.sum(w))
        counts[key] = len(kept)
    if bad:
        listed = "; ".join(f"{key!r} at value(s) {positions}" for key, positions in bad.items())
        message = f"non-finite metric values (NaN or inf): {listed}"
        if nonfinite == "raise":
            raise ValueError(message)
        logger.warning("%s; the reduced metrics are not finite", message)
    return (reduced, counts) if return_counts else reduced
