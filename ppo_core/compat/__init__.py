"""Adapters for users coming from other libraries: :func:`convert_verl` / :func:`ppo_config_from_verl` read a verl
PPO config."""

from __future__ import annotations

from ppo_core.compat.verl import VerlConversion, convert_verl, ppo_config_from_verl

__all__ = ["VerlConversion", "convert_verl", "ppo_config_from_verl"]
