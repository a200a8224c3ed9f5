"""ppo-core: composable, property-tested PPO building blocks for RL post-training of language models."""

from __future__ import annotations

from ppo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten

__version__ = "0.1.0.dev0"

__all__ = ["__version__", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]
