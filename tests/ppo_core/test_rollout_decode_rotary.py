"""The fused rotation + KV-cache write of a decode step equals its PyTorch contract (``TRITON_INTERPRET=1`` on CPU
where Triton is installed, and on CUDA under the ``gpu`` marker)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode import decode_rotary
from ppo_core_decode.decode_rotary import (
    rotate_and_write,
    rotate_and_write_prompt,
    rotate_and_write_prompt_triton,
    rotate_and_write_triton,
)
from ppo_core_decode.eager_rounding import rotary_as_model

INTERPRET = decode_rotary.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and decode_rotary.triton is not None
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if CUDA else [])
BF16_STEP = 2.0**-7  # relative spacing of bf16 numbers (at most)
kernel = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _step(b: int, h: int, g: int, d: int, length: int, dtype: torch.dtype, device: str, seed: int):
    """A decode step's q/k/v as strided views of one fused projection ``[B, 1, (H + 2G) d]`` (as the engines give
    them), per-row tables, and a cache holding earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, 1, (h + 2 * g) * d, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    q, k, v = (t.view(b, 1, -1, d).transpose(1, 2) for t in (q, k, v))  # [B, heads, 1, d]
    angles = torch.rand(b, d // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    cache = torch.randn(2, b, g, length, d, generator=gen).to(dtype).to(device)
    return q, k, v, cos, sin, cache


def _tolerance(device: str, dtype: torch.dtype, model_rounding: bool) -> dict:
    """Exact where both sides round alike. Triton's interpreter rounds fp32 -> bf16 by truncation (the GPU to
    nearest), so an interpreted bf16 product is one bf16 step of its size off (inputs here are at most ~5, so the
    two products of a rotation ~5 * 2^-7 each); on CUDA an fp32 mul-add may be fused into one rounding (the
    round-once rule only), which can move a bf16 result by one step and an fp32 one by an ulp."""
    if dtype == torch.bfloat16 and (device == "cpu" or not model_rounding):
        return {"atol": 2 * 5 * BF16_STEP, "rtol": BF16_STEP}
    if device == "cuda" and not model_rounding:
        return {"atol": 1e-6, "rtol": 1e-6}
    return {"atol": 0, "rtol": 0}


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_rounding", [False, True])
@pytest.mark.parametrize(("h", "g", "d"), [(8, 2, 16), (12, 4, 32), (4, 4, 64)])
def test_fused_rotation_and_write_equal_the_contract(device, dtype, model_rounding, h, g, d) -> None:
    b, length, slot = 3, 9, 5
    q, k, v, cos, sin, cache = _step(b, h, g, d, length, dtype, device, seed=h + d)
    before = cache.clone()
    if model_rounding:  # the tables in the model dtype, as the model's forward holds them
        cos, sin = cos.to(dtype), sin.to(dtype)
    index = torch.tensor(slot, device=device)
    want_cache = cache.clone()
    want_q = rotate_and_write(q, k, v, cos, sin, *want_cache, index, model_rounding=model_rounding)
    got_q = rotate_and_write_triton(q, k, v, cos, sin, *cache, index, model_rounding=model_rounding)
    tol = _tolerance(device, dtype, model_rounding)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(cache, want_cache, **tol)
    others = torch.arange(length, device=device) != slot
    assert torch.equal(cache[:, :, :, others], before[:, :, :, others])  # no other slot written
    assert torch.equal(cache[1][:, :, slot : slot + 1], v)  # the value as it came


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_model_rounding_is_the_hf_engines_rotation(device) -> None:
    """``model_rounding=True`` is the rule of the Hugging Face engine's own rotation (bf16, tables in bf16)."""
    q, k, v, cos, sin, cache = _step(2, 8, 2, 32, 4, torch.bfloat16, device, seed=1)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    got_q = rotate_and_write_triton(
        q, k, v, cos, sin, *cache, torch.tensor(0, device=device), model_rounding=True
    )
    want_q, want_k = rotary_as_model(q, k, cos[:, None, None], sin[:, None, None])
    tol = _tolerance(device, torch.bfloat16, model_rounding=True)  # exact on CUDA
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(cache[0][:, :, 0:1], want_k, **tol)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_bad_layouts_are_named(device) -> None:
    q, k, v, cos, sin, cache = _step(2, 4, 2, 16, 4, torch.float32, device, seed=2)
    slot = torch.tensor(1, device=device)
    with pytest.raises(ValueError, match="k have none"):
        rotate_and_write_triton(q, k.transpose(-1, -2), v, cos, sin, *cache, slot, model_rounding=False)
    with pytest.raises(ValueError, match="cos and sin"):
        rotate_and_write_triton(q, k, v, cos, sin[:1].expand_as(cos), *cache, slot, model_rounding=False)
    with pytest.raises(ValueError, match="slot"):
        rotate_and_write_triton(q, k, v, cos, sin, *cache, slot.view(1).expand(2), model_rounding=False)


def test_the_kernel_is_only_offered_for_cuda_and_power_of_two_heads() -> None:
    assert not decode_rotary.rotate_and_write_triton_available(torch.zeros(1, 2, 1, 16))  # CPU: PyTorch
    if CUDA:
        assert decode_rotary.rotate_and_write_triton_available(torch.zeros(1, 2, 1, 64, device="cuda"))
        assert not decode_rotary.rotate_and_write_triton_available(torch.zeros(1, 2, 1, 48, device="cuda"))


# ---- a prefill's rotation and cache write ----------------------------------------------------------------------


def _prompt(b: int, h: int, g: int, s: int, d: int, length: int, dtype: torch.dtype, device: str, seed: int):
    """A prefill's q/k/v as views of one projection ``[B, S, (H + 2G) d]``, per-token tables ``[B, S, d]`` (left
    padding: a row's positions start at 0 late) and a cache of ``length`` slots holding other bits."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, (h + 2 * g) * d, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    q, k, v = (t.view(b, s, n, d).transpose(1, 2) for t, n in zip((q, k, v), (h, g, g), strict=True))
    positions = (torch.arange(s)[None] - torch.randint(0, s + 1, (b, 1), generator=gen)).clamp(min=0)
    freq = torch.rand(d // 2, generator=gen) * 3
    angles = positions[..., None] * freq
    angles = torch.cat((angles, angles), dim=-1)  # [B, S, d]
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    cache = torch.randn(2, b, g, length, d, generator=gen).to(dtype).to(device)
    return q, k, v, cos, sin, cache


@settings(max_examples=min(40, settings.default.max_examples), deadline=None)
@given(
    b=st.integers(0, 3),
    s=st.integers(0, 6),
    g=st.integers(1, 3),
    rep=st.integers(1, 3),
    d=st.sampled_from([4, 8, 16]),
    spare=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    model_rounding=st.booleans(),
)
def test_prompt_contract_is_the_decode_contract_at_each_position(
    b, s, g, rep, d, spare, dtype, model_rounding
):
    """:func:`rotate_and_write_prompt` of ``S`` tokens equals :func:`rotate_and_write` of each token at its own
    slot, bit for bit (PyTorch, any device); slots past ``S`` keep their bits."""
    q, k, v, cos, sin, cache = _prompt(b, g * rep, g, s, d, s + spare, dtype, "cpu", seed=b + s + d)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    got_cache, want_cache = cache.clone(), cache.clone()
    got_q = rotate_and_write_prompt(q, k, v, cos, sin, *got_cache, model_rounding=model_rounding)
    want_q = torch.empty_like(got_q)
    for t in range(s):
        step = (x[:, :, t : t + 1] for x in (q, k, v))
        slot = torch.tensor(t)
        want_q[:, :, t : t + 1] = rotate_and_write(
            *step, cos[:, t], sin[:, t], *want_cache, slot, model_rounding=model_rounding
        )
    assert got_q.shape == (b, g * rep, s, d)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got_cache[:, :, :, s:], cache[:, :, :, s:])


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_rounding", [False, True])
@pytest.mark.parametrize(("b", "h", "g", "s", "d"), [(2, 8, 2, 5, 16), (3, 12, 4, 7, 32), (1, 4, 4, 3, 64)])
def test_prompt_kernel_equals_the_contract(device, dtype, model_rounding, b, h, g, s, d) -> None:
    """The one-launch prefill rotation and write equals :func:`rotate_and_write_prompt`: exact where both sides
    round alike (as the decode kernel: see ``_tolerance``), the queries ``[B, H, S, d]`` over a ``[B, S, H, d]``
    tensor, and no slot past the prompt written."""
    length = s + 4
    q, k, v, cos, sin, cache = _prompt(b, h, g, s, d, length, dtype, device, seed=h + s)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    got_cache, want_cache = cache.clone(), cache.clone()
    want_q = rotate_and_write_prompt(q, k, v, cos, sin, *want_cache, model_rounding=model_rounding)
    got_q = rotate_and_write_prompt_triton(q, k, v, cos, sin, *got_cache, model_rounding=model_rounding)
    tol = _tolerance(device, dtype, model_rounding)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)
    assert got_q.transpose(1, 2).is_contiguous()
    assert torch.equal(got_cache[:, :, :, s:], cache[:, :, :, s:])
    assert torch.equal(got_cache[1][:, :, :s], v)  # the values as they came


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_prompt_kernel_of_nothing_writes_nothing(device) -> None:
    for b, s in ((0, 3), (2, 0)):
        q, k, v, cos, sin, cache = _prompt(b, 4, 2, s, 16, 5, torch.float32, device, seed=3)
        before = cache.clone()
        out = rotate_and_write_prompt_triton(q, k, v, cos, sin, *cache, model_rounding=False)
        assert out.shape == (b, 4, s, 16)
        assert torch.equal(cache, before)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_bad_prompt_inputs_are_named(device) -> None:
    q, k, v, cos, sin, cache = _prompt(2, 4, 2, 5, 16, 6, torch.float32, device, seed=4)
    with pytest.raises(ValueError, match="v have none"):
        rotate_and_write_prompt_triton(q, k, v.transpose(-1, -2), cos, sin, *cache, model_rounding=False)
    with pytest.raises(ValueError, match=r"\[B, S, d\]"):
        rotate_and_write_prompt_triton(q, k, v, cos[:, :1], sin[:, :1], *cache, model_rounding=False)
    with pytest.raises(ValueError, match="does not fit a cache of 4 slots"):
        rotate_and_write_prompt_triton(q, k, v, cos, sin, *cache[:, :, :, :4], model_rounding=False)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_prompt_kernel_launches_rows_in_chunks_of_the_grid_limit(device, monkeypatch) -> None:
    """More rows than a grid's second dimension holds (65,535 on CUDA; 2 here) run in several launches, each over
    its own rows, with the contract's result."""
    monkeypatch.setattr(decode_rotary, "_MAX_GRID_Y", 2)
    q, k, v, cos, sin, cache = _prompt(5, 4, 2, 3, 16, 4, torch.float32, device, seed=6)
    got_cache, want_cache = cache.clone(), cache.clone()
    want_q = rotate_and_write_prompt(q, k, v, cos, sin, *want_cache, model_rounding=False)
    got_q = rotate_and_write_prompt_triton(q, k, v, cos, sin, *got_cache, model_rounding=False)
    tol = _tolerance(device, torch.float32, model_rounding=False)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)


# ---- Qwen3's per-head query and key norms in the rotation kernels ---------------------------------------------

NORM_DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if CUDA else []
)
NORM_TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4 * 2.0**-10, "rtol": 4 * 2.0**-10},
    torch.bfloat16: {"atol": 4 * 2.0**-7, "rtol": 4 * 2.0**-7},
}
"""The kernel sums a head's squares in its own order, the model's norm in PyTorch's: a normalised entry may round
one step of the dtype apart, then the weight and the rotation scale it (inputs here at most ~5)."""


def _norm_weights(
    d: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``qk_norm`` weights unlike ones and unlike each other (the keys' with signs), and an epsilon."""
    gen = torch.Generator().manual_seed(seed)
    q_w = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype).to(device)
    k_w = torch.randn(d, generator=gen).to(dtype).to(device)
    return q_w, k_w, 1e-6


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("model_rounding", [False, True])
@pytest.mark.parametrize(("b", "h", "g", "s", "d"), [(2, 8, 2, 5, 16), (3, 4, 4, 1, 32), (1, 6, 2, 3, 64)])
def test_qk_norm_in_the_prompt_kernel_is_the_models_norms_before_it(
    device, dtype, model_rounding, b, h, g, s, d
):
    """A prefill's launch with ``qk_norm`` against the contract (the model's norm, ``rms_norm_as_model``, then the
    rotation): the same queries and cache within :data:`NORM_TOLERANCE`; slots past the prompt untouched; the
    values as they came."""
    length = s + 2
    q, k, v, cos, sin, cache = _prompt(b, h, g, s, d, length, dtype, device, seed=h + s + d)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    qk_norm = _norm_weights(d, dtype, device, seed=s)
    got_cache, want_cache = cache.clone(), cache.clone()
    want_q = rotate_and_write_prompt(
        q, k, v, cos, sin, *want_cache, model_rounding=model_rounding, qk_norm=qk_norm
    )
    got_q = rotate_and_write_prompt_triton(
        q, k, v, cos, sin, *got_cache, model_rounding=model_rounding, qk_norm=qk_norm
    )
    assert got_q.isfinite().all()
    torch.testing.assert_close(got_q, want_q, **NORM_TOLERANCE[dtype])
    torch.testing.assert_close(got_cache, want_cache, **NORM_TOLERANCE[dtype])
    assert not torch.allclose(
        got_q.float(), q.float(), atol=0.1
    )  # the norms ran (the inputs are not normalised)
    assert torch.equal(got_cache[:, :, :, s:], cache[:, :, :, s:])
    assert torch.equal(got_cache[1][:, :, :s], v)


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NORM_DTYPES)
def test_qk_norm_in_the_decode_rotation_kernel_is_the_models_norms_before_it(device, dtype) -> None:
    """A decode step's rotation and write (the launch before a separate attention) with ``qk_norm``, against the
    contract, as the prompt's; no other slot written."""
    b, h, g, d, length, slot = 3, 8, 2, 32, 6, 4
    q, k, v, cos, sin, cache = _step(b, h, g, d, length, dtype, device, seed=9)
    cos, sin = cos.to(dtype), sin.to(dtype)
    qk_norm = _norm_weights(d, dtype, device, seed=10)
    index = torch.tensor(slot, device=device)
    before, want_cache = cache.clone(), cache.clone()
    want_q = rotate_and_write(q, k, v, cos, sin, *want_cache, index, model_rounding=True, qk_norm=qk_norm)
    got_q = rotate_and_write_triton(q, k, v, cos, sin, *cache, index, model_rounding=True, qk_norm=qk_norm)
    torch.testing.assert_close(got_q, want_q, **NORM_TOLERANCE[dtype])
    torch.testing.assert_close(cache, want_cache, **NORM_TOLERANCE[dtype])
    others = torch.arange(length, device=device) != slot
    assert torch.equal(cache[:, :, :, others], before[:, :, :, others])


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_qk_norm_weights_of_the_rotation_kernels_are_checked(device) -> None:
    q, k, v, cos, sin, cache = _prompt(2, 4, 2, 3, 16, 4, torch.float32, device, seed=11)
    w = torch.ones(16, device=device)
    for bad, match in (
        ((w[:8], w, 1e-6), r"q_weight must be \[16\]"),
        ((w, w.half(), 1e-6), "k_weight must be"),
        ((w, w), r"\(q_weight, k_weight, eps\)"),
    ):
        with pytest.raises(ValueError, match=match):
            rotate_and_write_prompt_triton(q, k, v, cos, sin, *cache, model_rounding=False, qk_norm=bad)
        with pytest.raises(ValueError, match=match):
            rotate_and_write_prompt(q, k, v, cos, sin, *cache, model_rounding=False, qk_norm=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
def test_prompt_kernel_takes_prompts_longer_than_a_grid_row() -> None:
    """A prompt of more tokens than a grid's second dimension holds (70,000 > 65,535): every token rotated and
    written (the tokens run on the grid's first axis)."""
    s = 70_000
    q, k, v, cos, sin, cache = _prompt(1, 2, 1, s, 16, s + 1, torch.bfloat16, "cuda", seed=7)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    got_cache, want_cache = cache.clone(), cache.clone()
    want_q = rotate_and_write_prompt(q, k, v, cos, sin, *want_cache, model_rounding=True)
    got_q = rotate_and_write_prompt_triton(q, k, v, cos, sin, *got_cache, model_rounding=True)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache, want_cache)
