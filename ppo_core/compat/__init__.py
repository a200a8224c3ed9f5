"""Adapters for users coming from other libraries: :func:`ppo_config_from_verl` reads a verl PPO config."""

from __future__ import annotations

from ppo_core.compat.verl import ppo_config_from_verl

__all__ = ["ppo_config_from_verl"]
