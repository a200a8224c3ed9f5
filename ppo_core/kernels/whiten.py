"""Whitening of values that are exactly 0 at masked positions, in PyTorch (the CPU and fallback form; the Triton
scans fuse it, see :mod:`ppo_core.kernels.triton_scan`)."""

from __future__ import annotations

import torch

from ppo_core.masked import WHITEN_EPS, _first_valid_index

__all__ = ["whiten_valid"]


def whiten_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``zero_outside(masked_whiten(values, mask), mask)`` for ``values: [B, T]`` that are exactly 0 where masked.

    The estimators' outputs have that property, which lets every sum skip its select (the zeros add nothing) and
    the centred values serve both the variance and the output: the same arithmetic as :func:`masked_whiten`
    (bit for bit below 2**24 valid tokens, where its float32 count is exact; this count is exact everywhere) in
    fewer passes over ``[B, T]``. As there, the values are centred about the first valid one before the mean is
    taken, so constant valid values give exactly 0. With NaN or inf among the valid values (which the estimators
    reject) the masked entries may be NaN too.
    """
    acc = values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)
    if not acc.numel():
        return torch.zeros_like(values)
    count = torch.count_nonzero(mask).to(acc.dtype)
    # Each shift is applied where the mask is 1 only, as x + m * (-shift) (exactly x - shift there, exactly 0 at a
    # masked 0): on CPU a multiply-add by the mask as floats takes a tenth of the time of a select. The reference
    # is the first valid value (the masked 0 at index 0 when none is valid: the result is then 0 anyway).
    weights = mask.view(torch.uint8).to(acc.dtype)
    centred = torch.addcmul(acc, weights, -torch.take(acc, _first_valid_index(mask)))
    mean = centred.sum() / count.clamp(min=1)
    # the centred values, 0 where masked: they give the variance, and scaled in place they are the result
    centred.addcmul_(weights, -mean)
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    var = torch.where(count > 1, centred.square().sum() / (count - 1).clamp(min=1), zero)
    return centred.mul_(torch.rsqrt(var + WHITEN_EPS)).to(values.dtype)
