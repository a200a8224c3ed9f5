"""The median time of a call, for the benchmark scripts that time one function many times (``advantages.py``,
``batch_invariant.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device: str | torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` calls after ``warmup`` untimed ones (CUDA: device events
    around each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    cuda = torch.device(device).type == "cuda"
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
