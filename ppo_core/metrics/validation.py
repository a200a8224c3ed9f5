"""Validation metrics over several responses per prompt: mean@N, std@N, best@N, worst@N and maj@N.

For every data source, prompt (``uid``) and numeric variable (``reward``, ``acc``...), with ``n`` responses:
``mean@n``; if ``n > 1`` also ``std@n`` (population) and, for every ``N`` in ``2, 4, 8, ... < n`` and ``N = n``,
bootstrap estimates of the best (max) and worst (min) of ``N`` responses drawn with replacement
(``best@N/mean``, ``best@N/std``, ``worst@N/...``) and, when a ``pred`` variable holds the answers, of the
majority-vote value (``maj@N/...``). Each metric is then averaged over the prompts that produced it: prompts with
different ``n`` produce different ``mean@n`` names and share the smaller ``best@N`` ones (as in verl).
Note that ``best@N`` at ``N = n`` resamples with replacement, so it is ``~1 - (1 - p)^n``, not an unbiased pass@n.

Randomness: a local ``numpy.random.Generator`` per (data source, uid, variable, N), seeded from ``seed`` and a
stable hash of those names, so results do not depend on the order of prompts and the global NumPy RNG is never
touched (verl reseeds it with 42 on every call).

Majority vote tie-break: among the answers with the most votes, the one that appears first wins, and its value is
that of its first occurrence (verl's behaviour: votes ``B, A, A, B`` give the first ``B``'s value).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

__all__ = [
    "VOTE_KEY",
    "bootstrap",
    "flatten_validation_metrics",
    "majority_vote",
    "process_validation_metrics",
]

VOTE_KEY = "pred"
"""Variable of ``infos`` holding the answer each response votes for (used by ``maj@N``, never reported)."""


def majority_vote(votes: Sequence[Hashable], values: Sequence[float]) -> float:
    """Value of the majority answer: the most frequent vote, ties to the vote seen first; its first value.

    Args:
        votes: ``[n]`` hashable answers, ``n >= 1``.
        values: ``[n]`` numbers (e.g. correctness of each response).

    Example:
        >>> majority_vote(["B", "A", "A", "B"], [0.1, 0.2, 0.3, 0.4])
        0.1
    """
    if len(votes) != len(values) or not votes:
        raise ValueError(
            f"votes and values must be non-empty and of equal length, got {len(votes)}, {len(values)}"
        )
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, float] = {}
    for vote, value in zip(votes, values, strict=True):
        counts[vote] = counts.get(vote, 0) + 1
        first.setdefault(vote, float(value))
    best = max(counts.values())
    winner = next(vote for vote in counts if counts[vote] == best)  # dicts keep first-seen order
    return first[winner]


def _majority_values(codes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """:func:`majority_vote` of every row of ``codes``/``values`` (``[R, N]``, codes ``0..K-1``), vectorized."""
    rows, size = codes.shape
    n_codes = int(codes.max()) + 1
    row_ids = np.repeat(np.arange(rows), size)
    counts = np.zeros((rows, n_codes), dtype=np.int64)
    np.add.at(counts, (row_ids, codes.ravel()), 1)
    first_pos = np.full((rows, n_codes), size, dtype=np.int64)
    np.minimum.at(first_pos, (row_ids, codes.ravel()), np.tile(np.arange(size), rows))
    is_top = counts == counts.max(axis=1, keepdims=True)
    winner_pos = np.where(is_top, first_pos, size).min(axis=1)
    return values[np.arange(rows), winner_pos]


def bootstrap(
    data: Sequence[float] | np.ndarray,
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], np.ndarray]],
    n_bootstrap: int = 1000,
    rng: np.random.Generator | None = None,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """Mean and population std of statistics over ``n_bootstrap`` resamples (with replacement) of ``data``.

    Args:
        data: ``[n]`` numbers, ``n >= 1``.
        subset_size: size ``N`` of each resample.
        reduce_fns: functions from the ``[n_bootstrap, N]`` resamples to ``[n_bootstrap]`` statistics, e.g.
            ``lambda x: x.max(axis=1)``; all see the same resamples.
        n_bootstrap: number of resamples.
        rng: the generator to draw from; by default a fresh ``numpy.random.default_rng(seed)`` (never the
            global RNG).
        seed: seed of the default generator.

    Returns:
        ``[(mean, std)]``, one pair per function.

    Example:
        >>> (best_mean, best_std), = bootstrap([0.0, 1.0], 2, [lambda x: x.max(axis=1)], n_bootstrap=20000)
        >>> abs(best_mean - 0.75) < 0.02  # P(max of 2 draws = 1) = 1 - 0.5**2
        True
    """
    values = np.asarray(data, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"data must be a non-empty 1-D sequence, got shape {values.shape}")
    if subset_size < 1 or n_bootstrap < 1:
        raise ValueError(f"subset_size and n_bootstrap must be >= 1, got {subset_size} and {n_bootstrap}")
    rng = rng if rng is not None else np.random.default_rng(seed)
    samples = values[rng.integers(0, values.size, size=(n_bootstrap, subset_size))]
    out = []
    for fn in reduce_fns:
        stats = np.asarray(fn(samples), dtype=np.float64)
        out.append((float(stats.mean()), float(stats.std())))
    return out


def _stable_hash(obj: object) -> int:
    # Python's hash() of str is salted per process; a digest of repr() is reproducible across runs.
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:4], "little")


def _numeric(values: Sequence[object]) -> np.ndarray | None:
    out = []
    for v in values:
        if isinstance(v, (str, bytes)):
            return None
        try:
            out.append(float(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    return np.asarray(out, dtype=np.float64)


def _subset_sizes(n: int) -> list[int]:
    sizes, size = [], 2
    while size < n:
        sizes.append(size)
        size *= 2
    return [*sizes, n]


def _uid_metrics(
    values: np.ndarray, votes: list | None, seed_parts: list[int], n_bootstrap: int
) -> dict[str, float]:
    n = values.size
    out = {f"mean@{n}": float(values.mean())}
    if n == 1:
        return out
    out[f"std@{n}"] = float(values.std())
    codes = None
    if votes is not None:
        index: dict[Hashable, int] = {}
        codes = np.array([index.setdefault(v, len(index)) for v in votes], dtype=np.int64)
    for size in _subset_sizes(n):
        rng = np.random.default_rng([*seed_parts, size])
        picks = rng.integers(0, n, size=(n_bootstrap, size))
        samples = values[picks]
        for name, stats in (("best", samples.max(axis=1)), ("worst", samples.min(axis=1))):
            out[f"{name}@{size}/mean"], out[f"{name}@{size}/std"] = float(stats.mean()), float(stats.std())
        if codes is not None:
            maj = _majority_values(codes[picks], samples)
            out[f"maj@{size}/mean"], out[f"maj@{size}/std"] = float(maj.mean()), float(maj.std())
    return out


def process_validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    infos: Mapping[str, Sequence[object]],
    *,
    seed: int = 42,
    n_bootstrap: int = 1000,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per data source and variable, the mean@N / std@N / best@N / worst@N / maj@N metrics (see module doc).

    Args:
        data_sources: ``[S]`` data source of every response.
        uids: ``[S]`` prompt id of every response (responses of one prompt share it; any hashable).
        infos: ``{variable: [S] values}``; numeric variables (bools, ints, floats, 0-d tensors) are reported,
            others (strings) skipped; ``"pred"`` is the vote of ``maj@N`` and is not reported itself.
        seed: seed of the local generators (the global NumPy RNG is never used).
        n_bootstrap: resamples per bootstrap estimate.

    Returns:
        ``{data_source: {variable: {metric: value}}}``, each value the mean over the prompts that produced the
        metric. Empty input gives ``{}``: the caller has nothing to log, which is not an error.

    Example:
        >>> out = process_validation_metrics(["gsm8k"] * 2, ["u1", "u1"], {"acc": [1.0, 0.0]}, n_bootstrap=100)
        >>> out["gsm8k"]["acc"]["mean@2"]
        0.5
    """
    size = len(data_sources)
    if len(uids) != size:
        raise ValueError(f"uids has {len(uids)} entries but data_sources has {size}")
    for var, values in infos.items():
        if len(values) != size:
            raise ValueError(f"infos[{var!r}] has {len(values)} entries but data_sources has {size}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be >= 1, got {n_bootstrap}")
    groups: dict[tuple[str, Hashable], list[int]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault((source, uid), []).append(i)

    sums: dict[str, dict[str, dict[str, list[float]]]] = {}
    for (source, uid), rows in groups.items():
        votes = [infos[VOTE_KEY][i] for i in rows] if VOTE_KEY in infos else None
        for var, all_values in infos.items():
            if var == VOTE_KEY:
                continue
            values = _numeric([all_values[i] for i in rows])
            if values is None:
                continue
            seed_parts = [seed, _stable_hash(source), _stable_hash(uid), _stable_hash(var)]
            for metric, value in _uid_metrics(values, votes, seed_parts, n_bootstrap).items():
                sums.setdefault(source, {}).setdefault(var, {}).setdefault(metric, []).append(value)
    return {
        source: {
            var: {m: math.fsum(v) / len(v) for m, v in metrics.items()} for var, metrics in per_var.items()
        }
        for source, per_var in sums.items()
    }


def flatten_validation_metrics(
    metrics: Mapping[str, Mapping[str, Mapping[str, float]]], core_var: str | None = None
) -> dict[str, float]:
    """Flat logging names for :func:`process_validation_metrics` output, split into ``val-core`` and ``val-aux``.

    A metric goes to ``val-core/{source}/{var}/{metric}`` when ``var`` is the core variable (``core_var``, else
    ``"acc"`` if the source has it, else ``"reward"``), the metric starts with ``mean``, ``maj`` or ``best``, and
    it is at the largest ``N`` of that variable; everything else goes to ``val-aux/...`` (verl's split).

    Example:
        >>> flatten_validation_metrics({"ds": {"acc": {"mean@2": 0.5, "mean@1": 1.0}}})
        {'val-core/ds/acc/mean@2': 0.5, 'val-aux/ds/acc/mean@1': 1.0}
    """
    flat: dict[str, float] = {}
    for source, per_var in metrics.items():
        core = core_var or ("acc" if "acc" in per_var else "reward")
        for var, per_metric in per_var.items():
            n_max = max((int(m.split("@")[-1].split("/")[0]) for m in per_metric if "@" in m), default=0)
            for metric, value in per_metric.items():
                is_core = (
                    var == core
                    and metric.startswith(("mean", "maj", "best"))
                    and "@" in metric
                    and int(metric.split("@")[-1].split("/")[0]) == n_max
                )
                flat[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{metric}"] = value
    return flat
