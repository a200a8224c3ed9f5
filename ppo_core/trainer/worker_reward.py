"""A reward that runs where the responses are: on the ranks holding a resident batch (``trainer.resident_batches``).

Wrap a picklable reward function (a module-level function, or an object of an importable class) in
:class:`WorkerReward` and pass it as the trainer's ``reward_fn``. With resident batches each data-parallel rank
calls it on its own rows (the generation keys in ``reads``, the prompts' fields in ``fields``), keeps the
token-level scores with the rows and sends back only ``[b]`` row scores and the extra infos; no ``[B, R]`` tensor
reaches the controller. In a by-value step (and in validation) it is an ordinary reward function: the controller
calls it on the whole batch, so both paths score the same rows with the same function.

A controller-side reward (any other callable) may carry a ``reads`` attribute naming the generation keys it reads:
a resident step then fetches exactly those (counted in ``perf/controller_bytes``) instead of the whole generation.

Example:
    >>> import torch
    >>> def length_score(batch):
    ...     return batch["response_mask"].sum(-1).float()
    >>> reward = WorkerReward(length_score, reads=("response_mask",))
    >>> from tensordict import TensorDict
    >>> reward(TensorDict({"response_mask": torch.ones(2, 3)}, batch_size=[2]))
    tensor([3., 3.])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase

from ppo_core.keys import KEYS

__all__ = ["WorkerReward", "reward_reads"]


@dataclasses.dataclass(frozen=True)
class WorkerReward:
    """A picklable reward function the ranks holding the responses run (see the module docstring).

    ``fn(batch)`` returns what any reward function returns (``[b]`` or ``[b, R]`` scores, optionally with extra
    infos, see :mod:`ppo_core.trainer.reward`), but synchronously: no Future or awaitable.
    """

    fn: Callable[[TensorDictBase], Any]
    """The reward function; pickled to every rank (a module-level function or an importable class's object)."""
    reads: tuple[str, ...] = (KEYS.responses, KEYS.response_mask)
    """The generation keys it reads (``response_mask`` is always added: it places the scores)."""
    fields: tuple[str, ...] = ()
    """The prompts' per-row fields it reads (``ground_truth``, ``data_source``, ``uid``...), sent to the ranks."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"WorkerReward.fn must be callable, got {type(self.fn).__name__}")
        for name in ("reads", "fields"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"WorkerReward.{name} must be a tuple of key names, got {value!r}")
            object.__setattr__(self, name, tuple(value))

    def __call__(self, batch: TensorDictBase) -> Any:
        """Score a whole batch on the controller (the by-value step, validation)."""
        return self.fn(batch)


def reward_reads(reward_fn: Any) -> tuple[str, ...] | None:
    """The generation keys a controller-side reward declares in a ``reads`` attribute (None: every key)."""
    reads = getattr(reward_fn, "reads", None)
    if reads is None:
        return None
    if isinstance(reads, str) or not all(isinstance(k, str) for k in reads):
        raise TypeError(f"reward_fn.reads must be a tuple of key names, got {reads!r}")
    return tuple(reads)
