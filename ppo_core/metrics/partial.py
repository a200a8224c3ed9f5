"""``compute_data_metrics`` from per-shard parts: each data-parallel rank reduces its rows, the controller combines.

A rank holding rows of the step's batch calls :func:`data_metric_parts`: its ``[b]`` row columns (score and reward
row sums, prompt and response lengths: ``O(b)``, kept whole so that the row statistics are the by-value ones bit for
bit) and, for every token-level key, the valid count, sum, minimum and maximum plus the float64 moments the explained
variance needs. :func:`reduce_data_metric_parts` combines the ranks' parts (in dp order) into the metrics
:func:`~ppo_core.metrics.compute_data_metrics` gives on the whole batch: the row statistics exactly, the token
statistics up to the order of their float64 sums (within 1e-12 relative). No ``[B, T]`` tensor reaches the caller.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from ppo_core.metrics import compute_data_metrics
    >>> m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> r = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    >>> b = TensorDict(dict(response_mask=m, token_level_scores=r, token_level_rewards=r,
    ...     advantages=r, returns=r), batch_size=[2])
    >>> parts = [data_metric_parts(b[:1], use_critic=False), data_metric_parts(b[1:], use_critic=False)]
    >>> reduce_data_metric_parts(parts, use_critic=False) == compute_data_metrics(b, use_critic=False)
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.keys import KEYS
from ppo_core.masked_moments import Moments, combine_moments, masked_moments
from ppo_core.metrics._lengths import _Lengths, _lengths
from ppo_core.metrics.data import VF_EXPLAINED_VAR_EPS, _check_finite, _length_metrics, _stats

__all__ = [
    "DataMetricParts",
    "TokenStats",
    "combine_token_stats",
    "data_metric_parts",
    "lengths_of_parts",
    "reduce_data_metric_parts",
    "token_stats",
]

_TOKEN_KEYS = (KEYS.advantages, KEYS.returns)


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """Count, float64 sum, minimum and maximum of a key over one shard's valid tokens (min/max 0 when none)."""

    count: int
    total: float
    low: float
    high: float


@dataclasses.dataclass(frozen=True)
class DataMetricParts:
    """One shard's contribution to the data metrics (see the module docstring).

    ``rows``: ``[b]`` columns ``score`` and ``reward`` (row sums over all positions, in the keys' dtype),
    ``response`` and, with an attention mask, ``prompt`` (int32 lengths); ``widths``: ``(T, P or None)``; ``tokens``: :class:`TokenStats` per
    token-level key; ``returns`` / ``residual``: moments of ``returns`` and ``returns - values`` (with a critic).
    """

    rows: TensorDictBase
    widths: tuple[int, int | None]
    tokens: dict[str, TokenStats]
    returns: Moments | None = None
    residual: Moments | None = None


def token_stats(values: torch.Tensor, mask: torch.Tensor) -> TokenStats:
    """:class:`TokenStats` of ``values`` (any shape, accumulated in float64) where ``mask`` (bool, same shape) is
    true."""
    count = int(mask.sum())
    if count == 0:
        return TokenStats(count=0, total=0.0, low=0.0, high=0.0)
    acc = values.to(torch.float64)
    total = float(torch.where(mask, acc, torch.zeros((), dtype=torch.float64)).sum())
    low = float(torch.where(mask, acc, torch.full((), float("inf"), dtype=torch.float64)).min())
    high = float(torch.where(mask, acc, torch.full((), float("-inf"), dtype=torch.float64)).max())
    return TokenStats(count=count, total=total, low=low, high=high)


def data_metric_parts(batch: TensorDictBase, use_critic: bool = True) -> DataMetricParts:
    """One shard's :class:`DataMetricParts` (keys as :func:`~ppo_core.metrics.compute_data_metrics` reads them;
    ``[b, T]`` in, ``O(b)`` out). NaN or inf that would reach a metric raises ``ValueError`` naming the key."""
    token_keys = [KEYS.token_level_scores, KEYS.token_level_rewards, *_TOKEN_KEYS]
    if use_critic:
        token_keys.append(KEYS.values)
    for key in token_keys:
        if key not in batch:
            raise KeyError(f"data metrics need {key!r}; the batch holds {sorted(batch.keys())}")
    lengths = _lengths(batch)
    mask = batch.get(KEYS.response_mask) != 0
    _check_finite(batch, token_keys, mask, lengths.response > 0)
    # compact: the row sums in their own dtype (the metrics widen them to float64, as on the whole batch), the
    # lengths (whole numbers) as int32
    columns = {
        "score": batch.get(KEYS.token_level_scores).sum(-1),
        "reward": batch.get(KEYS.token_level_rewards).sum(-1),
        "response": lengths.response.to(torch.int32),
    }
    if lengths.prompt is not None:
        columns["prompt"] = lengths.prompt.to(torch.int32)
    rows = TensorDict(columns, batch_size=[int(batch.batch_size[0])])
    keys = [*_TOKEN_KEYS, KEYS.values] if use_critic else list(_TOKEN_KEYS)
    tokens = {key: token_stats(batch.get(key), mask) for key in keys}
    returns = residual = None
    if use_critic:
        ret, val = batch.get(KEYS.returns).to(torch.float64), batch.get(KEYS.values).to(torch.float64)
        returns, residual = masked_moments(ret, mask), masked_moments(ret - val, mask)
    return DataMetricParts(
        rows=rows,
        widths=(lengths.response_width, lengths.prompt_width),
        tokens=tokens,
        returns=returns,
        residual=residual,
    )


def combine_token_stats(parts: Sequence[TokenStats]) -> TokenStats:
    """The :class:`TokenStats` of the union of disjoint shards: counts added, totals summed exactly rounded
    (:func:`math.fsum`, independent of the shards' order), the extremes of the shards holding entries."""
    held = [p for p in parts if p.count]
    if not held:
        return TokenStats(count=0, total=0.0, low=0.0, high=0.0)
    return TokenStats(
        count=sum(p.count for p in held),
        total=math.fsum(p.total for p in held),
        low=min(p.low for p in held),
        high=max(p.high for p in held),
    )


def lengths_of_parts(parts: Sequence[DataMetricParts]) -> _Lengths:
    """The batch's prompt and response lengths (for the timing and throughput metrics), from the parts in dp order."""
    if not parts:
        raise ValueError("no data metric parts to reduce")
    rows = torch.cat([p.rows for p in parts], dim=0)
    width, prompt_width = parts[0].widths
    prompt = rows.get("prompt").to(torch.float64) if "prompt" in rows else None
    return _Lengths(rows.get("response").to(torch.float64), width, prompt, prompt_width)


def _token_metrics(prefix: str, stats: Sequence[TokenStats]) -> dict[str, float]:
    held = [s for s in stats if s.count]
    count = sum(s.count for s in held)
    return {
        f"{prefix}/mean": sum(s.total for s in held) / count if count else 0.0,
        f"{prefix}/max": max((s.high for s in held), default=0.0),
        f"{prefix}/min": min((s.low for s in held), default=0.0),
    }


def reduce_data_metric_parts(
    parts: Sequence[DataMetricParts], use_critic: bool = True, max_prompt_length: int | None = None
) -> dict[str, float]:
    """:func:`~ppo_core.metrics.compute_data_metrics` of the batch the ``parts`` (in dp order) were cut from.

    ``num_turns/*`` is not part of it (the trainer adds it from the prompts' field when they carry one).
    """
    lengths = lengths_of_parts(parts)
    rows = torch.cat([p.rows for p in parts], dim=0)
    non_aborted = lengths.response > 0
    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", rows.get("score"), non_aborted)
    metrics |= _stats("critic/rewards", rows.get("reward"), non_aborted)
    metrics |= _token_metrics("critic/advantages", [p.tokens[KEYS.advantages] for p in parts])
    metrics |= _token_metrics("critic/returns", [p.tokens[KEYS.returns] for p in parts])
    if use_critic:
        metrics |= _token_metrics("critic/values", [p.tokens[KEYS.values] for p in parts])
        returns = combine_moments([p.returns for p in parts])
        residual = combine_moments([p.residual for p in parts])
        metrics["critic/vf_explained_var"] = (
            0.0 if returns.count < 2 else 1.0 - residual.var() / (returns.var() + VF_EXPLAINED_VAR_EPS)
        )
    return metrics | _length_metrics(lengths, max_prompt_length)
