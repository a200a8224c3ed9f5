"""Memory-aware log-probabilities and entropies from logits ``[..., V]``.

A naive ``log_softmax(logits.float())`` materialises a full fp32 copy of the logits, which for a large vocabulary
(``B * T * V`` with ``V ~ 150k``) is often the largest tensor of a training step, and autograd keeps it alive for
the backward. Here rows are processed in chunks of ``chunk_size``: each chunk is up-cast, reduced to one number per
row, and discarded. A custom backward recomputes the softmax of each chunk from the saved logits, so nothing of
size ``[N, V]`` beyond the logits themselves (and their gradient) is kept.

Conventions (shared by both functions):

- computation is in fp32 for fp16/bf16/fp32 logits and in fp64 for fp64 logits; the result has that dtype (so
  half-precision logits give fp32 log-probs and entropies);
- ``-inf`` logits (masked vocabulary entries) have probability 0 and contribute ``0 · log 0 = 0`` to the entropy,
  with a zero gradient (verl's ``entropy_from_logits`` returns NaN there);
- a row whose log-sum-exp is not finite (every logit ``-inf``, or a NaN or ``+inf`` logit) raises ``ValueError``
  instead of returning NaN;
- the backward is first-order only (no double backward);
- validation costs a host sync per call on an accelerator (label range, finite log-sum-exp).

The point is memory: no float32 ``[N, V]`` copy of the logits is kept for the backward, so the extra peak memory
of a forward + backward is little more than the gradient itself, a fraction of ``log_softmax(logits.float())``'s,
for somewhat more time (the numbers are in ``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from ppo_core._checks import check_floating, check_tensor

__all__ = ["DEFAULT_CHUNK_SIZE", "entropy_from_logits", "logprobs_from_logits"]

DEFAULT_CHUNK_SIZE = 1024
"""Rows up-cast at once; an fp32 chunk of a 152k vocabulary then takes about 620 MB."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _check_logits(logits: object) -> torch.Tensor:
    logits = check_floating("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    return logits


def _row_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """Views ``[n_i, V]`` of ``x[..., V]`` covering its rows in row-major order, without copying.

    A sliced tensor such as ``logits[:, :-1]`` cannot be viewed as ``[N, V]``; it is split along its leading
    dimension instead of being copied by ``reshape``.
    """
    vocab = x.shape[-1]
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, vocab)]
    except RuntimeError:
        return [block for i in range(x.shape[0]) for block in _row_blocks(x[i])]


def _chunks(blocks: list[torch.Tensor], chunk_size: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(rows, chunk)``: chunks of at most ``chunk_size`` rows and their slice of the flattened rows."""
    row = 0
    for block in blocks:
        for start in range(0, block.shape[0], chunk_size):
            chunk = block[start : start + chunk_size]
            yield slice(row, row + chunk.shape[0]), chunk
            row += chunk.shape[0]


def _empty_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient buffer shaped like ``x`` and its ``[N, V]`` view, filled chunk by chunk by the backwards."""
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return grad, grad.view(-1, x.shape[-1])


def _log_softmax_chunk(chunk: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax, logsumexp)`` of one chunk, up-cast to ``dtype``."""
    z = chunk.to(dtype)
    lse = torch.logsumexp(z, dim=-1)
    return z - lse.unsqueeze(-1), lse


def _check_finite_lse(lse: torch.Tensor, name: str = "logits") -> None:
    if lse.numel() and not bool(torch.isfinite(lse).all()):
        raise ValueError(
            f"{name} has a row whose log-sum-exp is not finite (every entry -inf, or a NaN or +inf entry); "
            "such a row has no valid distribution"
        )


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        dtype = _compute_dtype(logits.dtype)
        blocks = _row_blocks(logits)
        n_rows = labels.shape[0]
        out = torch.empty(n_rows, dtype=dtype, device=logits.device)
        lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        for rows, chunk in _chunks(blocks, chunk_size):
            chunk_lse = torch.logsumexp(chunk.to(dtype), dim=-1)
            picked = chunk.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1).to(dtype)
            lse[rows] = chunk_lse
            out[rows] = picked - chunk_lse
        _check_finite_lse(lse)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        dtype = lse.dtype
        grad, grad_rows = _empty_grad(logits)
        for rows, chunk in _chunks(_row_blocks(logits), ctx.chunk_size):
            g = grad_out[rows].to(dtype).unsqueeze(-1)
            # d(z_y - lse)/dz = onehot(y) - softmax(z)
            chunk_grad = torch.exp(chunk.to(dtype) - lse[rows].unsqueeze(-1)).mul_(-g)
            chunk_grad.scatter_add_(-1, labels[rows].unsqueeze(-1), g)
            grad_rows[rows] = chunk_grad
        return grad, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        dtype = _compute_dtype(logits.dtype)
        blocks = _row_blocks(logits)
        n_rows = sum(block.shape[0] for block in blocks)
        entropy = torch.empty(n_rows, dtype=dtype, device=logits.device)
        lse = torch.empty(n_rows, dtype=dtype, device=logits.device)
        for rows, chunk in _chunks(blocks, chunk_size):
            logp, chunk_lse = _log_softmax_chunk(chunk, dtype)
            p = logp.exp()
            # 0 * log 0 := 0, so that masked (-inf) vocabulary entries do not turn the entropy into NaN
            entropy[rows] = -torch.where(p > 0, p * logp, 0.0).sum(dim=-1)
            lse[rows] = chunk_lse
        _check_finite_lse(lse)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.chunk_size = chunk_size
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, lse, entropy = ctx.saved_tensors
        dtype = lse.dtype
        grad, grad_rows = _empty_grad(logits)
        for rows, chunk in _chunks(_row_blocks(logits), ctx.chunk_size):
            logp = chunk.to(dtype) - lse[rows].unsqueeze(-1)
            p = logp.exp()
            # dH/dz_j = -p_j (log p_j + H), and 0 where p_j = 0 (the limit, instead of 0 * -inf)
            chunk_grad = torch.where(p > 0, -p * (logp + entropy[rows].unsqueeze(-1)), 0.0)
            grad_rows[rows] = chunk_grad * grad_out[rows].to(dtype).unsqueeze(-1)
        return grad, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``: ``logits[..., y] - logsumexp(logits)``.

    Args:
        logits: ``[..., V]`` floating logits (``[B, T, V]`` for a response); may be a non-contiguous slice.
        labels: ``[...]`` integer token ids in ``[0, V)``, the leading shape of ``logits``.
        chunk_size: rows up-cast and reduced at once (memory knob, the result does not depend on it).

    Returns:
        ``[...]`` log-probabilities in fp32 (fp64 for fp64 logits), differentiable w.r.t. ``logits``. A label whose
        logit is ``-inf`` gets ``-inf``.

    Raises:
        ValueError: shape mismatch, a label outside ``[0, V)``, or a row without a finite log-sum-exp.

    Example:
        >>> logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
        >>> logprobs_from_logits(logits, torch.tensor([1])).exp()
        tensor([0.2500])
    """
    logits = _check_logits(logits)
    labels = check_tensor("labels", labels)
    chunk_size = _check_chunk_size(chunk_size)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            "labels must match logits without its last (vocabulary) dimension"
        )
    flat_labels = labels.reshape(-1).long()
    vocab = logits.shape[-1]
    if flat_labels.numel() and bool(((flat_labels < 0) | (flat_labels >= vocab)).any()):
        raise ValueError(f"labels must lie in [0, {vocab}) (the vocabulary of logits)")
    return _LogProbs.apply(logits, flat_labels, chunk_size).view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits)`` over the last dimension.

    Args:
        logits: ``[..., V]`` floating logits (``[B, T, V]`` for a response); ``-inf`` entries are allowed.
        chunk_size: rows up-cast and reduced at once (memory knob, the result does not depend on it).

    Returns:
        ``[...]`` entropies in fp32 (fp64 for fp64 logits), differentiable w.r.t. ``logits``; ``-inf`` entries
        contribute 0 and get a zero gradient.

    Raises:
        ValueError: a row without a finite log-sum-exp (all ``-inf``, or NaN / ``+inf``).

    Example:
        >>> entropy_from_logits(torch.tensor([[0.0, 0.0, float("-inf")]]))
        tensor([0.6931])
    """
    logits = _check_logits(logits)
    chunk_size = _check_chunk_size(chunk_size)
    return _Entropy.apply(logits, chunk_size).view(logits.shape[:-1])
