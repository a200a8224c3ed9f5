"""Configs and rank layout of the megatron workers: validation errors, dict round trips, megatron's rank order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.workers.megatron import (
    MegatronActorConfig,
    MegatronCriticConfig,
    MegatronModelConfig,
    ParallelConfig,
    megatron_layout,
)


def _model(**kw) -> MegatronModelConfig:
    base = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=128,
        vocab_size=100,
    )
    return MegatronModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 66}, "hidden_size"),
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"norm": "BatchNorm"}, "norm.*LayerNorm, RMSNorm"),
        ({"dtype": "int8"}, "dtype"),
        ({"attention": "flash3"}, "attention"),
        ({"rotary_base": -1.0}, "rotary_base"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_model_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _model(**kw)


@pytest.mark.parametrize(
    ("parallel", "match"),
    [
        (ParallelConfig(tensor_model_parallel_size=3), "num_attention_heads.*tensor_model_parallel_size"),
        (ParallelConfig(tensor_model_parallel_size=8), "num_query_groups.*tensor_model_parallel_size"),
        (ParallelConfig(pipeline_model_parallel_size=3), "num_layers.*pipeline_model_parallel_size"),
        (ParallelConfig(context_parallel_size=2), "context_parallel_size"),
    ],
)
def test_model_cannot_be_split_that_way(parallel, match):
    with pytest.raises(ValueError, match=match):
        _model().check_parallel(parallel)


def test_world_size_must_be_a_multiple_of_the_model_parallel_size():
    p = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert p.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"world_size \(6\).*tensor_model_parallel_size \(2\).*= 4"):
        p.data_parallel_size(6)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="world_size"):
        p.data_parallel_size(0)


def test_worker_configs_round_trip_and_keep_the_torch_defaults():
    actor = MegatronActorConfig(model=_model(), parallel=ParallelConfig(tensor_model_parallel_size=2))
    assert MegatronActorConfig.from_dict(actor.to_dict()) == actor
    assert actor.optim.lr == 1e-6 and MegatronCriticConfig().optim.lr == 1e-5
    nested = MegatronActorConfig.from_dict(
        {"model": _model().to_dict(), "parallel": {"pipeline_model_parallel_size": 2}}
    )
    assert nested.parallel.pipeline_model_parallel_size == 2 and nested.model == _model()
    with pytest.raises(ValueError, match="unknown MegatronActorConfig field"):
        MegatronActorConfig.from_dict({"tensor_parallel": 2})


def test_parameter_count_matches_a_hand_count():
    cfg = _model(qkv_bias=True)
    d, kv, f, v = 64, 4 * 8, 128, 100
    per_layer = d * (d + 2 * kv) + (d + 2 * kv) + d * d + 3 * d * f + 2 * d
    assert cfg.num_parameters() == 4 * per_layer + d + 2 * v * d
    assert cfg.num_parameters(include_embedding=False) == 4 * per_layer + d + v * d


@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 3]), dp=st.integers(1, 4))
def test_layout_is_a_bijection_in_megatron_order(tp, pp, dp):
    """Megatron's default order is tp-cp-ep-dp-pp: TP varies fastest, PP slowest."""
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    world = tp * pp * dp
    seen = {}
    for rank in range(world):
        lay = megatron_layout(rank, world, parallel)
        assert (lay.tp_size, lay.pp_size, lay.dp_size) == (tp, pp, dp)
        assert rank == lay.tp_rank + tp * (lay.dp_rank + dp * lay.pp_rank)
        seen[(lay.tp_rank, lay.dp_rank, lay.pp_rank)] = rank
    assert set(seen) == set(itertools.product(range(tp), range(dp), range(pp)))
    for d in range(dp):
        collect = [
            r
            for (t, dd, p), r in seen.items()
            if dd == d and megatron_layout(r, world, parallel).is_collect_rank
        ]
        assert collect == [seen[(0, d, pp - 1)]]


def test_layout_rejects_bad_ranks():
    with pytest.raises(ValueError, match="rank"):
        megatron_layout(4, 4, ParallelConfig())
    with pytest.raises(ValueError, match="world_size"):
        megatron_layout(0, 3, ParallelConfig(tensor_model_parallel_size=2))


def test_a_gloo_rank_builds_its_weights_on_the_cpu_even_where_cuda_exists(cpu_megatron, monkeypatch):
    """Megatron initialises weights on the GPU (through its CUDA RNG tracker) unless told otherwise: a rank that
    joined with gloo must get CPU initialisation although the machine has a GPU (CPU tests on a GPU host)."""
    import torch

    from ppo_core.workers.megatron import MegatronModelConfig

    pytest.importorskip("megatron.core")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = MegatronModelConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, vocab_size=32
    )
    assert config.transformer_config(ParallelConfig()).use_cpu_initialization is True
