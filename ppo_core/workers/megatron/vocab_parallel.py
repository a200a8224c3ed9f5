"""Log-probabilities and entropies from vocabulary-parallel logits, without gathering the vocabulary.

With tensor parallelism the output layer leaves each of the ``TP`` ranks a slice ``[N, V/TP]`` of the logits
(rank ``r`` holds vocabulary ids ``[r V/TP, (r+1) V/TP)``). Gathering ``[N, V]`` on every rank would cost ``TP``
times the memory; instead three numbers per row are reduced over the TP group:

- ``m = max_v z_v`` (all-reduce MAX), so every exponential is ``<= 1``;
- ``S = sum_v exp(z_v - m)`` and ``E = sum_v exp(z_v - m) (z_v - m)`` (all-reduce SUM);
- the target logit ``z_y - m``, non-zero only on the rank that owns ``y`` (all-reduce SUM).

Then ``log p_y = (z_y - m) - log S`` and ``H = log S - E / S``. The backward needs no communication: with ``p``
the global softmax (rebuilt locally from the saved ``m + log S``), ``d log p_y / d z_v = [v = y] - p_v`` and
``dH / dz_v = -p_v (log p_v + H)``, both local to the rank that owns ``v``; the column-parallel output layer's own
backward then all-reduces the input gradient. Computation is in fp32 (fp64 for fp64 logits), chunked over rows
so that only one chunk is ever up-cast; logits beyond ``vocab_size`` (megatron's vocabulary padding) are ignored.

Example:
    >>> logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    >>> vocab_parallel_log_probs(logits, torch.tensor([0])).exp()
    tensor([0.5000])
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ppo_core.kernels.compiled import cuda_compiled

__all__ = [
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
]

_CHUNK_ROWS = 2048


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, size: int) -> None:
    if size > 1:
        dist.all_reduce(t, op=op, group=group)


def _chunks(n: int) -> Iterator[slice]:
    for start in range(0, n, _CHUNK_ROWS):
        yield slice(start, min(n, start + _CHUNK_ROWS))


@cuda_compiled
def _chunk_sums(
    chunk: torch.Tensor,
    m: torch.Tensor,
    local_label: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[3, n]``: ``sum exp(z - m)``, ``sum exp(z - m) (z - m)`` and the owned target's ``z - m`` of a chunk."""
    z = chunk.to(dtype) - m.unsqueeze(-1)
    e = z.exp()
    total = e.sum(dim=-1)
    # masked (-inf) entries have e = 0 and contribute 0 * -inf := 0
    ez = torch.where(e > 0, e * z, 0.0).sum(dim=-1) if with_entropy else torch.zeros_like(total)
    cols = torch.arange(z.shape[-1], device=z.device)
    hit = (cols == local_label.unsqueeze(-1)) & owned.unsqueeze(-1)
    picked = torch.where(hit, z, 0.0).sum(dim=-1)
    return torch.stack([total, ez, picked])


@cuda_compiled
def _chunk_grad(
    chunk: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g1: torch.Tensor,
    g2: torch.Tensor,
    local_label: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``d(g1 log p_y + g2 H)/dz = g1 ([v = y] - p_v) - g2 p_v (log p_v + H)`` of a chunk, in the chunk's dtype."""
    logp = chunk.to(dtype) - lse.unsqueeze(-1)
    p = logp.exp()
    coeff = g1.unsqueeze(-1)
    if with_entropy:
        # where p = 0 (a -inf logit) the limit of p log p is 0: keep the product from becoming NaN
        coeff = coeff + g2.unsqueeze(-1) * torch.where(p > 0, logp + entropy.unsqueeze(-1), 0.0)
    cols = torch.arange(chunk.shape[-1], device=chunk.device)
    hit = (cols == local_label.unsqueeze(-1)) & owned.unsqueeze(-1)
    return (torch.where(hit, g1.unsqueeze(-1), 0.0) - p * coeff).to(chunk.dtype)


class _VocabParallel(torch.autograd.Function):
    """Outputs ``(log_prob [N], entropy [N])``; the entropy is zeros when ``with_entropy`` is False."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, size, with_entropy, validate):  # type: ignore[override]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        n, local_v = logits.shape
        m = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)
        if local_v:
            for rows in _chunks(n):
                m[rows] = logits[rows].amax(dim=-1).to(dtype)
        _all_reduce(m, dist.ReduceOp.MAX, group, size)
        if validate and n and not bool(torch.isfinite(m).all()):
            raise ValueError("logits has a row whose maximum is not finite (NaN, +inf or every entry -inf)")
        local_label = labels - vocab_start
        owned = (local_label >= 0) & (local_label < local_v)
        local_label = torch.where(owned, local_label, torch.zeros_like(local_label))
        sums = torch.zeros(3, n, dtype=dtype, device=logits.device)  # S, E, z_y - m
        for rows in _chunks(n):
            sums[:, rows] = _chunk_sums(
                logits[rows], m[rows], local_label[rows], owned[rows], bool(with_entropy), dtype
            )
        _all_reduce(sums, dist.ReduceOp.SUM, group, size)
        log_s = sums[0].log()
        log_prob = sums[2] - log_s
        entropy = log_s - sums[1] / sums[0] if with_entropy else torch.zeros_like(log_prob)
        ctx.save_for_backward(logits, local_label, owned, m + log_s, entropy)
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return log_prob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        logits, local_label, owned, lse, entropy = ctx.saved_tensors
        dtype = lse.dtype
        g1 = grad_logp.to(dtype) if grad_logp is not None else torch.zeros_like(lse)
        with_entropy = bool(ctx.with_entropy and grad_ent is not None)
        g2 = grad_ent.to(dtype) if with_entropy else torch.zeros_like(lse)
        grad = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0]):
            grad[rows] = _chunk_grad(
                logits[rows],
                lse[rows],
                entropy[rows],
                g1[rows],
                g2[rows],
                local_label[rows],
                owned[rows],
                with_entropy,
                dtype,
            )
        return grad, None, None, None, None, None, None


def _prepare(
    logits: torch.Tensor, group: dist.ProcessGroup | None, vocab_size: int | None
) -> tuple[torch.Tensor, int, int, int]:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError(f"logits must have shape [..., V/TP], got {tuple(logits.shape)}")
    rank, size = _group_rank_size(group)
    local_v = logits.shape[-1]
    start = rank * local_v
    flat = logits.reshape(-1, local_v)
    if vocab_size is not None:
        if vocab_size < 1 or vocab_size > local_v * size:
            raise ValueError(
                f"vocab_size must be in [1, {local_v * size}] (the padded vocabulary), got {vocab_size}"
            )
        # megatron pads the vocabulary to a multiple of TP; the padded columns are not tokens
        flat = flat[:, : max(0, min(local_v, vocab_size - start))]
    return flat, start, size, local_v


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(labels)`` and the entropy of ``softmax(logits)`` over a vocabulary split across ``group``.

    Args:
        logits: ``[..., V/TP]`` this rank's slice of the logits (rank ``r`` of ``group`` owns ids
            ``[r V/TP, (r+1) V/TP)``); bf16/fp16/fp32/fp64.
        labels: ``[...]`` global token ids in ``[0, vocab_size)``, the same on every rank of ``group``.
        group: the tensor-parallel process group; None (or no ``torch.distributed``) means one rank.
        vocab_size: the true vocabulary (ids at or beyond it are padding and excluded); None: all columns.
        with_entropy: False skips the entropy (returned as zeros, not differentiable).
        validate: check label ranges and finite row maxima (two host syncs); a training loop whose labels come
            from the model's own vocabulary may turn it off.

    Returns:
        ``(log_probs [...], entropy [...])`` in fp32 (fp64 for fp64 logits), identical on every rank of
        ``group`` and differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``labels`` shape mismatch, a label outside ``[0, vocab_size)``, or a row with a non-finite
            maximum.

    Example:
        >>> lp, h = vocab_parallel_log_probs_and_entropy(torch.zeros(1, 4), torch.tensor([2]))
        >>> lp.exp(), h.exp()
        (tensor([0.2500]), tensor([4.]))
    """
    flat, start, size, local_v = _prepare(logits, group, vocab_size)
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError("labels must be an integer tensor")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; labels must "
            "match logits without its last (vocabulary) dimension"
        )
    limit = vocab_size if vocab_size is not None else local_v * size
    flat_labels = labels.reshape(-1).long()
    if validate and flat_labels.numel() and bool(((flat_labels < 0) | (flat_labels >= limit)).any()):
        raise ValueError(f"labels must lie in [0, {limit})")
    log_prob, entropy = _VocabParallel.apply(
        flat, flat_labels, start, group, size, bool(with_entropy), bool(validate)
    )
    return log_prob.view(labels.shape), entropy.view(labels.shape)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``log softmax(logits)[labels]`` over a vocabulary split across ``group`` (see the module docstring).

    Args:
        logits: ``[..., V/TP]``; labels: ``[...]`` global ids; group: the TP group; vocab_size: true vocabulary.

    Returns:
        ``[...]`` fp32 log-probabilities, differentiable w.r.t. ``logits``.

    Example:
        >>> vocab_parallel_log_probs(torch.log(torch.tensor([[0.5, 0.5]])), torch.tensor([1])).exp()
        tensor([0.5000])
    """
    return vocab_parallel_log_probs_and_entropy(
        logits, labels, group, vocab_size=vocab_size, with_entropy=False
    )[0]


def vocab_parallel_entropy(
    logits: torch.Tensor, group: dist.ProcessGroup | None = None, *, vocab_size: int | None = None
) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits)`` over a vocabulary split across ``group``.

    Args:
        logits: ``[..., V/TP]``; group: the TP group; vocab_size: true vocabulary.

    Returns:
        ``[...]`` fp32 entropies, differentiable w.r.t. ``logits``.

    Example:
        >>> vocab_parallel_entropy(torch.zeros(1, 2)).exp()
        tensor([2.])
    """
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return vocab_parallel_log_probs_and_entropy(logits, labels, group, vocab_size=vocab_size)[1]
