"""The batch a rollout engine returns (verl's layout), assembled from the prompts and the sampled responses."""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core._checks import check_ndim, check_tensor
from ppo_core.keys import KEYS

__all__ = ["check_rollout_output", "rollout_batch"]


def rollout_batch(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None = None,
) -> TensorDict:
    """``prompts``, ``responses``, ``input_ids`` (prompt then response), ``attention_mask``, ``response_mask`` and,
    when given, ``rollout_log_probs``, as one ``TensorDict`` of batch size ``[B]`` (keys from :data:`KEYS`).

    Args:
        prompts: ``[B, P]`` left-padded prompt ids; prompt_mask: ``[B, P]`` 1 on prompt tokens.
        responses: ``[B, R]`` right-padded response ids; response_mask: ``[B, R]`` 1 on response tokens.
        rollout_log_probs: ``[B, R]`` log-probs of the sampled tokens under the sampling distribution.

    Example:
        >>> out = rollout_batch(torch.tensor([[0, 5]]), torch.tensor([[0, 1]]), torch.tensor([[6, 2]]),
        ...                     torch.tensor([[1, 0]]))
        >>> out["input_ids"].tolist(), out["attention_mask"].tolist()
        ([[0, 5, 6, 2]], [[0, 1, 1, 0]])
    """
    for name, value in (("prompts", prompts), ("responses", responses)):
        check_ndim(name, check_tensor(name, value), 2)
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"prompts has {prompts.shape[0]} rows but responses has {responses.shape[0]}")
    out = {
        KEYS.prompts: prompts,
        KEYS.responses: responses,
        KEYS.input_ids: torch.cat([prompts, responses], dim=1),
        KEYS.attention_mask: torch.cat([prompt_mask, response_mask], dim=1),
        KEYS.response_mask: response_mask,
    }
    if rollout_log_probs is not None:
        out[KEYS.rollout_log_probs] = rollout_log_probs
    return TensorDict(out, batch_size=[prompts.shape[0]])


logger = logging.getLogger(__name__)

_WARNED_FLOAT_MASK: set[str] = set()
"""Engines already told that their float response mask is read as an integer one (once each)."""

_OUTPUT_KEYS = (KEYS.prompts, KEYS.responses, KEYS.input_ids, KEYS.attention_mask, KEYS.response_mask)
"""What every rollout engine returns; ``rollout_log_probs`` is checked where given (the trainer asks for it where a
setting needs it: ``rollout.old_log_probs_from_rollout``, the rollout correction's bypass mode)."""


def check_rollout_output(out: object, rows: int, max_new_tokens: int, engine: str) -> TensorDictBase:
    """``out``, what rollout engine ``engine`` returned for ``rows`` prompts, if it has the layout of
    :class:`~ppo_core.rollout.engine.RolloutEngine` (shapes and dtypes only: no device sync); else a ``TypeError``
    or ``ValueError`` naming the engine and what is wrong. Without it a response one column too wide (its mask and
    log-probs too) trains on positions that are not the sampled tokens'.

    Example:
        >>> out = rollout_batch(torch.tensor([[0, 5]]), torch.tensor([[0, 1]]), torch.tensor([[6, 2]]),
        ...                     torch.tensor([[1, 0]]), torch.zeros(1, 2))
        >>> check_rollout_output(out, 1, 2, "mine") is out
        True
    """
    what = f"rollout engine {engine}"
    if not isinstance(out, TensorDictBase):
        raise TypeError(
            f"{what} returned {type(out).__name__}; a RolloutEngine returns a TensorDict of batch size [B]"
        )
    present = set(out.keys())
    missing = [k for k in _OUTPUT_KEYS if k not in present]
    if missing:
        raise ValueError(
            f"{what} returned no {', '.join(missing)} (a RolloutEngine returns {', '.join(_OUTPUT_KEYS)} and "
            f"{KEYS.rollout_log_probs}); it returned {sorted(present)}"
        )
    keys = _OUTPUT_KEYS + ((KEYS.rollout_log_probs,) if KEYS.rollout_log_probs in present else ())
    shapes = {k: tuple(out[k].shape) for k in keys}
    if any(len(shape) != 2 or shape[0] != rows for shape in shapes.values()) or tuple(out.batch_size[:1]) != (
        rows,
    ):
        raise ValueError(
            f"{what} returned shapes {shapes} (batch size {list(out.batch_size)}) for {rows} prompts"
        )
    p, r = shapes[KEYS.prompts][1], shapes[KEYS.responses][1]
    expected = {
        KEYS.input_ids: p + r,
        KEYS.attention_mask: p + r,
        KEYS.response_mask: r,
        KEYS.rollout_log_probs: r,
    }
    wrong = {k: shapes[k] for k, width in expected.items() if k in shapes and shapes[k][1] != width}
    if wrong or r > max_new_tokens:
        raise ValueError(
            f"{what} returned responses of {r} columns (at most max_new_tokens={max_new_tokens}) after prompts of {p}; "
            f"the other keys must match: input_ids and attention_mask {p} + {r}, response_mask and rollout_log_probs "
            f"{r} (got {shapes})"
        )
    mask = out[KEYS.response_mask]
    if mask.is_floating_point():  # 0/1 in floats: read as the integer mask it means (one check of its values)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise TypeError(f"{what} returned a response_mask of {mask.dtype} with values other than 0 and 1")
        if engine not in _WARNED_FLOAT_MASK:
            _WARNED_FLOAT_MASK.add(engine)
            logger.warning(
                "%s returned a %s response_mask: read as int64 (return an integer mask)", what, mask.dtype
            )
        out[KEYS.response_mask] = mask.long()
    # (attention_mask is the caller's prompt mask and the response mask joined: it may take the caller's dtype)
    floating = [
        k
        for k in keys
        if k != KEYS.attention_mask and (k == KEYS.rollout_log_probs) != out[k].is_floating_point()
    ]
    if floating:
        raise TypeError(
            f"{what} returned {', '.join(f'{k} of {out[k].dtype}' for k in floating)}: token ids and masks are "
            "integer (or bool) tensors, rollout_log_probs a floating-point one"
        )
    return out
