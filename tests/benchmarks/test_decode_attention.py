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
