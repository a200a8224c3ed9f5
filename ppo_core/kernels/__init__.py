"""Masked reverse linear recurrences behind GAE and discounted returns.

Both scans run backwards over the response dimension of ``[B, T]`` tensors and skip masked tokens: a masked
token neither adds its reward nor advances the discount, and it carries the running state unchanged, so one
discount step is applied across a whole gap of observation tokens (verl's multi-turn semantics).

The functions here are the dispatch points; fast paths live in the submodules.
"""

from __future__ import annotations

from ppo_core.kernels.reference import masked_discounted_return_scan, masked_gae_scan

__all__ = ["masked_discounted_return_scan", "masked_gae_scan"]
