"""Mini-batch iteration over a batch for several PPO epochs, deterministic given a ``torch.Generator``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tensordict import TensorDictBase

from ppo_core.batch._td import _check_batch, _rows

__all__ = ["iter_minibatches"]


def iter_minibatches(
    batch: TensorDictBase,
    minibatch_size: int,
    epochs: int = 1,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[TensorDictBase]:
    """Yield ``epochs * B / minibatch_size`` mini-batches; each epoch visits every row exactly once.

    With ``shuffle=True`` every epoch draws a fresh permutation from ``generator`` (the only source of randomness:
    the same generator state gives the same mini-batches, and the global RNG is never used). With
    ``shuffle=False`` the mini-batches are consecutive rows in order. There is no remainder policy: ``B`` must be
    a multiple of ``minibatch_size`` (pad or drop rows explicitly beforehand), so no row is silently skipped or
    visited twice. Arguments are checked when the function is called, not at the first ``next()``.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        minibatch_size: rows per mini-batch, ``>= 1``, dividing ``B``.
        epochs: passes over the batch, ``>= 0``.
        shuffle: permute the rows at the start of every epoch.
        generator: a CPU ``torch.Generator``, required when ``shuffle=True``.

    Yields:
        TensorDicts of ``minibatch_size`` rows with their own storage (``mb_`` tensors ``[minibatch_size, ...]``).

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"x": torch.arange(6)}, batch_size=[6])
        >>> gen = torch.Generator().manual_seed(0)
        >>> mbs = list(iter_minibatches(b, 3, epochs=2, generator=gen))
        >>> len(mbs), sorted(torch.cat([m["x"] for m in mbs[:2]]).tolist())
        (4, [0, 1, 2, 3, 4, 5])
    """
    size = _check_batch("batch", batch)
    if isinstance(minibatch_size, bool) or not isinstance(minibatch_size, int) or minibatch_size < 1:
        raise ValueError(f"minibatch_size must be an int >= 1, got {minibatch_size!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0, got {epochs!r}")
    if size % minibatch_size != 0:
        raise ValueError(
            f"minibatch_size={minibatch_size} does not divide the batch size {size}; "
            f"use a divisor of {size} or pad/drop rows first"
        )
    if shuffle and not isinstance(generator, torch.Generator):
        raise ValueError(
            "shuffle=True needs generator=torch.Generator().manual_seed(seed): the global RNG is never used"
        )
    return _minibatches(batch, size, minibatch_size, epochs, shuffle, generator)


def _minibatches(
    batch: TensorDictBase,
    size: int,
    minibatch_size: int,
    epochs: int,
    shuffle: bool,
    generator: torch.Generator | None,
) -> Iterator[TensorDictBase]:
    for _ in range(epochs):
        order = torch.randperm(size, generator=generator) if shuffle else torch.arange(size)
        for start in range(0, size, minibatch_size):
            yield _rows(batch, order[start : start + minibatch_size])
