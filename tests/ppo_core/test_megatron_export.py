"""Megatron checkpoints -> Hugging Face: the shape of a config both ways, rank files of any TP x PP x DP layout merged
back exactly, and exported models whose ``transformers`` logits are the megatron model's (TP = 1 on one CPU rank,
TP = 2 over gloo with two spawned ranks)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from _megatron import cpu_tensor_parallel, tiny_config  # noqa: E402
from _megatron import random_hf_state as _random_hf  # noqa: E402

from ppo_core.workers.megatron import ParallelConfig, megatron_layout  # noqa: E402
from ppo_core.workers.megatron.export import export_megatron_actor, megatron_actor_state, rank_files  # noqa: E402
from ppo_core.workers.megatron.hf_config import (  # noqa: E402
    hf_config_from_model,
    model_config_from_hf,
    rope_theta_of,
)
from ppo_core.workers.megatron.hf_loading import hf_to_megatron  # noqa: E402


# ----- the shape of a config, both ways ---------------------------------------------------------------------------
@given(
    family=st.sampled_from(["llama", "qwen2"]),
    layers=st.integers(1, 4),
    heads_groups=st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3)]),
    head_dim=st.sampled_from([4, 8]),
    tied=st.booleans(),
    theta=st.sampled_from([1e4, 5e5, 1e6]),
)
def test_shape_round_trips_through_transformers_configs(family, layers, heads_groups, head_dim, tied, theta):
    heads, groups = heads_groups
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    hf = cls(
        hidden_size=heads * head_dim,
        intermediate_size=3 * heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        vocab_size=97,
        tie_word_embeddings=tied,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
    )
    cfg = model_config_from_hf(hf, dtype="float32")
    assert (cfg.num_layers, cfg.hidden_size, cfg.kv_heads, cfg.ffn_hidden_size) == (
        layers,
        heads * head_dim,
        groups,
        3 * heads * head_dim,
    )
    assert cfg.qkv_bias == (family == "qwen2") and cfg.tie_word_embeddings == tied
    assert cfg.rotary_base == theta and cfg.norm_epsilon == 1e-5 and cfg.max_position_embeddings == 128
    back = hf_config_from_model(cfg)
    assert back.model_type == family and rope_theta_of(back) == theta
    assert model_config_from_hf(back, dtype="float32") == cfg


def test_unsupported_configs_name_the_key():
    base = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=10
    )
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        model_config_from_hf(transformers.LlamaConfig(**base, hidden_act="gelu"))
    with pytest.raises(ValueError, match="mlp_bias"):
        model_config_from_hf(transformers.LlamaConfig(**base, mlp_bias=True))
    with pytest.raises(ValueError, match="head_dim=4"):
        model_config_from_hf(transformers.LlamaConfig(**base, head_dim=4))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        model_config_from_hf(transformers.GPT2Config())
    with pytest.raises(ValueError, match="rope_type='linear'"):
        model_config_from_hf(
            transformers.LlamaConfig(
                **base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
            )
        )
    with pytest.raises(ValueError, match=r"\['num_layers'\] come from the checkpoint"):
        model_config_from_hf(transformers.LlamaConfig(**base), num_layers=3)
    with pytest.raises(ValueError, match="norm='LayerNorm'"):
        hf_config_from_model(tiny_config(norm="LayerNorm"))


# ----- rank files of any layout merge back exactly ----------------------------------------------------------------
def _write_rank_files(folder, hf, cfg, parallel: ParallelConfig, world: int) -> None:
    os.makedirs(folder, exist_ok=True)
    for rank in range(world):
        lay = megatron_layout(rank, world, parallel)
        shard = hf_to_megatron(
            hf, cfg, tp_rank=lay.tp_rank, tp_size=lay.tp_size, pp_rank=lay.pp_rank, pp_size=lay.pp_size
        )
        if lay.dp_rank > 0:  # other replicas hold the same weights; make them differ to catch a wrong pick
            shard = {k: v + 1 for k, v in shard.items()}
        shard["decoder.layers.0.self_attention.core_attention._extra_state"] = torch.zeros(1)
        state = {"model": shard, "optimizer": {"step": 3}, "generator": torch.zeros(2)}
        torch.save(state, os.path.join(folder, f"rank_{rank}.pt"))


@settings(max_examples=12, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2]),
    qkv_bias=st.booleans(),
    tied=st.booleans(),
    seed=st.integers(0, 100),
)
def test_rank_files_of_any_layout_merge_back_exactly(tmp_path_factory, tp, pp, dp, qkv_bias, tied, seed):
    cfg = tiny_config(qkv_bias=qkv_bias, tie_word_embeddings=tied)
    hf = _random_hf(cfg, seed)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    folder = str(tmp_path_factory.mktemp("actor"))
    _write_rank_files(folder, hf, cfg, parallel, tp * pp * dp)
    merged = megatron_actor_state(folder, cfg, parallel)
    assert set(merged) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(merged[name], tensor), name


def test_rank_file_errors(tmp_path):
    cfg = tiny_config()
    with pytest.raises(FileNotFoundError, match=r"holds no rank_<r>\.pt"):
        rank_files(tmp_path)
    _write_rank_files(tmp_path, _random_hf(cfg, 0), cfg, ParallelConfig(tensor_model_parallel_size=2), 2)
    with pytest.raises(
        ValueError, match=r"world_size \(2\) must be divisible by tensor_model_parallel_size \(4\)"
    ):
        megatron_actor_state(tmp_path, cfg, ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(ValueError, match="do model and parallel match the run"):
        megatron_actor_state(
            tmp_path, tiny_config(num_layers=3), ParallelConfig(tensor_model_parallel_size=2)
        )
    os.remove(tmp_path / "rank_0.pt")
    with pytest.raises(FileNotFoundError, match=r"lacks the files of ranks \[0\]"):
        rank_files(tmp_path)


def test_hf_config_of_another_shape_is_refused(tmp_path):
    cfg = tiny_config()
    _write_rank_files(tmp_path / "actor", _random_hf(cfg, 0), cfg, ParallelConfig(), 1)
    with pytest.raises(ValueError, match="hf_config does not describe the checkpoint's model"):
        export_megatron_actor(
            tmp_path / "actor",
            tmp_path / "out",
            model_config=cfg,
            parallel=ParallelConfig(),
            hf_config=hf_config_from_model(tiny_config(num_layers=3)),
        )


# ----- exported models give the megatron model's logits ------------------------------------------------------------
def _ids() -> torch.Tensor:
    return torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(5))


def _hf_logits(out_dir: str, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])
def test_one_rank_export_gives_the_megatron_logits(cpu_megatron, tmp_path, family):
    from ppo_core.workers.megatron import build_gpt_model
    from ppo_core.workers.megatron.engine import position_ids

    cfg = tiny_config(qkv_bias=family != "llama", tie_word_embeddings=family != "llama", seed=7)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    with torch.no_grad():  # move every weight off its initialisation (norms start at 1, biases at 0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    os.makedirs(tmp_path / "actor")
    torch.save({"model": model.state_dict(), "optimizer": {}}, tmp_path / "actor" / "rank_0.pt")
    out = export_megatron_actor(
        tmp_path / "actor", tmp_path / "hf", model_config=cfg, parallel=ParallelConfig()
    )
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, position_ids(torch.ones_like(ids)), None)[..., : cfg.vocab_size]
    theirs = _hf_logits(out, ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert transformers.AutoConfig.from_pretrained(out).model_type == (
        "llama" if family == "llama" else "qwen2"
    )


def _tp_rank(rank: int, world: int, port: int, folder: str, ids: torch.Tensor, out: dict) -> None:
    """One TP rank: build the TP-sharded model, save its rank file, return its full-vocabulary logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ppo_core.workers.megatron import build_gpt_model
    from ppo_core.workers.megatron.engine import position_ids

    with cpu_tensor_parallel(rank, world, port) as parallel:
        cfg = tiny_config(qkv_bias=True, seed=11)
        model = build_gpt_model(cfg, parallel).eval()
        torch.save({"model": model.state_dict(), "optimizer": {}}, os.path.join(folder, f"rank_{rank}.pt"))
        with torch.no_grad():
            part = model(ids, position_ids(torch.ones_like(ids)), None)
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part.contiguous(), group=ps.get_tensor_model_parallel_group())
        out[rank] = torch.cat(parts, dim=-1)[..., : cfg.vocab_size]


@pytest.mark.slow
def test_two_tensor_parallel_shards_merge_into_the_same_model(rank_pool, tmp_path):
    folder = tmp_path / "actor"
    os.makedirs(folder)
    ids = _ids()
    logits = rank_pool.run(_tp_rank, 2, str(folder), ids)
    torch.testing.assert_close(logits[0], logits[1])
    cfg = tiny_config(qkv_bias=True, seed=11)
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    hf_dir = export_megatron_actor(folder, tmp_path / "hf", model_config=cfg, parallel=parallel)
    torch.testing.assert_close(_hf_logits(hf_dir, ids), logits[0], rtol=1e-4, atol=1e-4)
