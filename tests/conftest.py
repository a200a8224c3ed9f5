"""Hypothesis profiles: ``ci`` (thorough, used by .ci/run) and ``dev`` (fast local runs, the default)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# Tests use small tensors: intra-op threads only add contention on the 2-core CI machine.
torch.set_num_threads(1)

# ci: 100 examples (200 kept .ci/run's tests at 10 min 4 s to 11 min 15 s on the 2-core CI machine, over the
# suite's 10-minute budget); derandomised, so every run checks the same examples
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
