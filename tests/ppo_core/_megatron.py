"""A tiny megatron model shape and random Hugging Face weights shared by the CPU megatron tests (imported as
``from _megatron import ...``)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

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


def random_hf_state(cfg: MegatronModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random state dict with Hugging Face Llama/Qwen2 names (``qkv_bias`` adds Qwen2's q/k/v biases)."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    out = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": 1 + 0.1 * r(d)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = r(v, d)
    if cfg.norm == "LayerNorm":
        out["model.norm.bias"] = 0.1 * r(d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + 0.1 * r(d),
            p + "post_attention_layernorm.weight": 1 + 0.1 * r(d),
            p + "self_attn.q_proj.weight": r(qd, d),
            p + "self_attn.k_proj.weight": r(kvd, d),
            p + "self_attn.v_proj.weight": r(kvd, d),
            p + "self_attn.o_proj.weight": r(d, qd),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
        }
        if cfg.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": r(qd),
                p + "self_attn.k_proj.bias": r(kvd),
                p + "self_attn.v_proj.bias": r(kvd),
            }
        if cfg.norm == "LayerNorm":
            out |= {p + "input_layernorm.bias": 0.1 * r(d), p + "post_attention_layernorm.bias": 0.1 * r(d)}
    return out


@contextlib.contextmanager
def cpu_tensor_parallel(rank: int, world: int, port: int) -> Iterator[Any]:
    """Join ``world`` CPU ranks as one tensor-parallel group over gloo on 127.0.0.1:``port`` (one thread per rank);
    yields the ``ParallelConfig`` and tears megatron's parallel state down afterwards."""
    from ppo_core.workers.megatron import ParallelConfig, destroy_megatron_parallel, init_megatron_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_model_parallel_size=world)
    init_megatron_parallel(parallel, rank=rank, world_size=world, device=torch.device("cpu"))
    try:
        yield parallel
    finally:
        destroy_megatron_parallel()


def spawn_ranks(main: Any, world: int, *args: Any) -> dict:
    """Run ``main(rank, world, port, *args, out)`` in ``world`` spawned processes (gloo on 127.0.0.1, a free port)
    and return ``out``, the dict the ranks filled (``out[rank] = ...``). Spawned, not forked: a child forked after
    this process ran megatron and gloo can deadlock."""
    import multiprocessing
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with multiprocessing.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(main, args=(world, port, *args, out), nprocs=world, start_method="spawn")
        return dict(out)
