"""Public testing utilities: hypothesis strategies for PPO-shaped data and slow, obviously-correct oracles.

Users import these to property-test their own implementations against ours::

    from ppo_core.testing import ppo_batches, gae_oracle
"""

from __future__ import annotations

from ppo_core.testing.strategies import PPOBatch, group_ids, mask_rows, ppo_batches, response_masks

__all__ = ["PPOBatch", "group_ids", "mask_rows", "ppo_batches", "response_masks"]
