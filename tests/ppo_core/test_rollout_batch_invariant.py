"""Batch-invariant rollout numerics (``ppo_core_decode.batch_invariant``, ``HFRolloutEngine(batch_invariant=True)``):
each row's result does not depend on the other rows, so cached decoding equals full recomputation bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.rollout import SamplingConfig
from ppo_core_decode import batch_invariant as bi
from ppo_core_decode.batch_invariant import (
    CHUNK_ROWS,
    invariant_attention,
    invariant_linear,
    invariant_rms_norm,
    invariant_rows,
)
from ppo_core_decode.eager_rounding import add_rms_norm_as_model, rms_norm_as_model

transformers = pytest.importorskip("transformers")

DTYPES = [torch.float32, torch.bfloat16]
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and bi.triton is not None
VOCAB = 97


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 2 * CHUNK_ROWS + 5),
    k=st.integers(1, 40),
    n=st.integers(1, 24),
    bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_linear_is_f_linear_and_each_row_is_its_own(m, k, n, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = invariant_linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * k**0.5)
    # any row alone, or any other run of rows, gives the same bits
    row = int(torch.randint(0, m, (1,), generator=gen))
    assert torch.equal(invariant_linear(x[row : row + 1], w, b)[0], y[row])
    assert torch.equal(invariant_linear(x[row:], w, b), y[row:])


def test_linear_path_follows_device_dtype_and_weight_width_never_the_row_count(monkeypatch):
    x32, x16 = torch.randn(5, 8), torch.randn(2, 3, 8).to(torch.bfloat16)
    narrow, wide = torch.randn(bi.FP32_TRITON_MAX_N, 8), torch.randn(bi.FP32_TRITON_MAX_N + 1, 8)
    assert bi.linear_path(x32, narrow) == ("triton" if _INTERPRET else "chunked")  # a CPU tensor
    monkeypatch.setattr(bi, "triton", object())  # as if Triton could run here
    monkeypatch.setattr(bi, "_interpreting", lambda: True)
    for rows in (x32, x32[:1], torch.randn(4099, 8)):
        assert bi.linear_path(rows, narrow) == "triton"
        assert bi.linear_path(rows, wide) == "chunked"  # fp32 vocabulary heads stay on the chunked path
    assert bi.linear_path(x16, wide) == "triton"  # the width rule is fp32's only
    assert bi.linear_path(x32[:0], narrow) == "chunked"  # no rows: no kernel
    assert bi.linear_path(x32.double(), narrow) == "chunked"  # no tiles for float64
    monkeypatch.setattr(bi, "_interpreting", lambda: False)
    assert bi.linear_path(x32, narrow) == "chunked"  # a CPU tensor, not interpreting


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_linear_refuses_a_weight_or_bias_of_another_dtype(which):
    """As ``F.linear`` does (a conversion at every call would copy the weight and change the product)."""
    x, w, b = torch.randn(3, 4), torch.randn(2, 4), torch.randn(2)
    if which == "weight":
        w = w.double()
    else:
        b = b.half()
    with pytest.raises(ValueError, match=f"invariant_linear: x is float32 but {which} is"):
        invariant_linear(x, w, b)


def test_linear_keeps_leading_dimensions():
    x, w = torch.randn(3, 5, 8), torch.randn(4, 8)
    assert torch.equal(invariant_linear(x, w), invariant_linear(x.reshape(15, 8), w).reshape(3, 5, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_the_function_row_by_row(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2 * CHUNK_ROWS + 7, 16, generator=gen)).to(dtype)
    w = torch.randn(16, generator=gen).to(dtype)
    out = invariant_rows(rms_norm_as_model, x, weight=w, eps=1e-6)
    torch.testing.assert_close(out, rms_norm_as_model(x, w, 1e-6))
    assert torch.equal(invariant_rows(rms_norm_as_model, x[5:6], weight=w, eps=1e-6), out[5:6])
    pair = invariant_rows(lambda a, c: (a + c, a - c), x, x.flip(0))
    assert torch.equal(pair[0], x + x.flip(0)) and torch.equal(pair[1], x - x.flip(0))


def _assert_rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except under Triton's interpreter, whose casts to half precision truncate (a GPU's round to
    nearest even): there within one unit of the last place."""
    if _INTERPRET and got.dtype != torch.float32:
        ulp = 2.0 ** -(7 if got.dtype == torch.bfloat16 else 10)
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-6)
    else:
        assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 2 * CHUNK_ROWS + 5),
    d=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    add=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_is_the_models_and_each_row_is_its_own(m, d, dtype, add, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, d, generator=gen)).to(dtype)
    delta = torch.randn(m, d, generator=gen).to(dtype)
    w = torch.rand(d, generator=gen).to(dtype)
    from ppo_core.kernels.fused import add_rms_norm, rms_norm

    if add:
        h, y = invariant_rms_norm(x, w, 1e-6, delta=delta)
        h_ref, y_ref = add_rms_norm_as_model(x, delta, w, 1e-6)
        _assert_rounded_alike(h, h_ref)
        h1, y1 = invariant_rms_norm(x, w, 1e-6, delta=delta, model_rounding=False)
        assert torch.equal(h1, h)
        once, once_ref = y1, add_rms_norm(x, delta, w, 1e-6)[1]
    else:
        y, y_ref = invariant_rms_norm(x, w, 1e-6), rms_norm_as_model(x, w, 1e-6)
        once, once_ref = invariant_rms_norm(x, w, 1e-6, model_rounding=False), rms_norm(x, w, 1e-6)
    assert once.dtype == once_ref.dtype == dtype
    if not _INTERPRET:
        assert torch.equal(once, once_ref)
    if _INTERPRET:  # the Triton kernel: its sum of squares in another order (and the interpreter's casts)
        tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
    else:  # on the CPU: the model's own arithmetic, bit for bit
        assert torch.equal(y, y_ref)
    row = int(torch.randint(0, m, (1,), generator=gen))
    alone = invariant_rms_norm(x[row : row + 1], w, 1e-6, delta=delta[row : row + 1] if add else None)
    assert torch.equal(alone[1] if add else alone, y[row : row + 1])


def test_rms_norm_keeps_leading_dimensions_and_checks_delta():
    x, w = torch.randn(3, 5, 8), torch.rand(8)
    assert torch.equal(
        invariant_rms_norm(x, w, 1e-5), invariant_rms_norm(x.reshape(15, 8), w, 1e-5).reshape(3, 5, 8)
    )
    assert invariant_rms_norm(torch.randn(0, 8), w, 1e-5).shape == (0, 8)
    with pytest.raises(ValueError, match=r"delta is torch\.float64"):
        invariant_rms_norm(x, w, 1e-5, delta=x.double())
    with pytest.raises(ValueError, match=r"delta is torch\.float32 \(15, 8\)"):
        invariant_rms_norm(x, w, 1e-5, delta=x.reshape(15, 8))


def _qkv(b, h, g, length, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, length, d, generator=gen).to(dtype)
    k = torch.randn(b, g, length, d, generator=gen).to(dtype)
    v = torch.randn(b, g, length, d, generator=gen).to(dtype)
    valid = torch.rand(b, length, generator=gen) < 0.8
    valid[:, -1] = True
    return q, k, v, valid


def _sdpa_reference(q, k, v, valid, slots, scale):
    """SDPA in float64 with the rule: key j is seen by the query at slot i when j <= i and (valid or j == i)."""
    h, g = q.shape[1], k.shape[1]
    kk, vv = (t.double().repeat_interleave(h // g, dim=1) for t in (k, v))
    j = torch.arange(k.shape[2])
    i = slots[:, None]
    seen = (j[None] <= i) & (valid[:, None, :] | (j[None] == i))  # [B, S, L]
    return F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=seen[:, None], scale=scale)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(0, 3),
    groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    length=st.integers(1, 2 * 64 + 3),
    width=st.sampled_from([8, 12, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_attention_matches_sdpa_over_the_visible_keys(batch, groups, length, width, dtype, seed):
    h, g = groups
    q, k, v, valid = _qkv(batch, h, g, length, width, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    valid &= (
        torch.rand(batch, length, generator=gen) < 0.7
    )  # rows may have no valid key: queries see themselves
    slots = torch.arange(length)
    out = invariant_attention(q, k, v, valid, slots)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    ref = _sdpa_reference(q, k, v, valid, slots, width**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_empty_inputs_give_empty_outputs():
    q, k, v, valid = _qkv(0, 2, 1, 5, 16, torch.float32, seed=0)
    assert invariant_attention(q, k, v, valid, torch.arange(5)).shape == (0, 2, 5, 16)
    assert invariant_linear(torch.randn(0, 4), torch.randn(3, 4)).shape == (0, 3)
    x = torch.randn(0, 4)
    assert invariant_rows(rms_norm_as_model, x, weight=torch.ones(4), eps=1e-6).shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_attention_is_attention_over_the_keys_up_to_each_slot(dtype, heads):
    h, g = heads
    q, k, v, valid = _qkv(3, h, g, 2 * bi.BLOCK_L + 9, 16, dtype, seed=1)
    valid[0, :7] = False  # a row's left padding: its first queries see only themselves
    slots = torch.arange(q.shape[2])
    out = invariant_attention(q, k, v, valid, slots)
    assert torch.isfinite(out).all()
    ref = _sdpa_reference(q, k, v, valid, slots, 16**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gives_the_same_bits_alone_in_any_batch_and_whatever_follows_its_slot(dtype):
    q, k, v, valid = _qkv(4, 4, 2, bi.BLOCK_L + 20, 16, dtype, seed=2)
    length = q.shape[2]
    full = invariant_attention(q, k, v, valid, torch.arange(length))
    for slot in (0, bi.BLOCK_L - 1, bi.BLOCK_L, length - 1):
        # the decode step of that slot: one query per row, the cache cut at any length past it, other rows
        for rows in (slice(None), slice(1, 3)):
            cut = min(length, slot + 1 + 5)
            alone = invariant_attention(
                q[rows, :, slot : slot + 1],
                k[rows, :, :cut],
                v[rows, :, :cut],
                valid[rows, :cut],
                torch.tensor([slot]),
            )
            assert torch.equal(alone, full[rows, :, slot : slot + 1])
    # keys and values after a query's slot are never used
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:], v2[:, :, 30:] = 1e4, -1e4
    again = invariant_attention(q, k2, v2, valid, torch.arange(length))
    assert torch.equal(again[:, :, :30], full[:, :, :30])


def _llama(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,  # a head width of 16: the Triton kernel's smallest (run under TRITON_INTERPRET=1)
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "qwen3":  # per-head RMSNorm of queries and keys
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(dtype).eval()


def _left_padded(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return torch.randint(1, VOCAB, (batch, width), generator=g) * mask, mask


def _cached_greedy_is_recomputation(engine, ids: torch.Tensor, mask: torch.Tensor, new: int):
    """Greedy-decode ``new`` tokens with ``engine`` and check that the logits each cached step sampled from are a
    full forward's of the whole sequence (``engine.recompute_logits``), bit for bit; the engine's output."""
    seen: list[torch.Tensor] = []

    def keep(t, logits):
        seen.append(logits.clone())
        return logits

    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=new, temperature=0.0), step_hook=keep)
    seq, seq_mask = ids, mask
    for t in range(new):
        logits = engine.recompute_logits(seq, seq_mask)
        assert torch.equal(seen[t], logits), f"step {t}"
        token = out["responses"][:, t]
        assert torch.equal(token, logits.float().argmax(-1))
        seq = torch.cat([seq, token[:, None]], 1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], 1)
    return out


@pytest.mark.parametrize(
    ("kind", "dtype", "fuse"),
    [
        ("llama", torch.float32, True),
        ("llama", torch.bfloat16, True),
        ("llama", torch.bfloat16, False),
        ("qwen2", torch.float32, True),
        ("qwen2", torch.bfloat16, True),
        ("qwen3", torch.bfloat16, True),
        ("mistral", torch.bfloat16, False),
    ],
)
def test_cached_greedy_decoding_is_full_recomputation_bit_for_bit(kind, dtype, fuse):
    from ppo_core_decode.hf import HFRolloutEngine

    engine = HFRolloutEngine(_llama(kind, dtype), fuse_projections=fuse, batch_invariant=True)
    ids, mask = _left_padded(9, 11, seed=3)
    _cached_greedy_is_recomputation(engine, ids, mask, new=14)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_samples_the_same_response_in_any_batch(dtype):
    from ppo_core_decode.hf import HFRolloutEngine

    engine = HFRolloutEngine(_llama("llama", dtype), batch_invariant=True)
    ids, mask = _left_padded(8, 9, seed=4)
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0)
    full = engine.generate(ids, mask, greedy)
    for rows in (slice(0, 1), slice(2, 7), slice(5, 8)):
        part = engine.generate(ids[rows], mask[rows], greedy)
        assert torch.equal(part["responses"], full["responses"][rows])
        assert torch.equal(part["rollout_log_probs"], full["rollout_log_probs"][rows])


def test_sampling_is_reproducible_and_agrees_with_the_default_engine_in_fp32():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _llama("llama", torch.float32)
    ids, mask = _left_padded(6, 8, seed=5)
    config = SamplingConfig(max_new_tokens=8, temperature=1.0)
    invariant = HFRolloutEngine(model, batch_invariant=True)
    first = invariant.generate(ids, mask, config, generator=torch.Generator().manual_seed(7))
    second = invariant.generate(ids, mask, config, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first["responses"], second["responses"])
    default = HFRolloutEngine(model).generate(ids, mask, config, generator=torch.Generator().manual_seed(7))
    # in fp32 the two orders of summation differ by rounding only: the same draws, log-probs within 1e-4
    assert torch.equal(first["responses"], default["responses"])
    torch.testing.assert_close(first["rollout_log_probs"], default["rollout_log_probs"], rtol=0, atol=1e-4)


def test_batch_invariance_needs_the_fused_path():
    from ppo_core_decode.hf import HFRolloutEngine

    with pytest.raises(ValueError, match="batch_invariant"):
        HFRolloutEngine(_llama("llama", torch.float32), fast_path=False, batch_invariant=True)


@pytest.mark.skipif(not _INTERPRET, reason="the Triton kernel on the CPU needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_is_the_torch_steps_and_query_invariant(dtype):
    q, k, v, valid = _qkv(2, 4, 2, bi.BLOCK_L + 6, 16, dtype, seed=6)
    valid[1, :4] = False
    slots = torch.arange(q.shape[2])
    out = bi._attention_triton(q, k, v, valid, slots, 0.25)
    ref = bi._attention_torch(q, k, v, valid, slots, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    last = q.shape[2] - 1
    alone = bi._attention_triton(q[:, :, last:], k, v, valid, torch.tensor([last]), 0.25)
    assert torch.equal(alone, out[:, :, last:])


@pytest.mark.skipif(not _INTERPRET, reason="the Triton kernel on the CPU needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_rounding", [True, False])
@pytest.mark.parametrize("d", [24, 64])
def test_triton_rms_norm_is_the_torch_steps_and_row_invariant(dtype, model_rounding, d):
    gen = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(CHUNK_ROWS + 9, d, generator=gen)).to(dtype)
    delta = torch.randn(x.shape, generator=gen).to(dtype)
    w = torch.rand(d, generator=gen).to(dtype)
    h, y = invariant_rms_norm(x, w, 1e-6, delta=delta, model_rounding=model_rounding)
    h_ref, y_ref = bi._norm_functions(model_rounding)[1](x, delta, w, 1e-6)
    _assert_rounded_alike(h, h_ref)
    assert y.dtype == y_ref.dtype
    # the sum of squares in another order (and the interpreter's casts truncate)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
    alone = invariant_rms_norm(h[7:8], w, 1e-6, model_rounding=model_rounding)
    assert torch.equal(alone, y[7:8])
    assert torch.equal(invariant_rms_norm(h, w, 1e-6, model_rounding=model_rounding), y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bi.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n", "bias"), [(576, 960, False), (100, 300, True), (896, 151936 // 8, False)])
def test_cuda_linear_rows_keep_their_bits_at_any_row_count(dtype, k, n, bias):
    """The Triton GEMM: a prefill-sized product (thousands of rows, partial tiles at both edges) gives every row the
    bits of a decode-sized one and of the row alone; its values are the product's to the dtype's precision."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(4099, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
    y = invariant_linear(x, w, b)
    assert y.shape == (4099, n) and y.dtype == dtype
    for rows in (slice(0, 1), slice(4098, 4099), slice(1000, 1064), slice(7, 520)):
        assert torch.equal(invariant_linear(x[rows], w, b), y[rows])
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cached_decoding_is_full_recomputation_bit_for_bit():
    from ppo_core_decode.hf import HFRolloutEngine

    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 97, (48,), generator=g)
    mask = (torch.arange(96)[None, :] >= 96 - lengths[:, None]).long()
    ids = (torch.randint(1, 1024, (48, 96), generator=g) * mask).cuda()
    mask = mask.cuda()
    new = 24
    # eagerly, so that the hook sees every step's logits
    eager = HFRolloutEngine(model, batch_invariant=True, cuda_graphs=False)
    out = _cached_greedy_is_recomputation(eager, ids, mask, new)
    # the captured decode step computes the same bits
    graphs = HFRolloutEngine(model, batch_invariant=True)
    replayed = graphs.generate(ids, mask, SamplingConfig(max_new_tokens=new, temperature=0.0))
    assert graphs.stats.graphs_captured >= 1
    assert torch.equal(replayed["responses"], out["responses"])
    assert torch.equal(replayed["rollout_log_probs"], out["rollout_log_probs"])


def test_the_sampling_config_asks_for_it_and_engines_that_cannot_refuse():
    from ppo_core.models import TinyGPT, TinyGPTConfig
    from ppo_core.rollout import generate
    from ppo_core_decode.hf import HFRolloutEngine

    model = _llama("llama", torch.bfloat16)
    ids, mask = _left_padded(6, 7, seed=8)
    config = SamplingConfig(max_new_tokens=6, temperature=0.0, batch_invariant=True)
    out = generate(model, ids, mask, config)
    alone = generate(model, ids[2:3], mask[2:3], config)
    assert torch.equal(alone["responses"], out["responses"][2:3])
    expected = HFRolloutEngine(model, batch_invariant=True).generate(ids, mask, config)
    assert torch.equal(out["responses"], expected["responses"])
    with pytest.raises(ValueError, match="batch_invariant=True"):
        HFRolloutEngine(model).generate(ids, mask, config)
    tiny = TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=16, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="batch_invariant=True"):
        generate(tiny, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_cached_greedy_decoding_is_full_recomputation_bit_for_bit(cpu_megatron, dtype):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _megatron import tiny_config

    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.model import build_gpt_model
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    cfg = tiny_config(dtype=dtype, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    ids, mask = _left_padded(7, 9, seed=9)
    ids = ids % cfg.vocab_size
    engine = MegatronRolloutEngine(model, cfg, batch_invariant=True)
    new = 10
    out = _cached_greedy_is_recomputation(engine, ids, mask, new)
    # a subset of the prompts: the same responses; the layers are megatron's own again afterwards
    part = engine.generate(ids[2:5], mask[2:5], SamplingConfig(max_new_tokens=new, temperature=0.0))
    assert torch.equal(part["responses"], out["responses"][2:5])
    assert not any(
        "_forward_impl" in m.__dict__ or "forward" in m.__dict__ for m in engine._linears + engine._norms
    )
    with pytest.raises(ValueError, match="tp_size = 1"):
        MegatronRolloutEngine(model, cfg, tp_size=2, batch_invariant=True)


def test_the_megatron_actor_config_refuses_batch_invariance_with_tensor_parallelism():
    from ppo_core.workers.megatron.config import MegatronActorConfig

    # checked once, when the config is built (the worker no longer checks it again)
    with pytest.raises(
        ValueError,
        match=r"^rollout\.batch_invariant=True needs parallel\.tensor_model_parallel_size=1, got 2",
    ):
        MegatronActorConfig.from_dict(
            {"rollout": {"batch_invariant": True}, "parallel": {"tensor_model_parallel_size": 2}}
        )
    assert MegatronActorConfig.from_dict({"rollout": {"batch_invariant": True}}).rollout.batch_invariant


@pytest.mark.parametrize("fast_path", [True, False])
def test_recompute_logits_is_the_models_forward_at_the_last_position(fast_path):
    from ppo_core_decode.hf import HFRolloutEngine

    model = _llama("llama", torch.float32)
    ids, mask = _left_padded(5, 8, seed=10)
    engine = HFRolloutEngine(model, fast_path=fast_path)
    logits = engine.recompute_logits(ids, mask)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation != "ppo_core_kv_cache"  # the model's own attention again
