"""Masked reverse linear recurrences behind GAE and discounted returns.

Both scans run backwards over the response dimension of ``[B, T]`` tensors and skip masked tokens: a masked
token neither adds its reward nor advances the discount, and it carries the running state unchanged, so one
discount step is applied across a whole gap of observation tokens (verl's multi-turn semantics).

The functions here are the dispatch points (:mod:`ppo_core.kernels.dispatch`): a Triton kernel on CUDA, a
vectorised PyTorch scan on CPU (no compiler needed) and elsewhere, all checked against the
per-timestep loops in :mod:`ppo_core.kernels.reference`. The ``*_checked`` forms are what the advantage estimators
call: exact zeros at masked positions and a non-finite flag set by the scan itself.
"""

from __future__ import annotations

from ppo_core.kernels.dispatch import (
    BACKENDS,
    available_backends,
    masked_discounted_return_checked,
    masked_discounted_return_scan,
    masked_gae_returns_checked,
    masked_gae_returns_scan,
    masked_gae_scan,
    masked_return_advantages_checked,
)

__all__ = [
    "BACKENDS",
    "available_backends",
    "masked_discounted_return_checked",
    "masked_discounted_return_scan",
    "masked_gae_returns_checked",
    "masked_gae_returns_scan",
    "masked_gae_scan",
    "masked_return_advantages_checked",
]
