"""Training and validation metrics: batch statistics, timing and throughput, validation N-sample metrics.

Every function returns plain ``{name: float}`` dicts under verl's metric names, ready for a logger.

Example:
    >>> from ppo_core.metrics import Timer, reduce_metrics
    >>> timer = Timer()
    >>> with timer("step"):
    ...     pass
    >>> reduce_metrics([{"loss": 1.0}, {"loss": 2.0}])
    {'loss': 1.5}
"""

from __future__ import annotations

from ppo_core.metrics.data import VF_EXPLAINED_VAR_EPS, compute_data_metrics
from ppo_core.metrics.reduce import reduce_metrics
from ppo_core.metrics.rollout import rollout_probs_diff_metrics
from ppo_core.metrics.timing import (
    ALL_TOKEN_TIMERS,
    RESPONSE_TOKEN_TIMERS,
    Timer,
    compute_throughput_metrics,
    compute_timing_metrics,
)
from ppo_core.metrics.validation import (
    VOTE_KEY,
    bootstrap,
    flatten_validation_metrics,
    majority_vote,
    process_validation_metrics,
)

__all__ = [
    "ALL_TOKEN_TIMERS",
    "RESPONSE_TOKEN_TIMERS",
    "VF_EXPLAINED_VAR_EPS",
    "VOTE_KEY",
    "Timer",
    "bootstrap",
    "compute_data_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "flatten_validation_metrics",
    "majority_vote",
    "process_validation_metrics",
    "reduce_metrics",
    "rollout_probs_diff_metrics",
]
