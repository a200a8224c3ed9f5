"""Per-step data metrics of a PPO batch (scores, rewards, advantages, returns, values, lengths), verl names.

Every statistic is masked: token-level tensors use ``response_mask`` through :mod:`ppo_core.masked`, and sequence
scores skip aborted rows (response length 0). A metric with no valid entry at all (an empty batch, every row
aborted, no valid token) is reported as ``0.0``, never NaN, like :func:`ppo_core.masked.masked_mean`; the count
metrics (``response/aborted_ratio``, ``response_length/*``) tell such steps apart from real zeros. A NaN or inf that
would reach a metric (a NaN score from a broken reward function) raises ``ValueError`` naming the key instead.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase, is_non_tensor

from ppo_core._checks import check_all_finite, check_floating
from ppo_core.batch._td import _field_values
from ppo_core.batch.validate import validate_batch
from ppo_core.keys import KEYS
from ppo_core.masked import masked_mean, masked_var
from ppo_core.metrics._lengths import _Lengths, _lengths

__all__ = ["VF_EXPLAINED_VAR_EPS", "compute_data_metrics"]

VF_EXPLAINED_VAR_EPS = 1e-5
"""Added to ``Var(returns)`` in the explained variance (verl's value)."""
_ROW_SUM_KEYS = ("token_level_scores", "token_level_rewards")


def _extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> float:
    # ppo_core.masked has no max/min: fill masked entries with the identity of the reduction instead.
    if not bool(mask.any()):
        return 0.0
    fill = torch.tensor(float("-inf") if largest else float("inf"), dtype=values.dtype)
    filled = torch.where(mask, values, fill)
    return float(filled.max() if largest else filled.min())


def _stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    values = values.to(torch.float64)
    return {
        f"{prefix}/mean": float(masked_mean(values, mask)),
        f"{prefix}/max": _extreme(values, mask, largest=True),
        f"{prefix}/min": _extreme(values, mask, largest=False),
    }


def _length_metrics(lengths: _Lengths, max_prompt_length: int | None = None) -> dict[str, float]:
    """``response_length/*``, ``response_length_non_aborted/*``, ``response/aborted_ratio`` and, with prompt
    lengths, ``prompt_length/*`` of a batch's lengths (``prompt_length/clip_ratio`` with ``max_prompt_length``)."""
    non_aborted = lengths.response > 0
    all_rows = torch.ones_like(non_aborted)
    clipped = (lengths.response == lengths.response_width).to(torch.float64)
    metrics = _stats("response_length", lengths.response, all_rows)
    metrics["response_length/clip_ratio"] = float(masked_mean(clipped, all_rows))
    metrics |= _stats("response_length_non_aborted", lengths.response, non_aborted)
    metrics["response_length_non_aborted/clip_ratio"] = float(masked_mean(clipped, non_aborted))
    metrics["response/aborted_ratio"] = float(masked_mean((~non_aborted).to(torch.float64), all_rows))
    if lengths.prompt is not None:
        metrics |= _stats("prompt_length", lengths.prompt, all_rows)
        if (
            max_prompt_length is not None
        ):  # at the cap; a batch's own width is its longest prompt, not the cap
            prompt_clipped = (lengths.prompt >= max_prompt_length).to(torch.float64)
            metrics["prompt_length/clip_ratio"] = float(masked_mean(prompt_clipped, all_rows))
    return metrics


def _explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    if int(mask.sum()) < 2:
        return 0.0  # the unbiased variance needs two valid tokens; verl returns NaN here
    returns, values = returns.to(torch.float64), values.to(torch.float64)
    var_residual = masked_var(returns - values, mask)
    var_returns = masked_var(returns, mask)
    return float(1.0 - var_residual / (var_returns + VF_EXPLAINED_VAR_EPS))


def _check_finite(batch: TensorDictBase, keys: list[str], mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the key if a value that enters a metric is NaN or inf (one host sync).

    Scores and rewards enter through the sums over all positions of rows with a response, the other keys at valid
    tokens; what is masked out (padding, aborted rows) may hold anything.
    """
    named = {}
    for key in keys:
        values = batch.get(key)
        where = rows.unsqueeze(-1).expand_as(mask) if key in _ROW_SUM_KEYS else mask
        named[key] = torch.where(where, values, torch.zeros((), dtype=values.dtype, device=values.device))
    check_all_finite(
        named, purpose="data metrics would be NaN (a broken reward function or a diverged critic?)"
    )


def compute_data_metrics(
    batch: TensorDictBase, use_critic: bool = True, max_prompt_length: int | None = None
) -> dict[str, float]:
    """Scalar metrics of a training batch, under verl's names.

    Batch keys (``B`` rows, ``T`` response tokens):
        ``response_mask`` ``[B, T]``; ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``
        ``[B, T]`` floats; ``values`` ``[B, T]`` when ``use_critic``; optional ``attention_mask`` ``[B, P + T]``
        (lengths then count every attended token, tool tokens included) and ``__num_turns__``
        ``[B]`` (tensor or non-tensor field).

    Returns:
        ``critic/score/{mean,max,min}`` and ``critic/rewards/{mean,max,min}`` over the row sums (all ``T``
        positions, as in verl) of non-aborted rows; ``critic/advantages/*``, ``critic/returns/*`` and, with a
        critic, ``critic/values/*`` over valid tokens; ``critic/vf_explained_var = 1 - Var(R - V) / (Var(R) +
        1e-5)`` (unbiased, valid tokens; 0.0 with fewer than two); ``response_length/{mean,max,min,clip_ratio}``
        over all rows (clip: length == ``T``); ``response_length_non_aborted/*``; ``response/aborted_ratio``;
        ``prompt_length/{mean,max,min}`` with an attention mask, and ``prompt_length/clip_ratio`` with
        ``max_prompt_length`` too (the share of prompts of at least that length: cut to the cap; verl's "length ==
        ``P``" counts the same where prompts are padded to the cap, but a batch padded to its longest prompt would
        count that prompt);
        ``num_turns/{min,max,mean}`` with ``__num_turns__``. Masked positions (NaN or inf included) never reach
        a token-level metric, and no metric is NaN because of masking.

    Raises:
        ValueError: NaN or inf where it would reach a metric (a score or reward of a row with a response, an
            advantage, return or value at a valid token), naming the key and the first position.

    Example:
        >>> from tensordict import TensorDict
        >>> m = torch.tensor([[1, 1, 0], [0, 0, 0]])
        >>> r = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
        >>> b = TensorDict(dict(response_mask=m, token_level_scores=r, token_level_rewards=r,
        ...     advantages=r, returns=r, values=r), batch_size=[2])
        >>> out = compute_data_metrics(b)
        >>> out["critic/score/mean"], out["response/aborted_ratio"], out["response_length/mean"]
        (2.0, 0.5, 1.0)
    """
    token_keys = [
        KEYS.response_mask,
        KEYS.token_level_scores,
        KEYS.token_level_rewards,
        KEYS.advantages,
        KEYS.returns,
    ]
    if use_critic:
        token_keys.append(KEYS.values)
    validate_batch(batch, token_keys=token_keys)
    for key in token_keys[1:]:
        check_floating(key, batch.get(key))
    lengths = _lengths(batch)
    mask = batch.get(KEYS.response_mask) != 0
    non_aborted = lengths.response > 0
    _check_finite(batch, token_keys[1:], mask, non_aborted)

    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", batch.get(KEYS.token_level_scores).sum(-1), non_aborted)
    metrics |= _stats("critic/rewards", batch.get(KEYS.token_level_rewards).sum(-1), non_aborted)
    metrics |= _stats("critic/advantages", batch.get(KEYS.advantages), mask)
    metrics |= _stats("critic/returns", batch.get(KEYS.returns), mask)
    if use_critic:
        metrics |= _stats("critic/values", batch.get(KEYS.values), mask)
        metrics["critic/vf_explained_var"] = _explained_variance(
            batch.get(KEYS.returns), batch.get(KEYS.values), mask
        )

    metrics |= _length_metrics(lengths, max_prompt_length)
    if KEYS.num_turns in batch:
        turns = batch.get(KEYS.num_turns)
        if is_non_tensor(turns):
            turns = torch.tensor(
                [float(t) for t in _field_values(batch, KEYS.num_turns)], dtype=torch.float64
            )
        turns = turns.reshape(-1).to(torch.float64)
        stats = _stats("num_turns", turns, torch.ones_like(turns, dtype=torch.bool))
        metrics |= {k: stats[k] for k in ("num_turns/min", "num_turns/max", "num_turns/mean")}
    return metrics
