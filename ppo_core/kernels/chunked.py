"""Vectorised chunked scans in plain PyTorch: any device, differentiable, no Python loop over time.

Used where neither compiled kernel applies (no C compiler, CUDA without Triton, other devices) and when the
inputs require grad. Two observations make the masked recurrence cheap to vectorise:

1. Skipping masked tokens is the same as running the plain (unmasked) recurrence on each row with its valid
   tokens moved to the left, in order ("compaction"). The valid token at ``t`` lands at ``j_t``, the number of
   valid tokens before ``t``; a masked token at ``t`` carries the state of the next valid token, which is also
   compacted position ``j_t`` (or the zero padding after the last valid one). So one scatter in and one
   gather out reproduce the gap semantics exactly, including rewards and values on masked tokens being ignored.
2. On the compacted rows the coefficient is a constant ``c``, so ``x_t = sum_{s >= t} c^(s-t) b_s`` is a
   product with an upper-triangular Toeplitz matrix: chunks of ``L`` steps become one matrix product against an
   ``L x L`` matrix of powers ``c^k <= 1`` (no division, nothing that overflows or underflows badly), and the
   chunks are chained by the same construction one level up with coefficient ``c^L``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["discounted_return_scan_chunked", "gae_scan_chunked"]

_CHUNK = 128


def _powers_matrix(coef: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[s, t] = coef**(s - t)`` for ``s >= t`` else 0, so that ``b @ M`` is the reverse discounted sum."""
    steps = torch.arange(size, device=device, dtype=torch.float64)
    exponent = steps[:, None] - steps[None, :]
    base = torch.tensor(coef, dtype=torch.float64, device=device)
    powers = torch.where(exponent >= 0, base ** exponent.clamp(min=0), torch.zeros((), dtype=torch.float64))
    return powers.to(dtype)


def _reverse_discounted_cumsum(b: torch.Tensor, coef: float) -> torch.Tensor:
    """``x_t = b_t + coef * x_{t+1}`` along the last dim of ``b: [B, N]`` with ``x_N = 0``."""
    batch, length = b.shape
    if length <= _CHUNK:
        return b @ _powers_matrix(coef, length, b.dtype, b.device)
    n_chunks = -(-length // _CHUNK)
    chunks = F.pad(b, (0, n_chunks * _CHUNK - length)).reshape(batch, n_chunks, _CHUNK)
    local = chunks @ _powers_matrix(
        coef, _CHUNK, b.dtype, b.device
    )  # each chunk with zero state on its right
    # State entering chunk k from the right is the full value at the start of chunk k + 1.
    starts = _reverse_discounted_cumsum(local[:, :, 0], coef**_CHUNK)
    incoming = F.pad(starts[:, 1:], (0, 1))
    decay = _powers_matrix(coef, _CHUNK + 1, b.dtype, b.device)[_CHUNK, :_CHUNK]  # coef**(CHUNK - t)
    return (local + incoming[:, :, None] * decay).reshape(batch, -1)[:, :length]


def _compaction_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scatter_index, gather_index)``: valid tokens go to ``j_t`` and masked ones to the dump column ``T``."""
    length = mask.shape[1]
    counts = mask.to(torch.int32).cumsum(dim=1, dtype=torch.int64)
    before = counts - mask.to(torch.int64)  # j_t: valid tokens strictly before t
    scatter_index = torch.where(mask, before, torch.full_like(before, length))
    return scatter_index, before


def _compact(x: torch.Tensor, scatter_index: torch.Tensor) -> torch.Tensor:
    """Valid entries of ``x: [B, T]`` moved left in order, zero after them: ``[B, T + 1]`` (last column 0)."""
    zeros = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)
    compact = zeros.scatter(1, scatter_index, x)
    return torch.cat([compact[:, :-1], zeros[:, :1]], dim=1)  # drop whatever the masked entries dumped there


def _work_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        return torch.float32
    # A TF32 matmul (if a user enabled it) loses ~3 decimal digits; float64 keeps the 1e-4 contract.
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return torch.float64
    return dtype


def gae_scan_chunked(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Raw masked GAE advantages with the semantics of ``reference.masked_gae_scan``.

    Args:
        rewards, values: ``[B, T]`` floating tensors on any device.
        mask: ``[B, T]`` bool tensor.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``[B, T]`` advantages in the promoted dtype of rewards and values (differentiable).

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> gae_scan_chunked(torch.tensor([[0.0, 5.0, 1.0]]), torch.zeros(1, 3), m, 1.0, 1.0)
        tensor([[1., 1., 1.]])
    """
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    work = _work_dtype(dtype, rewards.device)
    scatter_index, gather_index = _compaction_index(mask)
    r = _compact(rewards.to(work), scatter_index)
    v = _compact(values.to(work), scatter_index)
    v_next = F.pad(v[:, 1:], (0, 1))
    delta = r + gamma * v_next - v  # zero on the padding, so the padding carries zero state
    adv = _reverse_discounted_cumsum(delta, gamma * lam)
    return adv.gather(1, gather_index).to(dtype)


def discounted_return_scan_chunked(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Masked discounted reward-to-go with the semantics of ``reference.masked_discounted_return_scan``.

    Args:
        rewards: ``[B, T]`` floating tensor on any device.
        mask: ``[B, T]`` bool tensor.
        gamma: discount.

    Returns:
        ``[B, T]`` returns, 0 at masked positions (differentiable).

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> discounted_return_scan_chunked(torch.tensor([[1.0, 5.0, 1.0]]), m, 0.5)
        tensor([[1.5000, 0.0000, 1.0000]])
    """
    work = _work_dtype(rewards.dtype, rewards.device)
    scatter_index, gather_index = _compaction_index(mask)
    returns = _reverse_discounted_cumsum(_compact(rewards.to(work), scatter_index), gamma)
    zero = torch.zeros((), dtype=work, device=rewards.device)
    return torch.where(mask, returns.gather(1, gather_index), zero).to(rewards.dtype)
