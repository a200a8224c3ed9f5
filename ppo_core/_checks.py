"""Input validation shared by the public functions.

Every check raises ``ValueError`` (bad value or shape) or ``TypeError`` (bad type or dtype) with a message
that names the offending argument, so that a user who passes the wrong tensor sees which one it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__: list[str] = []


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a floating-point tensor, else raise ``TypeError`` naming ``name``."""
    tensor = check_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    return tensor


def check_ndim(name: str, value: torch.Tensor, ndim: int) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless ``value`` has exactly ``ndim`` dimensions."""
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming both arguments when two of ``tensors`` differ in shape.

    Example:
        >>> check_same_shape(rewards=torch.zeros(2, 3), response_mask=torch.zeros(2, 3))
    """
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {first_name} has shape {tuple(first.shape)}; "
                "they must match"
            )


def check_mask(
    name: str, value: object, like: torch.Tensor | None = None, like_name: str = ""
) -> torch.Tensor:
    """Validate a mask (bool, integer or floating 0/1 weights) and return it as a boolean tensor.

    A floating mask is accepted when every entry is 0 or 1; any other value raises ``ValueError``, because a
    weighted mask silently changes every statistic computed from it.
    """
    mask = check_tensor(name, value)
    if like is not None and mask.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but {like_name} has shape {tuple(like.shape)}; they must match"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or floating 0/1 tensor, got dtype {mask.dtype}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must contain only 0 and 1 (or be a bool tensor)")
    return mask != 0


def check_no_nan(name: str, value: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` holds NaN (only where ``mask`` is true, if given)."""
    nan = torch.isnan(value)
    if mask is not None:
        nan = nan & mask
    if bool(nan.any()):
        raise ValueError(
            f"{name} contains NaN" + (" at valid (mask=1) positions" if mask is not None else "")
        )


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` listing the valid ``choices`` when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid values: {', '.join(sorted(choices))}")
    return value


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number > 0 (or >= 0)."""
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not ok or value != value or value in (float("inf"), float("-inf")):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")
    return value


def check_unit_interval(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``0 <= value <= 1``."""
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value
