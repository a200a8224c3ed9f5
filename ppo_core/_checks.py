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


def check_devices_match(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming both arguments when two of ``tensors`` (None entries skipped) differ in device.

    Example:
        >>> check_devices_match(log_prob=torch.zeros(2), response_mask=torch.ones(2), rollout_is_weights=None)
    """
    items = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {first_name} is on {first.device}; they must match"
            )


def check_mask_deferred(
    name: str, value: object, like: torch.Tensor | None = None, like_name: str = ""
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`check_mask` without its host sync: ``(mask as bool, flag)``.

    Type and shape are checked at once; for a non-bool mask ``flag`` is a 0-d bool tensor, true when an entry is
    neither 0 nor 1, for the caller to fold into its own single sync (see :func:`check_all_finite`). ``flag`` is None
    for a bool mask.
    """
    mask = check_tensor(name, value)
    if mask.dtype == torch.bool or mask.is_complex():
        return check_mask(name, mask, like, like_name), None
    nonzero = check_mask(name, mask != 0, like, like_name)
    return nonzero, (nonzero & (mask != 1)).any()


def check_mask_flag(name: str, flag: torch.Tensor | None) -> None:
    """Raise the error :func:`check_mask` raises when the flag of :func:`check_mask_deferred` is set (one sync)."""
    if flag is not None and bool(flag):
        raise ValueError(f"{name} must contain only 0 and 1 (or be a bool tensor)")


def nonfinite_flag(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor, true when one of ``tensors`` may hold NaN or inf; one reduction per tensor, no host sync.

    The sum of a tensor (accumulated in at least fp32) is non-finite when an entry is, or, for entries near the
    dtype's largest value, when the sum overflows: :func:`raise_first_nonfinite` tells the two apart. Zero the
    positions that must be ignored first (``torch.where``, never a product: ``NaN * 0`` is NaN).
    """
    total = None
    for tensor in tensors:
        part = tensor.detach().sum(dtype=torch.promote_types(tensor.dtype, torch.float32))
        total = part if total is None else total + part
    if total is None:
        return torch.zeros((), dtype=torch.bool)
    return ~torch.isfinite(total)


def raise_first_nonfinite(
    named: dict[str, torch.Tensor], where: torch.Tensor | None, purpose: str, scope: str = ""
) -> None:
    """Raise ``ValueError`` naming the first tensor of ``named`` with NaN/inf (where ``where`` is true, if given).

    The message gives the kind, the number of positions (described by ``scope``, e.g. ``" valid (mask=1)"``) and
    the first one. Returns quietly when every tensor is finite. Slow (several syncs): call it only after a cheap
    flag said something is wrong.
    """
    for name, value in named.items():
        bad = ~torch.isfinite(value.detach())
        if where is not None:
            bad = bad & where
        count = int(bad.sum())
        if count:
            kind = "NaN" if bool((torch.isnan(value.detach()) & bad).any()) else "inf"
            first = [int(i) for i in bad.nonzero()[0].tolist()]
            raise ValueError(
                f"{name} contains {kind} at {count}{scope} position(s), the first at index {first}; {purpose}"
            )


def check_all_finite(
    named: dict[str, torch.Tensor],
    *,
    purpose: str,
    scope: str = "",
    mask_name: str = "",
    mask_flag: torch.Tensor | None = None,
) -> None:
    """One fused check, one host sync: raise ``ValueError`` naming the argument if a tensor holds NaN/inf.

    Args:
        named: ``{argument name: tensor}``, each already 0 at the positions to ignore (masked positions may hold
            anything before the ``torch.where`` that zeroes them).
        purpose: the end of the message (what needs finite inputs).
        scope: which positions were checked, for the message (e.g. ``" valid (response_mask=1)"``).
        mask_name, mask_flag: the flag of :func:`check_mask_deferred`, checked in the same sync.

    Example:
        >>> check_all_finite({"advantages": torch.ones(2, 3)}, purpose="the loss needs finite inputs")
    """
    flag = nonfinite_flag(*named.values())
    if mask_flag is not None:
        flag = flag | mask_flag
    if not bool(flag):
        return
    check_mask_flag(mask_name, mask_flag)
    raise_first_nonfinite(named, None, purpose, scope)  # returns when only the sum overflowed
