"""Models: a tiny GPT for tests and examples, and Hugging Face causal LMs in and out (:mod:`ppo_core.models.hf`).

``ppo_core.models.hf`` imports ``transformers`` only when a function needs it (the ``hf`` extra).
"""

from __future__ import annotations

from ppo_core.models.hf import (
    CausalLMWithValueHead,
    HFCausalLM,
    export_actor_checkpoint,
    export_hf,
    load_causal_lm,
    load_value_model,
)
from ppo_core.models.tiny_gpt import KVCache, TinyGPT, TinyGPTConfig

__all__ = [
    "CausalLMWithValueHead",
    "HFCausalLM",
    "KVCache",
    "TinyGPT",
    "TinyGPTConfig",
    "export_actor_checkpoint",
    "export_hf",
    "load_causal_lm",
    "load_value_model",
]
