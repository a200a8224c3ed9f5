"""Whitening of values that are exactly 0 at masked positions, in PyTorch (the CPU and fallback form; the Triton
scans fuse it, see :mod:`ppo_core.kernels.triton_scan`)."""

from __future__ import annotations

import torch

from ppo_core.masked import WHITEN_EPS

__all__ = ["whiten_valid"]


def whiten_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``zero_outside(masked_whiten(values, mask), mask)`` for ``values: [B, T]`` that are exactly 0 where masked.

    The estimators' outputs have that property, which lets every sum skip its select (the zeros add nothing) and
    the centred values serve both the variance and the output: the same arithmetic as :func:`masked_whiten`
    (bit for bit below 2**24 valid tokens, where its float32 count is exact; this count is exact everywhere) in
    about half the passes over ``[B, T]``.
    """
    acc = values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    count = torch.count_nonzero(mask).to(acc.dtype)
    mean = acc.sum() / count.clamp(min=1)
    # the centred values, 0 where masked: they give the variance, and scaled in place they are the result
    valid = torch.where(mask, acc - mean, zero)
    var = torch.where(count > 1, valid.square().sum() / (count - 1).clamp(min=1), zero)
    return valid.mul_(torch.rsqrt(var + WHITEN_EPS)).to(values.dtype)
