"""Calling the reward function: sync or async results, normalisation to token-level scores, errors with context.

A reward function takes the step's batch (a TensorDict with ``prompts``, ``responses``, ``response_mask``,
``attention_mask`` and the non-tensor ``uid``, ``data_source``, ``ground_truth``) and returns one of

- a ``[B, R]`` tensor of token-level scores,
- a ``[B]`` tensor (or list) of sequence scores, placed at each response's last valid token,
- a pair ``(scores, extra_infos)`` where ``extra_infos`` maps names to ``B`` per-sample values (logged in
  validation as ``val-*/{data_source}/{name}/...``); an empty or missing dict logs nothing extra,
- a ``concurrent.futures.Future`` or an awaitable resolving to any of the above. It is started right after
  generation and awaited just before the advantages, so it overlaps with the log-prob and value passes (the
  path the seed PR left raising ``NameError``).

Scores must be finite: NaN or inf, like an exception inside the function or an unusable result, raises
:class:`RewardFunctionError` naming the function, the step and the uids of the offending samples, here at the reward
boundary rather than later in the advantage estimator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.rewards.reward_fn import scorer_name as callable_name

__all__ = ["PendingReward", "RewardFunctionError", "call_reward_fn", "scores_to_token_level"]

RewardFn = Callable[[TensorDictBase], Any]


class RewardFunctionError(RuntimeError):
    """The reward function raised, or returned something unusable (wrong shape, NaN or inf scores).

    The message names the function, the step and the sample batch (its uids). Attributes: ``step`` (the global
    step), ``batch`` (the TensorDict the function was called with), ``reward_fn`` (the function's name, or None).
    """

    def __init__(self, step: int, batch: TensorDictBase, message: str, reward_fn: str | None = None) -> None:
        who = "reward function" if reward_fn is None else f"reward function {reward_fn}"
        super().__init__(f"{who} failed at step {step} on {describe_batch(batch)}: {message}")
        self.step = step
        self.batch = batch
        self.reward_fn = reward_fn


def describe_batch(batch: TensorDictBase) -> str:
    """A one-line description of a batch: size, keys and the first few uids."""
    size = int(batch.batch_size[0]) if batch.batch_dims else 0
    text = f"a batch of {size} samples (keys: {', '.join(sorted(str(k) for k in batch.keys()))})"  # noqa: SIM118 (iterating a TensorDict yields rows)
    if "uid" in batch:
        text += f", uids [{_shown(list(batch.get('uid').tolist()))}]"
    return text


def _shown(items: list, limit: int = 4) -> str:
    return ", ".join(str(u) for u in items[:limit]) + (", ..." if len(items) > limit else "")


def _check_finite_scores(scores: torch.Tensor, uids: Sequence | None) -> None:
    """Raise ``ValueError`` naming the rows (and their uids) whose scores hold NaN or inf."""
    bad = ~torch.isfinite(scores)
    if not bool(bad.any()):
        return
    rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
    kind = "NaN" if bool(torch.isnan(scores).any()) else "inf"
    which = f"rows [{_shown(rows, 8)}]"
    if uids is not None:
        which = f"uids [{_shown([uids[i] for i in rows], 8)}] ({which})"
    raise ValueError(
        f"reward scores hold {kind} for {len(rows)} of {scores.shape[0]} samples: {which}; a reward must be finite"
    )


def scores_to_token_level(
    scores: Any, response_mask: torch.Tensor, uids: Sequence | None = None
) -> torch.Tensor:
    """Token-level ``[B, R]`` float32 scores from ``[B, R]`` scores or ``[B]`` sequence scores.

    Sequence scores go to the last valid token of each response (``response_mask`` ``[B, R]``); a response
    with no valid token gets nothing. A NaN or inf score (at any position, valid or not) raises ``ValueError``
    naming the rows, and their ``uids`` when given: a reward function that returns NaN is broken, and the NaN would
    otherwise surface later as an error about the advantage estimator's "rewards".

    Example:
        >>> scores_to_token_level([1.0, 2.0], torch.tensor([[1, 1, 0], [1, 1, 1]]))
        tensor([[0., 1., 0.],
                [0., 0., 2.]])
    """
    mask = response_mask.bool()
    bsz, width = mask.shape
    device = mask.device
    scores = torch.as_tensor(scores, dtype=torch.float32, device=device)
    if scores.shape not in ((bsz, width), (bsz,)):
        raise ValueError(
            f"reward scores must have shape [B]={bsz} or [B, R]=({bsz}, {width}), got {tuple(scores.shape)}"
        )
    _check_finite_scores(scores, uids)
    if scores.shape == (bsz, width):
        return scores
    out = torch.zeros(bsz, width, dtype=torch.float32, device=device)
    if out.numel() == 0:  # max() below cannot reduce a zero-width row
        return out
    lengths = mask.long().sum(-1)
    # last valid position = highest index with mask 1 (masks may have interior gaps in multi-turn data)
    positions = torch.arange(width, device=device).expand(bsz, width)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(-1).values
    has = lengths > 0
    out[has.nonzero().flatten(), last[has]] = scores[has]
    return out


def _normalize(
    result: Any, batch: TensorDictBase, width: int | None = None
) -> tuple[torch.Tensor, dict[str, list]]:
    """``(scores, extra_infos)``: token-level ``[B, R]`` scores (``width`` None: placed with the batch's response
    mask), or, with ``width`` = R, the scores as returned (``[B]`` or ``[B, R]`` float32, checked, not placed: a
    resident step places them at the ranks holding the mask)."""
    extra: Mapping[str, Sequence] | None = None
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ValueError(f"a tuple result must be (scores, extra_infos), got {len(result)} items")
        result, extra = result
    uids = list(batch.get("uid").tolist()) if "uid" in batch else None
    size = int(batch.batch_size[0])
    if result is None or isinstance(result, (str, bytes, Mapping)):
        raise TypeError(
            f"the reward function returned {type(result).__name__}; it returns the scores of the {size} responses "
            "([B] or token-level [B, R] numbers: a tensor, array or list), or (scores, extra_infos)"
        )
    if width is None:
        token_scores = scores_to_token_level(result, batch["response_mask"], uids)
    else:
        token_scores = torch.as_tensor(result, dtype=torch.float32)
        if token_scores.shape not in ((size, width), (size,)):
            raise ValueError(
                f"reward scores must have shape [B]={size} or [B, R]=({size}, {width}), got "
                f"{tuple(token_scores.shape)}"
            )
        _check_finite_scores(token_scores, uids)
    infos: dict[str, list] = {}
    for key, values in (extra or {}).items():
        values = list(values.tolist() if hasattr(values, "tolist") else values)
        if len(values) != size:
            raise ValueError(f"extra info {key!r} has {len(values)} values for {size} samples")
        infos[str(key)] = values
    return token_scores, infos


async def _await(awaitable: Any) -> Any:
    return await awaitable


class PendingReward:
    """A reward that may still be computing; :meth:`result` returns ``(token_scores [B, R], extra_infos)``."""

    def __init__(
        self,
        step: int,
        batch: TensorDictBase,
        value: Any,
        executor: concurrent.futures.Executor,
        reward_fn: str | None = None,
        width: int | None = None,
    ) -> None:
        self.step, self.batch, self.reward_fn, self.width = step, batch, reward_fn, width
        if inspect.isawaitable(value):
            # a coroutine runs on its own event loop in a worker thread, concurrently with the controller
            value = executor.submit(asyncio.run, _await(value))
        self._value = value

    def result(self) -> tuple[torch.Tensor, dict[str, list]]:
        """Wait for the reward and normalise it; errors (NaN/inf scores included) become :class:`RewardFunctionError`."""
        try:
            value = (
                self._value.result() if isinstance(self._value, concurrent.futures.Future) else self._value
            )
            return _normalize(value, self.batch, self.width)
        except Exception as exc:
            raise RewardFunctionError(
                self.step, self.batch, f"{type(exc).__name__}: {exc}", self.reward_fn
            ) from exc


def call_reward_fn(
    reward_fn: RewardFn,
    batch: TensorDictBase,
    step: int,
    executor: concurrent.futures.Executor,
    width: int | None = None,
) -> PendingReward:
    """Call ``reward_fn(batch)`` and wrap what it returns (value, Future or awaitable) in a :class:`PendingReward`
    (``width``: the response width R; the scores are then checked but not placed, see :func:`_normalize`)."""
    name = callable_name(reward_fn)
    try:
        value = reward_fn(batch)
    except Exception as exc:
        raise RewardFunctionError(step, batch, f"{type(exc).__name__}: {exc}", name) from exc
    return PendingReward(step, batch, value, executor, name, width)
