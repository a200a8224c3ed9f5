"""Vectorised chunked scans in plain PyTorch: any device, differentiable, no Python loop over time.

The CPU path (nothing is compiled at run time), and on CUDA the path for float64 or when the inputs require grad.
Two observations make the masked recurrence cheap to vectorise:

1. Skipping masked tokens is the same as running the plain (unmasked) recurrence on each row with its valid
   tokens moved to the left, in order ("compaction"). The valid token at ``t`` lands at ``j_t``, the number of
   valid tokens before ``t``; a masked token at ``t`` carries the state of the next valid token, which is also
   compacted position ``j_t`` (or the zero padding after the last valid one). So one scatter in and one
   gather out reproduce the gap semantics exactly, including rewards and values on masked tokens being ignored.
   When every row's valid tokens already form a prefix (single-turn responses, right padding) the compaction
   is the identity and costs nothing but zeroing the padding (tested on CPU only: the test reads a value).
2. On the compacted rows the coefficient is a constant ``c``, so ``x_t = sum_{s >= t} c^(s-t) b_s`` is a
   product with an upper-triangular Toeplitz matrix: chunks of ``L`` steps become one matrix product against an
   ``L x L`` matrix of powers ``c^k <= 1`` (no division, nothing that overflows or underflows badly), and the
   chunks are chained by the same construction one level up with coefficient ``c^L``.

The ``*_checked`` functions are the estimators' form: outputs exactly 0 at masked positions and a flag computed
from the scan's own intermediates (a sum of the values that entered it), so no separate pass checks the inputs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "discounted_return_scan_checked_chunked",
    "discounted_return_scan_chunked",
    "gae_returns_checked_chunked",
    "gae_scan_chunked",
]

_CHUNK = 16
"""Steps per chunk ``L``: the products cost ``2 L`` flops per element, so short chunks keep them cheaper than the
passes over memory around them; the levels above (``T / L`` chunk starts, then ``T / L**2``) are small."""


_CPU_INDEX = torch.int32 if torch.torch_version.TorchVersion(torch.__version__) >= (2, 8) else torch.int64
"""Index dtype of gather/scatter on CPU (int32 indices are accepted since torch 2.8)."""


@functools.lru_cache(maxsize=64)
def _powers_matrix(coef: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[s, t] = coef**(s - t)`` for ``s >= t`` else 0, so that ``b @ M`` is the reverse discounted sum.

    Cached (never written to): building it costs more than a product with it on short rows.
    """
    with torch.inference_mode(False):  # a cached inference tensor could not be saved for a later backward
        steps = torch.arange(size, device=device, dtype=torch.float64)
        exponent = steps[:, None] - steps[None, :]
        base = torch.tensor(coef, dtype=torch.float64, device=device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.where(exponent >= 0, base ** exponent.clamp(min=0), zero).to(dtype)


def _reverse_discounted_cumsum(b: torch.Tensor, coef: float) -> torch.Tensor:
    """``x_t = b_t + coef * x_{t+1}`` along the last dim of ``b: [B, N]`` with ``x_N = 0``."""
    batch, length = b.shape
    if length <= 4 * _CHUNK:
        return b @ _powers_matrix(coef, length, b.dtype, b.device)
    n_chunks = -(-length // _CHUNK)
    padded = b if n_chunks * _CHUNK == length else F.pad(b, (0, n_chunks * _CHUNK - length))
    # each chunk with zero state on its right
    local = padded.reshape(batch, n_chunks, _CHUNK) @ _powers_matrix(coef, _CHUNK, b.dtype, b.device)
    # State entering chunk k from the right is the full value at the start of chunk k + 1.
    starts = _reverse_discounted_cumsum(local[:, :, 0], coef**_CHUNK)
    incoming = F.pad(starts[:, 1:], (0, 1))
    decay = _powers_matrix(coef, _CHUNK + 1, b.dtype, b.device)[_CHUNK, :_CHUNK]  # coef**(CHUNK - t)
    out = local.addcmul_(incoming[:, :, None], decay).reshape(batch, -1)
    return out if padded is b else out[:, :length].contiguous()


def _is_prefix(mask: torch.Tensor) -> bool:
    """Whether the valid tokens of every row of ``mask: [B, T]`` come first (no gap, no left padding)."""
    # A row is a prefix iff a masked token is never followed by a valid one.
    return not bool((mask[:, 1:] > mask[:, :-1]).any())


class _Compaction:
    """How the valid tokens of each row of ``mask: [B, T]`` move left (see the module docstring).

    Compacted rows are ``[B, W]``: the valid tokens, then exact zeros. When the mask is already compact ``W = T``;
    otherwise ``W`` is ``T + 1`` rounded up to a whole chunk, and column ``T`` is where masked entries are dumped
    (then zeroed), so that a gather through :attr:`dump` also returns exact zeros at masked positions.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        # The prefix test costs a host sync, which only pays off on CPU (on CUDA this path serves float64 and
        # autograd, where one more sync would be the larger cost).
        self.prefix = mask.device.type == "cpu" and _is_prefix(mask)
        self.width = mask.shape[1] if self.prefix else -(-(mask.shape[1] + 1) // _CHUNK) * _CHUNK

    def _counts(self) -> torch.Tensor:
        """``[B, T]`` count of valid tokens up to and including ``t``, in one new buffer.

        int32 on CPU where gather and scatter take it (torch >= 2.8): half the memory of int64, the largest buffer.
        """
        dtype = _CPU_INDEX if self.mask.device.type == "cpu" else torch.int64
        return self.mask.to(dtype).cumsum_(dim=1)

    @functools.cached_property
    def dump(self) -> torch.Tensor:
        """``[B, T]`` ``j_t`` at valid tokens, column ``T`` at masked ones."""
        return self._counts().sub_(1).masked_fill_(~self.mask, self.mask.shape[1])

    @functools.cached_property
    def carry(self) -> torch.Tensor:
        """``[B, T]`` ``j_t`` everywhere: at a masked token, the compacted position of the next valid one."""
        return self._counts().sub_(self.mask.view(torch.uint8))

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """Valid entries of ``x: [B, T]`` moved left in order, zeros after them (masked NaN/inf never enter)."""
        if self.prefix:
            return torch.where(self.mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
        batch, length = x.shape
        out = torch.zeros(batch, self.width, dtype=x.dtype, device=x.device).scatter_(1, self.dump, x)
        out[:, length] = 0  # the masked entries landed here
        return out

    def expand(self, y: torch.Tensor, *, zero_masked: bool) -> torch.Tensor:
        """Back to ``[B, T]``: a masked token gets exact 0, or (``zero_masked=False``) the next valid token's value."""
        if self.prefix:
            # After each row's last valid token the scans carry exact zeros: both answers are already there.
            return y
        return y.gather(1, self.dump if zero_masked else self.carry)


def _work_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        return torch.float32
    # A TF32 matmul (if a user enabled it) loses ~3 decimal digits; float64 keeps the 1e-4 contract.
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return torch.float64
    return dtype


def _gae_compact(
    rewards: torch.Tensor,
    values: torch.Tensor,
    layout: _Compaction,
    gamma: float,
    lam: float,
    work: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages, values, delta)`` on the compacted rows, exact zeros after the valid tokens."""
    # In place wherever autograd allows: on CPU a new [B, T] buffer costs about as much as a pass over one.
    v = layout.compact(values.to(work))
    delta = layout.compact(rewards.to(work)).sub_(v)
    # V_next of the last valid token is the zero after it, so the shifted add stops there by itself.
    delta[:, :-1].add_(v[:, 1:], alpha=gamma)
    return _reverse_discounted_cumsum(delta, gamma * lam), v, delta


def _nonfinite(total: torch.Tensor) -> torch.Tensor:
    """0-d bool: a sum is not finite iff a summand is not (or, rarely, the finite summands overflow)."""
    return ~torch.isfinite(total)


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
    layout = _Compaction(mask)
    adv, _, _ = _gae_compact(rewards, values, layout, gamma, lam, _work_dtype(dtype, rewards.device))
    return layout.expand(adv, zero_masked=False).to(dtype)


def gae_returns_checked_chunked(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and ``returns = advantages + values``, exactly 0 at masked positions, and a finiteness flag.

    Args:
        rewards, values: ``[B, T]`` floating tensors on any device.
        mask: ``[B, T]`` bool tensor.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages, returns, maybe_nonfinite)``: two ``[B, T]`` tensors in the promoted dtype, and a 0-d bool
        tensor, False when every reward and value at a valid position is finite (True also when finite inputs
        overflow the scan's sum: the caller tells the two apart by checking the inputs).

    Example:
        >>> r, v = torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, float("nan"), 0.5]])
        >>> adv, ret, bad = gae_returns_checked_chunked(r, v, torch.tensor([[True, False, True]]), 1.0, 1.0)
        >>> adv, ret, bool(bad)
        (tensor([[0.5000, 0.0000, 0.5000]]), tensor([[1., 0., 1.]]), False)
    """
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    layout = _Compaction(mask)
    adv, v, delta = _gae_compact(rewards, values, layout, gamma, lam, _work_dtype(dtype, rewards.device))
    returns = layout.expand(v.add_(adv), zero_masked=True)
    adv = layout.expand(adv, zero_masked=True)
    return adv.to(dtype), returns.to(dtype), _nonfinite(delta.sum())


def _discounted_compact(
    rewards: torch.Tensor, layout: _Compaction, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = layout.compact(rewards.to(_work_dtype(rewards.dtype, rewards.device)))
    return _reverse_discounted_cumsum(r, gamma), r


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
    layout = _Compaction(mask)
    returns, _ = _discounted_compact(rewards, layout, gamma)
    return layout.expand(returns, zero_masked=True).to(rewards.dtype)


def discounted_return_scan_checked_chunked(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`discounted_return_scan_chunked` and a finiteness flag (see :func:`gae_returns_checked_chunked`).

    Returns:
        ``(returns, maybe_nonfinite)``: ``[B, T]`` returns (0 at masked positions) and a 0-d bool tensor, False
        when every reward at a valid position is finite.

    Example:
        >>> m = torch.tensor([[True, False, True]])
        >>> out, bad = discounted_return_scan_checked_chunked(torch.tensor([[1.0, float("nan"), 1.0]]), m, 0.5)
        >>> out, bool(bad)
        (tensor([[1.5000, 0.0000, 1.0000]]), False)
    """
    layout = _Compaction(mask)
    returns, r = _discounted_compact(rewards, layout, gamma)
    return layout.expand(returns, zero_masked=True).to(rewards.dtype), _nonfinite(r.sum())
