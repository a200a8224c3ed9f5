"""Hugging Face Llama / Qwen2 safetensors <-> megatron-core ``GPTModel`` state dicts (QKV and gate/up fusion).

Name and layout mapping (``i`` a global layer index; megatron names use the stage-local index):

======================================================= ===================================================
Hugging Face                                            megatron-core (this TP rank's shard)
======================================================= ===================================================
``model.embed_tokens.weight [V, D]``                    ``embedding.word_embeddings.weight [Vp/TP, D]``
``model.layers.i.input_layernorm.weight``               ``decoder.layers.i.input_layernorm.weight``
``q_proj [h d, D]``, ``k_proj``/``v_proj [g d, D]``     ``self_attention.linear_qkv.weight``: per key/value
                                                        group ``[q of its h/g heads; k; v]``, TP-split by group
``o_proj [D, h d]``                                     ``self_attention.linear_proj.weight [D, h d/TP]``
``post_attention_layernorm.weight``                     ``pre_mlp_layernorm.weight``
``gate_proj``, ``up_proj [F, D]``                       ``mlp.linear_fc1.weight [2F/TP, D]`` = ``[gate_r; up_r]``
``down_proj [D, F]``                                    ``mlp.linear_fc2.weight [D, F/TP]``
``model.norm.weight``                                   ``decoder.final_layernorm.weight``
``lm_head.weight [V, D]``                               ``output_layer.weight [Vp/TP, D]``
======================================================= ===================================================

Padded vocabulary rows (``V <= id < Vp``) are zero. :func:`hf_to_megatron` and :func:`megatron_to_hf` are pure
functions over dicts of tensors (one per TP rank for the latter), so the mapping is tested without a GPU.

Example:
    >>> # load_hf_checkpoint(model, "/path/to/Qwen2.5-0.5B", config, parallel)
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence

import torch

from ppo_core.models.safetensors_files import check_safetensors_file
from ppo_core.workers.megatron.config import MegatronModelConfig, ParallelConfig
from ppo_core.workers.megatron.model import padded_vocab_size

__all__ = ["hf_to_megatron", "load_hf_checkpoint", "megatron_to_hf", "read_safetensors"]

_HF_LAYER = "model.layers.{i}."
_MG_LAYER = "decoder.layers.{j}."


def _layer_range(config: MegatronModelConfig, pp_rank: int, pp_size: int) -> range:
    per = config.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _split_rows(t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=0)[tp_rank]


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    out = t.new_zeros((padded, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: MegatronModelConfig) -> torch.Tensor:
    """``[g * (h/g + 2) * d, ...]``: for each group its query heads, then its key, then its value."""
    g, d = config.kv_heads, config.head_dim
    per = config.num_attention_heads // g
    q_g = q.reshape(g, per * d, *q.shape[1:])
    k_g = k.reshape(g, d, *k.shape[1:])
    v_g = v.reshape(g, d, *v.shape[1:])
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *q.shape[1:])


def _unfuse_qkv(qkv: torch.Tensor, config: MegatronModelConfig) -> tuple[torch.Tensor, ...]:
    g, d = config.kv_heads, config.head_dim
    per = config.num_attention_heads // g
    grouped = qkv.reshape(g, (per + 2) * d, *qkv.shape[1:])
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    config: MegatronModelConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    value_head: bool = False,
) -> dict[str, torch.Tensor]:
    """The megatron state dict of one (TP rank, PP stage) from a Hugging Face Llama/Qwen2 state dict.

    Args:
        hf: Hugging Face tensor names to tensors (missing ``lm_head.weight`` means tied embeddings).
        config: the model's shape; tp_rank/tp_size/pp_rank/pp_size: which shard to produce.
        value_head: a critic: no output layer is produced (its value head is trained from scratch).

    Returns:
        ``{megatron name: tensor}`` in ``config.torch_dtype`` (stage-local layer indices).

    Raises:
        ValueError: a tensor the mapping needs is missing or has the wrong shape.
    """
    dtype = config.torch_dtype
    padded = padded_vocab_size(config, tp_size)

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"the Hugging Face checkpoint has no tensor {name!r}")
        t = hf[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; the config expects {shape}")
        return t.to(dtype)

    d, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    qd, kvd = config.num_attention_heads * config.head_dim, config.kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        emb = _pad_vocab(get("model.embed_tokens.weight", (v, d)), padded)
        out["embedding.word_embeddings.weight"] = _split_rows(emb, tp_rank, tp_size)
    for j, i in enumerate(_layer_range(config, pp_rank, pp_size)):
        hp, mp = _HF_LAYER.format(i=i), _MG_LAYER.format(j=j)
        out[mp + "input_layernorm.weight"] = get(hp + "input_layernorm.weight", (d,))
        out[mp + "pre_mlp_layernorm.weight"] = get(hp + "post_attention_layernorm.weight", (d,))
        if config.norm == "LayerNorm":
            out[mp + "input_layernorm.bias"] = get(hp + "input_layernorm.bias", (d,))
            out[mp + "pre_mlp_layernorm.bias"] = get(hp + "post_attention_layernorm.bias", (d,))
        a = hp + "self_attn."
        qkv = _fuse_qkv(
            get(a + "q_proj.weight", (qd, d)),
            get(a + "k_proj.weight", (kvd, d)),
            get(a + "v_proj.weight", (kvd, d)),
            config,
        )
        out[mp + "self_attention.linear_qkv.weight"] = _split_rows(qkv, tp_rank, tp_size)
        if config.qkv_bias:
            bias = _fuse_qkv(
                get(a + "q_proj.bias", (qd,)),
                get(a + "k_proj.bias", (kvd,)),
                get(a + "v_proj.bias", (kvd,)),
                config,
            )
            out[mp + "self_attention.linear_qkv.bias"] = _split_rows(bias, tp_rank, tp_size)
        o = get(a + "o_proj.weight", (d, qd))
        out[mp + "self_attention.linear_proj.weight"] = o.chunk(tp_size, dim=1)[tp_rank]
        m = hp + "mlp."
        gate = _split_rows(get(m + "gate_proj.weight", (f, d)), tp_rank, tp_size)
        up = _split_rows(get(m + "up_proj.weight", (f, d)), tp_rank, tp_size)
        out[mp + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[mp + "mlp.linear_fc2.weight"] = get(m + "down_proj.weight", (d, f)).chunk(tp_size, dim=1)[tp_rank]
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight", (d,))
        if config.norm == "LayerNorm":
            out["decoder.final_layernorm.bias"] = get("model.norm.bias", (d,))
        if not value_head and not config.tie_word_embeddings:
            head = _pad_vocab(get("lm_head.weight", (v, d)), padded)
            out["output_layer.weight"] = _split_rows(head, tp_rank, tp_size)
    return {k: t.contiguous() for k, t in out.items()}


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]],
    config: MegatronModelConfig,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` for one pipeline stage: merge its TP shards (in TP order) into HF names."""
    tp_size = len(shards)
    if tp_size < 1:
        raise ValueError("shards must hold one state dict per TP rank, got none")
    f = config.ffn_hidden_size // tp_size

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    v = config.vocab_size
    if pp_rank == 0:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight")[:v]
    for j, i in enumerate(_layer_range(config, pp_rank, pp_size)):
        hp, mp = _HF_LAYER.format(i=i), _MG_LAYER.format(j=j)
        out[hp + "input_layernorm.weight"] = shards[0][mp + "input_layernorm.weight"]
        out[hp + "post_attention_layernorm.weight"] = shards[0][mp + "pre_mlp_layernorm.weight"]
        if config.norm == "LayerNorm":
            out[hp + "input_layernorm.bias"] = shards[0][mp + "input_layernorm.bias"]
            out[hp + "post_attention_layernorm.bias"] = shards[0][mp + "pre_mlp_layernorm.bias"]
        a = hp + "self_attn."
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            q, k, vv = _unfuse_qkv(cat(mp + f"self_attention.linear_qkv.{kind}"), config)
            out[a + f"q_proj.{kind}"], out[a + f"k_proj.{kind}"], out[a + f"v_proj.{kind}"] = q, k, vv
        out[a + "o_proj.weight"] = cat(mp + "self_attention.linear_proj.weight", dim=1)
        fc1 = [s[mp + "mlp.linear_fc1.weight"] for s in shards]
        out[hp + "mlp.gate_proj.weight"] = torch.cat([t[:f] for t in fc1])
        out[hp + "mlp.up_proj.weight"] = torch.cat([t[f:] for t in fc1])
        out[hp + "mlp.down_proj.weight"] = cat(mp + "mlp.linear_fc2.weight", dim=1)
    if pp_rank == pp_size - 1:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        if config.norm == "LayerNorm":
            out["model.norm.bias"] = shards[0]["decoder.final_layernorm.bias"]
        if "output_layer.weight" in shards[0]:
            out["lm_head.weight"] = cat("output_layer.weight")[:v]
    return out


def read_safetensors(folder: str, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of every ``*.safetensors`` file in ``folder`` (only ``names`` when given), on the CPU.

    Raises:
        ValueError: ``folder`` has no safetensors file, or one is truncated or its header corrupted (naming it:
            :func:`~ppo_core.models.safetensors_files.check_safetensors_file`).
        ImportError: the ``safetensors`` package is missing.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"folder={folder!r} holds no *.safetensors file")
    for path in files:
        check_safetensors_file(path)
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if wanted is None or key in wanted:
                    out[key] = f.get_tensor(key)
    return out


def load_hf_checkpoint(
    model: torch.nn.Module,
    folder: str,
    config: MegatronModelConfig,
    parallel: ParallelConfig | None = None,
    *,
    value_head: bool = False,
) -> None:
    """Load a local Hugging Face Llama/Qwen2 safetensors checkpoint into this rank's megatron model shard.

    Every parameter of the shard must be covered (the critic's value head is kept as initialised).

    Raises:
        ValueError: missing tensors, wrong shapes, or model parameters the checkpoint does not provide.
    """
    from megatron.core import parallel_state as ps

    parallel = parallel or ParallelConfig()
    shard = hf_to_megatron(
        read_safetensors(folder),
        config,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        value_head=value_head,
    )
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if value_head:
        own = {k for k in own if not k.startswith("output_layer.")}
    missing, unexpected = sorted(own - set(shard)), sorted(set(shard) - own)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint and model disagree: model tensors not loaded {missing}, unused {unexpected}"
        )
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in shard.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shard {tuple(tensor.shape)} vs model {tuple(state[name].shape)}"
                )
            state[name].copy_(tensor)
