"""Rollout correction: importance weights and rejection against the mismatch between the sampler's and the
training forward's probabilities (verl's ``algorithm.rollout_correction``; ``docs/semantics.md``).

:func:`compute_rollout_correction` is the pure function on ``[B, T]`` tensors; :class:`RolloutCorrectionConfig` its
settings, the ``algorithm.rollout_correction`` section of the trainer's configuration.
"""

from __future__ import annotations

from ppo_core.rollout_correction.compute import compute_rollout_correction
from ppo_core.rollout_correction.config import (
    ROLLOUT_RS_OPTIONS,
    RejectionBound,
    RolloutCorrectionConfig,
    parse_rollout_rs,
)

__all__ = [
    "ROLLOUT_RS_OPTIONS",
    "RejectionBound",
    "RolloutCorrectionConfig",
    "compute_rollout_correction",
    "parse_rollout_rs",
]
