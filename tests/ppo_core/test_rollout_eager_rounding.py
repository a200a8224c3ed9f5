"""The element-wise steps of the HF rollout engine equal the ``transformers`` modules they replace, bit for bit in
bf16 (and fp32) on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode.eager_rounding import (
    add_rms_norm_as_model,
    heads_rms_norm_as_model,
    rms_norm_as_model,
    rotary_as_model,
    silu_mul_as_model,
)

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


def _x(shape, seed: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=DTYPES, width=st.sampled_from([8, 64, 96]))
def test_norms_are_the_models(seed, dtype, width) -> None:
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_x((width,), seed + 1, dtype, 1.0))
    x, delta = _x((3, 5, width), seed, dtype), _x((3, 5, width), seed + 2, dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_as_model(x, norm.weight, 1e-5), norm(x))
        h, normed = add_rms_norm_as_model(x, delta, norm.weight, 1e-5)
        assert torch.equal(h, x + delta) and torch.equal(normed, norm(x + delta))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=DTYPES)
def test_rotation_and_gating_are_the_models(seed, dtype) -> None:
    q, k = _x((2, 4, 5, 16), seed, dtype), _x((2, 2, 5, 16), seed + 1, dtype)
    angles = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(seed + 2)) * 40
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # [B, S, d], as the model's rotary module gives
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes the heads dimension
    got = rotary_as_model(q, k, cos[:, None], sin[:, None])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gate, up = _x((3, 32), seed + 3, dtype), _x((3, 32), seed + 4, dtype)
    assert torch.equal(silu_mul_as_model(gate, up), modeling_llama.ACT2FN["silu"](gate) * up)  # LlamaMLP's


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=DTYPES,
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1), (2, 2)]),
    tokens=st.sampled_from([1, 5]),
)
def test_heads_norm_is_qwen3s_q_and_k_norms(seed, dtype, heads, tokens) -> None:
    """One call over ``[B, S, H + G, d]`` gives each query head ``q_norm``'s output and each key head ``k_norm``'s,
    bit for bit (Qwen3's modules, weights unlike each other and unlike ones)."""
    modeling_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    h, g = heads
    q_norm, k_norm = (modeling_qwen3.Qwen3RMSNorm(16, eps=1e-6).to(dtype) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.copy_(_x((16,), seed + 1, dtype, 1.0))
        k_norm.weight.copy_(_x((16,), seed + 2, dtype, 1.0))
    x = _x((3, tokens, h + g, 16), seed, dtype)
    with torch.no_grad():
        out = heads_rms_norm_as_model(x, q_norm.weight, k_norm.weight, h, 1e-6)
        assert torch.equal(out[:, :, :h], q_norm(x[:, :, :h]))
        assert torch.equal(out[:, :, h:], k_norm(x[:, :, h:]))
