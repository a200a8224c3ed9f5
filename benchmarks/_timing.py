"""The median time of a call, for the benchmark scripts that time one function many times (``advantages.py``,
``batch_invariant.py``; :func:`graph_us` for a kernel's time without the host's launches, ``decode_attention.py``)."""

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


CALLS_PER_GRAPH = 20
"""Calls of the function captured in the CUDA graph :func:`graph_us` replays."""


def graph_us(fn: Callable[[], object], replays: int = 30) -> float:
    """Median microseconds of one call of ``fn`` (CUDA), from replays of a CUDA graph of :data:`CALLS_PER_GRAPH`
    back-to-back calls: the device's time, no launch overhead from the host. ``fn`` runs once eagerly and once on a
    side stream first (compilation, allocator warm-up) before the capture."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)
