"""Private helpers of the PPO workers, whatever the engine: key checks, row splitting, and the
mini-batching and loss denominators that make micro-batch gradients add up to the mini-batch gradient over all
data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.batch import iter_minibatches, partition_by_token_budget
from ppo_core.keys import KEYS

__all__: list[str] = []


def resolve_device(device: str | None, local_rank: int = 0) -> torch.device:
    """``device`` as a ``torch.device``; None means ``cuda:<local_rank>`` when CUDA is available, else CPU.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_keys(batch: TensorDictBase, keys: Iterable[str], method: str) -> None:
    """Raise ``ValueError`` naming ``method``, the keys it needs and the missing ones, unless ``batch`` has all."""
    keys = tuple(keys)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{method} needs batch keys {list(keys)}; missing {missing}")


def split_rows(batch: TensorDictBase, size: int | None) -> list[TensorDictBase]:
    """``batch`` cut into consecutive chunks of ``size`` rows (the last may be smaller); None keeps it whole."""
    n = int(batch.batch_size[0])
    if size is None or size >= n:
        return [batch]
    return [batch[i : i + size] for i in range(0, n, size)]


def split_micro_batches(
    batch: TensorDictBase, *, rows: int | None, max_tokens: int | None
) -> tuple[list[TensorDictBase], torch.Tensor | None]:
    """``batch`` cut into micro-batches: by token budget when ``max_tokens`` is set, else by ``rows`` (:func:`split_rows`).

    With a budget, the micro-batches are :func:`~ppo_core.batch.partition_by_token_budget` of the rows' valid token
    counts (``attention_mask`` sums): at most ``max_tokens`` each, balanced, a longer row alone.

    Returns:
        ``(micros, order)``: ``order`` is the ``[B]`` int64 row order the micro-batches hold when concatenated
        (on the batch's device), None when they hold the rows in order.
    """
    if max_tokens is None or int(batch.batch_size[0]) == 0:
        return split_rows(batch, rows), None
    lengths = batch[KEYS.attention_mask].sum(-1)
    indices = [
        torch.tensor(p, dtype=torch.int64, device=lengths.device)
        for p in partition_by_token_budget(lengths, max_tokens)
    ]
    return [batch[i] for i in indices], torch.cat(indices)


def local_minibatches(
    batch: TensorDictBase,
    *,
    ppo_mini_batch_size: int,
    ppo_epochs: int,
    shuffle: bool,
    generator: torch.Generator,
    dp_rank: int,
    dp_size: int,
) -> Iterator[TensorDictBase]:
    """This rank's mini-batches for every epoch, each ``ppo_mini_batch_size / dp_size`` rows.

    ``ppo_mini_batch_size`` counts responses over all data-parallel ranks.
    """
    local = ppo_mini_batch_size // dp_size
    n = int(batch.batch_size[0])
    if n % local:
        raise ValueError(
            f"the batch of {n} rows on dp rank {dp_rank} is not a multiple of the local mini-batch size "
            f"{local} (ppo_mini_batch_size={ppo_mini_batch_size} / dp_size={dp_size})"
        )
    return iter_minibatches(batch, local, epochs=ppo_epochs, shuffle=shuffle, generator=generator)


def global_loss_denominators(
    mask: torch.Tensor,
    *,
    dp_size: int,
    loss_scale_factor: float | None,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """``agg_loss`` keywords normalising a mini-batch by its token and row counts summed over all dp ranks, so that
    the losses of its micro-batches, on every rank, add up to the loss of the whole mini-batch.

    Args:
        mask: ``[b, T]`` loss mask of this rank's mini-batch.
        dp_size: number of data-parallel ranks.
        loss_scale_factor: passed through (``seq-mean-token-sum-norm``).
        all_reduce_sum: sums a float64 ``[2]`` tensor over the data-parallel group (identity when ``dp_size == 1``).
    """
    counts = torch.stack(
        [
            mask.sum().to(torch.float64),
            torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device),
        ]
    )
    counts = all_reduce_sum(counts)
    return {
        "dp_size": dp_size,
        "batch_num_tokens": counts[0],
        "global_batch_size": counts[1],
        "loss_scale_factor": loss_scale_factor,
    }


def first_nonfinite_grad(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """Name of the first gradient with a NaN or inf entry (None if there is none); one host sync per gradient,
    for diagnosing a skipped optimiser step only."""
    for name, grad in named_grads:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return name
    return None
