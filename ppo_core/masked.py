"""Masked statistics: sums, means, variances and whitening over the valid entries of a tensor.

Shapes: ``values`` and ``mask`` share any shape, normally ``[B, T]`` (batch, response tokens). ``mask`` is a bool
or 0/1 tensor (see :func:`ppo_core._checks.check_mask`). Entries outside the mask never influence a result, even
when they hold NaN or inf.

NaN or inf at a *valid* entry raises ``ValueError`` naming ``values`` and the first such position (verl returns
NaN). The check costs one host sync per call: it reads back whether the sum the statistic computes anyway is finite.
Finite float32 (or half-precision) values whose sum, difference or squares overflow the accumulation dtype (values
near ``3e38``) are not an error: ``masked_mean``, ``masked_var`` and ``masked_whiten`` then compute again in float64
and round the result to the values' dtype (a variance beyond float32's range is ``inf``, as it is).

Edge cases (a deliberate deviation from verl, see ``docs/semantics.md``):

- no valid entry: ``masked_mean`` is 0 and ``masked_var`` is 0 (verl raises for the unbiased variance);
- one valid entry: the unbiased variance is 0 (verl raises); the biased one is 0 anyway;
- ``masked_whiten`` of 0 or 1 valid entries therefore returns ``values - mean`` scaled by ``rsqrt(eps)``, which is
  0 at the single valid entry. No result is ever a silent NaN produced by an empty mask.

Reference centring: ``masked_var`` and ``masked_whiten`` subtract a reference, the value at the first valid entry
(row-major; per slice reduced over ``dim``), before they take the mean: ``x - mean x = (x - x_ref) - mean(x - x_ref)``.
The mean of ``n`` equal floats is in general not that value (the sum rounds), and whitening divides by a spread of
0 plus ``1e-8``: about its own first value a constant is exactly 0 before the sum, so its variance and whitening are
exactly 0, and a large common offset (``1e4 + noise``) goes before anything is summed (the difference of two floats
within a factor of two of each other is exact).
"""

from __future__ import annotations

import math

import torch

from ppo_core._checks import check_floating, check_mask, raise_first_nonfinite

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]

WHITEN_EPS = 1e-8
"""Added to the variance before the reciprocal square root in :func:`masked_whiten` (verl's value)."""


def _prepare(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = check_floating("values", values)
    return values, check_mask("mask", mask, like=values, like_name="values")


def _check_finite(total: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    """One sync: ``total`` (a masked sum of ``values``, or of ``values`` minus a valid one) is non-finite iff a valid
    entry is, or the sum (or a difference) overflowed; only the first raises (a sum past the dtype's range is
    ``inf``, as it is)."""
    if not bool(torch.isfinite(total).all()):
        _raise_nonfinite(values, mask)


def _raise_nonfinite(values: torch.Tensor, mask: torch.Tensor) -> None:
    """``ValueError`` naming the first NaN/inf of ``values`` where ``mask`` is 1 (several syncs); returns quietly
    when there is none."""
    raise_first_nonfinite(
        {"values": values},
        mask,
        "masked statistics need finite values where the mask is 1",
        " valid (mask=1)",
    )


def _overflowed(finite: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """One sync on ``finite`` (whether every statistic came out finite): False when it did; a ``ValueError`` naming
    the first NaN/inf where ``mask`` is 1; True when the values are finite and a statistic overflowed its
    accumulation dtype (values near the dtype's largest: the caller computes again in float64)."""
    if bool(finite):
        return False
    _raise_nonfinite(values, mask)
    if values.dtype == torch.float64:
        raise ValueError(
            "masked statistics of values overflow float64 (every valid value is finite, their sums or squares "
            "are not); scale the values down"
        )
    return True


def _first_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """0-d int64 index (row-major, as :func:`torch.take` reads it) of the first true entry of a non-empty bool
    ``mask``; 0 when none is true. No host sync."""
    flags = mask.view(torch.uint8)
    if flags.dim() < 2 or flags.device.type != "cpu":
        return flags.argmax()  # argmax returns the first maximal entry
    # On CPU an argmax over a whole [B, T] mask is far slower than a max (it is not vectorised): each row's max
    # finds the first row with a true entry, and the argmax runs over that row only.
    rows = flags.reshape(-1, flags.shape[-1])
    row = rows.amax(dim=-1).argmax()
    return row * rows.shape[1] + rows.index_select(0, row.view(1)).argmax()


def _reference(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None) -> torch.Tensor:
    """The value at the first valid entry (row-major) of each slice reduced over ``dim``, 0 for a slice without
    one, shaped to broadcast against ``values`` (the reduced dims kept as 1): the reference that
    :func:`_centred` subtracts. Never a masked entry, so masked NaN/inf never reach it."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    dims = _dims(dim, values.dim())
    if dims is None:
        if not values.numel():
            return zero
        first = _first_valid_index(mask)
        return torch.where(torch.take(mask, first), torch.take(values, first), zero)
    kept = [d for d in range(values.dim()) if d not in dims]
    shape = [1 if d in dims else values.shape[d] for d in range(values.dim())]
    size = math.prod(values.shape[d] for d in dims)
    if not values.numel():
        return zero.expand(shape)
    # the reduced dims last and flattened: one row per slice, its entries in row-major order
    flat_values = values.permute(kept + dims).reshape(-1, size)
    flat_mask = mask.permute(kept + dims).reshape(-1, size)
    first = flat_mask.view(torch.uint8).argmax(dim=-1, keepdim=True)
    return torch.where(flat_mask.gather(-1, first), flat_values.gather(-1, first), zero).reshape(shape)


def _dims(dim: int | tuple[int, ...] | None, ndim: int) -> list[int] | None:
    """The reduced dims of ``dim``, non-negative and sorted; None when everything is reduced (``torch.sum`` reduces
    everything for ``dim=()`` too)."""
    dims = (dim,) if isinstance(dim, int) else dim
    return sorted({d % ndim for d in dims}) if dims else None


def _centred(
    acc: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reference, shifted, total)`` for accumulation-dtype ``acc``: :func:`_reference`, ``acc - reference`` and
    its masked sum. One implementation of the reference centring, for the variance and the whitening."""
    reference = _reference(acc, mask, dim)
    shifted = acc - reference
    return reference, shifted, _sum(shifted, mask, dim)


def _sum(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None) -> torch.Tensor:
    zeroed = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def _sum_acc(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None) -> torch.Tensor:
    """Like ``_sum`` but accumulated in fp32/fp64, for statistics of half-precision inputs."""
    return _sum(values.to(_acc_dtype(values.dtype)), mask, dim)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: half-precision counts overflow (fp16 > 65504) or round (bf16 > 256)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _count(mask: torch.Tensor, dim: int | tuple[int, ...] | None, dtype: torch.dtype) -> torch.Tensor:
    acc = _acc_dtype(dtype)
    return mask.sum(dtype=acc) if dim is None else mask.sum(dim=dim, dtype=acc)


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true.

    Args:
        values: floating tensor, any shape (typically ``[B, T]``).
        mask: bool or 0/1 tensor of the same shape.
        dim: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        The sum, with ``dim`` removed (a 0-d tensor when ``dim`` is None). Masked NaN/inf are ignored.

    Example:
        >>> masked_sum(torch.tensor([[1.0, 2.0, float("nan")]]), torch.tensor([[1, 1, 0]]))
        tensor(3.)
    """
    values, mask = _prepare(values, mask)
    total = _sum(values, mask, dim)
    _check_finite(total, values, mask)
    return total


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``values`` over the valid entries; 0 where there is none (never NaN from an empty mask).

    Args:
        values: floating tensor, any shape (typically ``[B, T]``).
        mask: bool or 0/1 tensor of the same shape.
        dim: dimension(s) to reduce; ``None`` gives a scalar. ``dim=-1`` on ``[B, T]`` gives per-row means ``[B]``.

    Example:
        >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0]]), dim=-1)
        tensor([2., 0.])
    """
    values, mask = _prepare(values, mask)
    total = _sum_acc(values, mask, dim)
    if _overflowed(torch.isfinite(total).all(), values, mask):  # finite values near the dtype's largest
        return masked_mean(values.double(), mask, dim).to(values.dtype)
    return (total / _count(mask, dim, values.dtype).clamp(min=1)).to(values.dtype)


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_mean` over everything for a validated bool ``mask``, unchecked (no host sync), for metrics."""
    return (_sum_acc(values, mask, None) / _count(mask, None, values.dtype).clamp(min=1)).to(values.dtype)


def masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    dim: int | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Variance of ``values`` over the valid entries (two-pass, centred, about the first valid value of each slice
    first: a constant slice has variance exactly 0).

    Args:
        values: floating tensor, any shape (typically ``[B, T]``).
        mask: bool or 0/1 tensor of the same shape.
        unbiased: divide by ``n - 1`` (Bessel) instead of ``n``.
        dim: dimension(s) to reduce; ``None`` gives a scalar.

    Returns:
        The variance; 0 where fewer than two entries are valid (unbiased) or none is (biased).

    Example:
        >>> masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
    """
    values, mask = _prepare(values, mask)
    _, shifted, total = _centred(values.to(_acc_dtype(values.dtype)), mask, dim)
    var = _var(shifted, mask, total, unbiased, dim)
    if _overflowed(torch.isfinite(total).all() & torch.isfinite(var).all(), values, mask):
        return masked_var(values.double(), mask, unbiased, dim).to(values.dtype)
    return var.to(values.dtype)


def _var(
    values: torch.Tensor,
    mask: torch.Tensor,
    total: torch.Tensor,
    unbiased: bool,
    dim: int | tuple[int, ...] | None,
) -> torch.Tensor:
    """Two-pass variance of accumulation-dtype ``values`` given their masked sum ``total`` (unchecked).

    ``values`` are those of :func:`_centred` (about a reference): the variance is unchanged by the shift."""
    count = _count(mask, dim, values.dtype)
    mean = total / count.clamp(min=1)
    for d in _dims(dim, values.dim()) or ():
        mean = mean.unsqueeze(d)
    centred_sq = (values - mean).square()
    sq_sum = _sum(centred_sq, mask, dim)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, sq_sum / denom.clamp(min=1), torch.zeros_like(sq_sum))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to mean 0 and unit (unbiased) variance over the valid entries.

    ``(values - mean) * rsqrt(var + 1e-8)``, with mean and variance taken over ``mask`` only (batch-global, as in
    verl). The transform is applied to every entry, masked ones included; consumers must keep multiplying by
    the mask. With ``shift_mean=False`` the mean is added back (scale only). The values are centred about the
    first valid one before the mean is taken (see the module docstring): constant valid values whiten to exactly 0.

    Args:
        values: floating tensor, any shape (typically ``[B, T]``).
        mask: bool or 0/1 tensor of the same shape.
        shift_mean: subtract the mean (True) or only rescale (False).

    Returns:
        Tensor of the same shape and dtype as ``values``. Masked entries holding NaN/inf stay NaN/inf but never
        reach a valid entry.

    Example:
        >>> out = masked_whiten(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), torch.tensor([[1, 1, 1, 0]]))
        >>> out[0, :3]
        tensor([-1.,  0.,  1.])
    """
    values, mask = _prepare(values, mask)
    reference, shifted, total = _centred(values.to(_acc_dtype(values.dtype)), mask, None)
    mean = total / _count(mask, None, shifted.dtype).clamp(min=1)  # of the shifted values
    var = _var(shifted, mask, total, True, None)
    if _overflowed(torch.isfinite(total) & torch.isfinite(var), values, mask):
        return masked_whiten(values.double(), mask, shift_mean).to(values.dtype)
    whitened = (shifted - mean) * torch.rsqrt(var + WHITEN_EPS)
    return (whitened if shift_mean else whitened + (reference + mean)).to(values.dtype)
