"""``MonarchConfig.torch_threads``: the automatic split of a host's cores among its workers (pure)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core_monarch.worker import _torch_threads


@given(
    cores=st.integers(1, 256),
    local_size=st.integers(1, 16),
    requested=st.integers(0, 8),
    omp=st.sampled_from(["", "0", "3", "x", " 2 "]),
)
def test_threads_follow_request_then_omp_then_core_share(cores, local_size, requested, omp):
    env = {"OMP_NUM_THREADS": omp} if omp else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        got = _torch_threads(requested, local_size)
    if requested:
        expected = requested
    elif omp.strip().isdigit() and int(omp) > 0:
        expected = int(omp)
    else:  # oracle: the largest n >= 1 with n * local_size <= cores (1 when there are fewer cores than workers)
        expected = max([n for n in range(1, cores + 1) if n * local_size <= cores] or [1])
    assert got == expected
