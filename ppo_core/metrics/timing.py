"""Wall-clock timing of the stages of a step, and the per-token and throughput metrics derived from it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from tensordict import TensorDictBase

from ppo_core.metrics._lengths import _Lengths, _lengths

__all__ = [
    "ALL_TOKEN_TIMERS",
    "RESPONSE_TOKEN_TIMERS",
    "Timer",
    "compute_throughput_metrics",
    "compute_timing_metrics",
]

RESPONSE_TOKEN_TIMERS = ("gen",)
"""Timers whose per-token time is divided by the number of response tokens (generation)."""
ALL_TOKEN_TIMERS = ("ref", "values", "adv", "update_critic", "update_actor")
"""Timers whose per-token time is divided by prompt + response tokens (forward/backward passes)."""


class Timer:
    """Collects named wall times; ``with timer("name"):`` blocks may nest and repeat (times add up).

    Nested names are recorded independently (``step`` includes the time of a ``gen`` inside it). Re-entering a
    name that is still open raises ``ValueError``, because its time would be counted twice. A block that raises
    still records its time.

    Args:
        clock: a function returning seconds (``time.perf_counter`` by default; inject a fake one in tests).

    Example:
        >>> timer = Timer()
        >>> with timer("step"):
        ...     with timer("gen"):
        ...         pass
        >>> sorted(timer.times)
        ['gen', 'step']
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._open: list[str] = []
        self.times: dict[str, float] = {}
        """Seconds per name, summed over every block of that name since the last :meth:`reset`."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if name in self._open:
            raise ValueError(f"timer {name!r} is already running (open timers: {self._open})")
        self._open.append(name)
        start = self._clock()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + (self._clock() - start)
            self._open.remove(name)

    def reset(self) -> dict[str, float]:
        """Return the collected times and start afresh (call once per step)."""
        times, self.times = self.times, {}
        return times


def compute_timing_metrics(
    batch: TensorDictBase | None, timing: Mapping[str, float], *, lengths: _Lengths | None = None
) -> dict[str, float]:
    """``timing_s/{name}`` for every timer and ``timing_per_token_ms/{name}`` for the known stages.

    Args:
        batch: the step's batch: ``response_mask`` ``[B, T]`` and, to count prompt tokens, ``attention_mask``
            ``[B, P + T]`` (without it prompt tokens count as 0).
        timing: seconds per stage name (e.g. ``Timer.times``).
        lengths: the batch's lengths instead of ``batch`` (a resident step's,
            :func:`~ppo_core.metrics.partial.lengths_of_parts`).

    Returns:
        ``timing_s/{name}`` (seconds) for all names; ``timing_per_token_ms/{name} = 1000 * t / tokens`` for names
        in :data:`RESPONSE_TOKEN_TIMERS` (response tokens) and :data:`ALL_TOKEN_TIMERS` (prompt + response
        tokens); 0.0 when the batch has no such token.

    Raises:
        ValueError: a negative or non-finite time, naming the timer (it would log a negative or NaN metric).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"response_mask": torch.ones(2, 3)}, batch_size=[2])
        >>> compute_timing_metrics(b, {"gen": 0.6})["timing_per_token_ms/gen"]
        100.0
    """
    seconds_by_name = {name: _seconds(timing, name) for name in timing}
    lengths = _lengths(batch) if lengths is None else lengths
    counts = {name: lengths.response_tokens for name in RESPONSE_TOKEN_TIMERS}
    counts |= {name: lengths.all_tokens for name in ALL_TOKEN_TIMERS}
    metrics = {f"timing_s/{name}": seconds for name, seconds in seconds_by_name.items()}
    for name, seconds in seconds_by_name.items():
        if name in counts:
            tokens = counts[name]
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens if tokens else 0.0
    return metrics


def _seconds(timing: Mapping[str, float], name: str) -> float:
    """``timing[name]`` as a float; a negative or non-finite time (a broken clock or subtraction) raises."""
    value = timing[name]
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"timing[{name!r}] must be a number of seconds, got {type(value).__name__}") from exc
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"timing[{name!r}] must be a finite number of seconds >= 0, got {seconds}")
    return seconds


def compute_throughput_metrics(
    batch: TensorDictBase | None,
    timing: Mapping[str, float],
    n_gpus: int,
    step_key: str = "step",
    *,
    lengths: _Lengths | None = None,
) -> dict[str, float]:
    """Tokens processed per second per GPU for the step.

    Args:
        batch: the step's batch (``response_mask`` ``[B, T]``, optional ``attention_mask`` ``[B, P + T]``).
        timing: seconds per stage; must contain ``step_key``.
        n_gpus: number of GPUs the step ran on, ``>= 1``.
        step_key: name of the whole-step timer.
        lengths: the batch's lengths instead of ``batch`` (see :func:`compute_timing_metrics`).

    Returns:
        ``perf/total_num_tokens`` (prompt + response tokens), ``perf/time_per_step`` and ``perf/throughput =
        tokens / (time * n_gpus)``, which is 0.0 when the step time is 0 (verl divides by zero).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"response_mask": torch.ones(2, 300)}, batch_size=[2])
        >>> compute_throughput_metrics(b, {"step": 2.0}, n_gpus=2)["perf/throughput"]
        150.0
    """
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ValueError(f"n_gpus must be an int >= 1, got {n_gpus!r}")
    if step_key not in timing:
        raise KeyError(f"timing has no {step_key!r} entry; it has {sorted(timing)}")
    seconds = _seconds(timing, step_key)
    tokens = (_lengths(batch) if lengths is None else lengths).all_tokens
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/time_per_step": seconds,
        "perf/throughput": tokens / (seconds * n_gpus) if seconds > 0 else 0.0,
    }
