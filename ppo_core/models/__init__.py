"""Small reference models for tests and examples."""

from __future__ import annotations

from ppo_core.models.tiny_gpt import KVCache, TinyGPT, TinyGPTConfig

__all__ = ["KVCache", "TinyGPT", "TinyGPTConfig"]
