"""Input validation shared by the public functions and the configs.

Every check raises ``ValueError`` (bad value or shape) or ``TypeError`` (bad type or dtype) with a message
that names the offending argument, so that a user who passes the wrong tensor sees which one it was.

The scalar checks (:func:`check_int`, :func:`check_number`, :func:`check_positive`, ...) raise
:class:`FieldValueError` / :class:`FieldTypeError`: ordinary ``ValueError`` / ``TypeError`` subclasses that also
remember which name they are about, so that a config nested in another one can re-raise them under the dotted path
(``rollout.n must be >= 1``) without parsing the message.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

__all__: list[str] = []


class _FieldError(Exception):
    """An error about one named field or argument: the message is ``before + field + detail``."""

    def __init__(self, field: str, detail: str, before: str = "") -> None:
        self.field, self.detail, self.before = field, detail, before
        super().__init__(f"{before}{field}{detail}")

    def within(self, section: str) -> _FieldError:
        """The same error, one level down: the field becomes ``section.field`` (or ``section`` if unnamed)."""
        field = f"{section}.{self.field}" if self.field else section
        return type(self)(field, self.detail, self.before)

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return type(self), (self.field, self.detail, self.before)


class FieldValueError(_FieldError, ValueError):
    """``ValueError`` naming a field (see :class:`_FieldError`)."""


class FieldTypeError(_FieldError, TypeError):
    """``TypeError`` naming a field (see :class:`_FieldError`)."""


def describe(value: object, limit: int = 80) -> str:
    """``"<type name> <repr>"`` for error messages, the repr cut to ``limit`` characters."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldTypeError(name, f" must be an int, got {describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise FieldValueError(name, f" must be >= {minimum}, got {value}")
    return value


def check_number(name: str, value: object) -> float:
    """Return ``value`` as a ``float`` if it is a real number (not a bool), else raise ``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldTypeError(name, f" must be a number, got {describe(value)}")
    return float(value)


def check_finite_at_least(name: str, value: object, low: float, *, strict: bool = False) -> float:
    """Return ``value`` as a ``float`` if it is a finite number ``>= low`` (``> low`` if ``strict``)."""
    number = check_number(name, value)
    ok = number > low if strict else number >= low
    if not ok or not math.isfinite(number):
        raise FieldValueError(name, f" must be a finite number {'>' if strict else '>='} {low}, got {number}")
    return number


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
        raise FieldValueError(
            name, f" {value!r}; valid values: {', '.join(sorted(choices))}", before="unknown "
        )
    return value


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """Raise naming ``name`` unless ``value`` is a finite number > 0 (or >= 0); return it as a ``float``."""
    number = check_number(name, value)
    ok = number >= 0 if allow_zero else number > 0
    if not ok or not math.isfinite(number):
        bound = ">= 0" if allow_zero else "> 0"
        raise FieldValueError(name, f" must be a finite number {bound}, got {value}")
    return number


def check_unit_interval(name: str, value: float) -> float:
    """Raise naming ``name`` unless ``value`` is a number with ``0 <= value <= 1``; return it as a ``float``."""
    number = check_number(name, value)
    if not 0.0 <= number <= 1.0:
        raise FieldValueError(name, f" must be in [0, 1], got {value}")
    return number


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
