"""Hypothesis profiles: ``ci`` (thorough, used by .ci/run) and ``dev`` (fast local runs, the default)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# Tests use small tensors: intra-op threads only add contention on the 2-core CI machine.
torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=200,
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
