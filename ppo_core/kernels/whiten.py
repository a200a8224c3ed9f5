"""Whitening of values that are exactly 0 at masked positions, in PyTorch (the CPU and fallback form; the Triton
scans fuse it, see :mod:`ppo_core.kernels.triton_scan`)."""

from __future__ import annotations

import torch

from ppo_core.masked_moments import reduce_row_moments, row_moments, whiten_with

__all__ = ["whiten_valid"]


def whiten_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` over the valid entries of ``values: [B, T]``, exactly 0 where masked.

    The estimators' whitening (GAE, REINFORCE++, REINFORCE++-baseline). The mean and the unbiased variance are
    those of :func:`~ppo_core.masked.masked_whiten`, accumulated in float64 in a fixed order that does not depend
    on how the rows are laid out: each row's float64 partials (:func:`~ppo_core.masked_moments.row_moments`) reduced
    exactly over the rows (:func:`~ppo_core.masked_moments.reduce_row_moments`), the scaling in float64 and one
    cast back. A data-parallel holder of the rows computes the same partials of its rows and the same whitening
    with the reduced moments: the same bits as here, for any split of the rows into contiguous blocks. Constant
    valid values give exactly 0 (a constant row's float64 sum and mean are exact). With NaN or inf among the valid
    values (which the estimators reject) every valid output is NaN.

    Returns:
        ``[B, T]`` in ``values``' dtype.
    """
    if not values.numel():
        return torch.zeros_like(values)
    mask = mask.bool()
    return whiten_with(values, mask, reduce_row_moments([row_moments(values, mask, check=False)]))
