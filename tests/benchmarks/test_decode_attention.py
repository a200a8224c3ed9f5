"""``benchmarks/decode_attention.py`` times CUDA kernels only: off CUDA it says so instead of failing inside."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: no CUDA device")
def test_without_cuda_it_says_it_needs_cuda() -> None:
    with pytest.raises(SystemExit, match="needs CUDA"):
        decode_attention.main([])


def test_its_shapes_are_the_families_of_the_rollout_benchmark() -> None:
    from benchmarks.rollout_families import FAMILIES

    for name, (h, g, d) in decode_attention.SHAPES.items():
        config = FAMILIES[name][1]
        assert config["num_attention_heads"] == h and config["num_key_value_heads"] == g
        assert config.get("head_dim", config["hidden_size"] // h) == d


def test_the_shapes_are_qwen3s_and_llamas_heads() -> None:
    """Qwen3-0.6B: 16 query heads of 128 over 8 key-value heads (its own head_dim); Llama-3.2-1B: 32 of 64 over 8
    (head_dim from the width)."""
    assert decode_attention.SHAPES == {"qwen3": (16, 8, 128), "llama": (32, 8, 64)}
