"""Hugging Face Llama / Qwen2 configs <-> :class:`MegatronModelConfig`: the shape of a checkpoint, both ways.

:func:`model_config_from_hf` reads the shape of a ``transformers`` config (``AutoConfig.from_pretrained(path)``)
so that megatron workers built from a Hugging Face checkpoint need no hand-written shape; :func:`hf_config_from_model`
goes back (a ``Qwen2Config`` when the model has query/key/value biases, else a ``LlamaConfig``), for exporting a
model that was never loaded from Hugging Face. Only what the megatron model implements is accepted: SwiGLU
(``silu``), RMSNorm, plain rotary embeddings, ``head_dim == hidden_size / num_attention_heads``, no MLP or output
biases; anything else raises ``ValueError`` naming the config key.

Neither function imports megatron-core.

Example:
    >>> from transformers import Qwen2Config
    >>> cfg = model_config_from_hf(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True))
    >>> cfg.qkv_bias, cfg.num_query_groups, cfg.tie_word_embeddings
    (True, 2, True)
"""

from __future__ import annotations

from typing import Any

from ppo_core.workers.megatron.config import MEGATRON_SHAPE_KEYS, MegatronModelConfig

__all__ = ["MEGATRON_SHAPE_KEYS", "hf_config_from_model", "model_config_from_hf", "rope_theta_of"]


_FAMILIES = ("llama", "qwen2")


def rope_theta_of(hf_config: Any) -> float:
    """The rotary base of a ``transformers`` config: ``rope_parameters["rope_theta"]`` (transformers 5) or
    ``rope_theta``; ``ValueError`` for a scaled rotary embedding (``rope_type`` other than ``default``)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind != "default":
        raise ValueError(
            f"rope_parameters.rope_type={kind!r} is not supported by the megatron model (only 'default')"
        )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("the config has no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def model_config_from_hf(hf_config: Any, **overrides: Any) -> MegatronModelConfig:
    """The :class:`MegatronModelConfig` of a Llama / Qwen2 ``transformers`` config.

    Args:
        hf_config: a ``transformers`` config object (``LlamaConfig``, ``Qwen2Config`` or what ``AutoConfig``
            returns for them).
        **overrides: other :class:`MegatronModelConfig` fields (``dtype``, ``attention``, ``fused_kernels``...);
            the shape fields (:data:`MEGATRON_SHAPE_KEYS`) come from ``hf_config`` and may not be overridden.

    Raises:
        ValueError: an architecture or option the megatron model does not implement, naming the config key.
    """
    family = getattr(hf_config, "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not supported by the megatron workers; supported: {_FAMILIES}"
        )
    shape_overrides = sorted(set(overrides) & set(MEGATRON_SHAPE_KEYS))
    if shape_overrides:
        raise ValueError(f"{shape_overrides} come from the checkpoint's config and cannot be overridden")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (the megatron model uses SwiGLU: 'silu')")
    for flag in ("mlp_bias",):
        if getattr(hf_config, flag, False):
            raise ValueError(f"{flag}=True is not supported by the megatron model")
    hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(
            f"head_dim={head_dim} differs from hidden_size / num_attention_heads = {hidden / heads}; not supported"
        )
    qkv_bias = True if family == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
    return MegatronModelConfig(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        ffn_hidden_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rotary_base=rope_theta_of(hf_config),
        norm="RMSNorm",
        norm_epsilon=float(hf_config.rms_norm_eps),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **overrides,
    )


def hf_config_from_model(config: MegatronModelConfig, **extra: Any) -> Any:
    """A ``transformers`` config with the shape of ``config``: ``Qwen2Config`` with query/key/value biases, else
    ``LlamaConfig`` (``extra`` adds fields such as ``eos_token_id``).

    Raises:
        ValueError: a LayerNorm model (Llama and Qwen2 use RMSNorm).
    """
    if config.norm != "RMSNorm":
        raise ValueError(f"norm={config.norm!r} has no Llama/Qwen2 equivalent (they use RMSNorm)")
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        hidden_act="silu",
        rope_theta=config.rotary_base,  # transformers 5 moves it into rope_parameters
        dtype=config.dtype,
        **extra,
    )
    if config.qkv_bias:
        out = Qwen2Config(**common, use_sliding_window=False)
    else:
        out = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if rope_theta_of(out) != config.rotary_base:  # pragma: no cover - a transformers that dropped it
        raise ValueError(f"{type(out).__name__} did not take rope_theta={config.rotary_base}")
    return out
