"""A tiny megatron model shape shared by the CPU megatron tests (imported as ``from _megatron import ...``)."""

from __future__ import annotations

from typing import Any

from ppo_core.workers.megatron import MegatronModelConfig


def tiny_config(**kw: Any) -> MegatronModelConfig:
    """Two layers, width 32, grouped-query attention, a padded vocabulary of 70 (to 72), fp32."""
    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=70,
        max_position_embeddings=32,
        dtype="float32",
        make_vocab_size_divisible_by=8,
    )
    return MegatronModelConfig(**{**base, **kw})
