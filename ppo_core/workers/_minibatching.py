"""Mini-batching and loss denominators shared by every PPO worker (torch, megatron): one implementation of the
rules that make micro-batch gradients add up to the mini-batch gradient over all data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.batch import iter_minibatches

__all__: list[str] = []


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
    """``agg_loss`` keywords normalising a mini-batch by its size over all dp ranks (pitfall 13).

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
