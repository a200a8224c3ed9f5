"""Validation and small shared steps of the advantage estimators (private)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from ppo_core._checks import check_floating, check_mask, check_ndim
from ppo_core.advantages._groups import GroupIndex, factorize_index

__all__: list[str] = []

REWARDS = "rewards (token_level_rewards)"
"""How error messages name the reward tensor: ``rewards`` in the functions, ``token_level_rewards`` in the registry."""

IndexLike = torch.Tensor | Sequence[Hashable]

_F = TypeVar("_F", bound=Callable)


def no_grad(fn: _F) -> _F:
    """``@torch.no_grad()`` for the estimators, at about half its cost a call: grad mode is switched only when it
    is on, with one call each way (the decorator builds a context object at every call). On CUDA a public
    estimator costs a few tens of microseconds beyond its kernels, so this shows."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        torch.set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_grad_enabled(True)

    return run  # type: ignore[return-value]


def check_rewards_and_mask(rewards: object, response_mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``[B, T]`` rewards and their mask; return the rewards and the mask as bool."""
    rewards = check_ndim(REWARDS, check_floating(REWARDS, rewards), 2)
    mask = check_mask("response_mask", response_mask, like=rewards, like_name=REWARDS)
    if mask.device != rewards.device:
        raise ValueError(
            f"response_mask is on {mask.device} but {REWARDS} is on {rewards.device}; they must match"
        )
    return rewards, mask


def check_rewards_and_mask_unsynced(
    rewards: object, response_mask: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`check_rewards_and_mask` without its host sync, for the estimators that read one flag at the end.

    Returns ``(rewards, mask, mask_flag)``. A bool mask is taken as it is (``mask_flag`` None); another mask of the
    right type, shape and device becomes ``mask != 0``, and whether it held anything but 0 and 1 is ``mask_flag``,
    a 0-d bool tensor: when it is set, :func:`check_rewards_and_mask` raises the usual error.
    """
    mask = response_mask
    if (  # what the estimators are usually given, accepted without the calls of the checks that name the culprit
        type(mask) is torch.Tensor
        and type(rewards) is torch.Tensor
        and mask.dtype == torch.bool
        and rewards.dim() == 2
        and rewards.is_floating_point()
        and mask.shape == rewards.shape
        and mask.device == rewards.device
    ):
        return rewards, mask, None
    if not isinstance(mask, torch.Tensor) or mask.dtype == torch.bool or mask.is_complex():
        rewards, mask = check_rewards_and_mask(rewards, mask)
        return rewards, mask, None
    rewards = check_ndim(REWARDS, check_floating(REWARDS, rewards), 2)
    if mask.shape != rewards.shape or mask.device != rewards.device:
        check_rewards_and_mask(rewards, mask)  # raises the error that names the argument
    valid = mask != 0
    return rewards, valid, (valid & (mask != 1)).any()


def check_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` holds NaN or inf (only where ``where`` is true, if given)."""
    bad = ~torch.isfinite(value)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        kind = "NaN" if bool((torch.isnan(value) & bad).any()) else "inf"
        scope = " at positions that enter the result" if where is not None else ""
        raise ValueError(f"{name} contains {kind}{scope}; advantages need finite inputs")


def check_scalar(name: str, value: float, low: float, high: float = float("inf")) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``low <= value <= high`` (and finite)."""
    value = float(value)
    if not (low <= value <= high) or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value}")
    return value


def zero_outside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` at valid tokens, exactly 0 elsewhere (NaN/inf on masked tokens cannot leak)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def broadcast_rows(per_row: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B]`` per-row advantages spread over the valid tokens of ``[B, T]``, 0 elsewhere, cast to ``dtype``."""
    return zero_outside(per_row.to(dtype).unsqueeze(-1).expand(mask.shape), mask)


def prepare_outcome(
    rewards: object, response_mask: object, index: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, GroupIndex]:
    """Shared front end of the group estimators.

    Returns ``(rewards, mask, scores, valid, groups)``: ``scores`` is the float64 per-row sum of the rewards over
    all ``T`` positions, masked ones included (verl's outcome semantics), ``valid`` flags rows with at
    least one valid token (only those enter group statistics).
    """
    rewards, mask = check_rewards_and_mask(rewards, response_mask)
    # every position enters the score, so a NaN anywhere would poison a whole group
    check_finite(REWARDS, rewards)
    groups = factorize_index(index, rewards.shape[0], device=rewards.device)  # type: ignore[arg-type]
    scores = rewards.to(torch.float64).sum(dim=-1)
    return rewards, mask, scores, mask.any(dim=-1), groups
