"""The residual stream added in the output and down projections' GEMMs (``add_linear_``, the layer loop's
``_adds_residual_in_products``): the function against a float64 reference, its in-place contract, and the layer loop
with the fused adds against the loop with separate add + norm kernels (forced on for the CPU's fp32 models, where
the default keeps the model's roundings; on by default for half precision on CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.rollout import SamplingConfig
from ppo_core_decode.decoder_loop import DecoderLayerLoop, add_linear_

pytest.importorskip("transformers")

from test_rollout_cached import _hf, _left_padded  # tiny HF models and left-padded prompts


def _reference(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h.double() + x.double() @ w.double().t()


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    d_out=st.integers(1, 24),
    d_in=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_add_linear_is_the_residual_plus_the_product(lead, d_out, d_in, dtype, inplace, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, d_out, generator=g).to(dtype)
    x = torch.randn(*lead, d_in, generator=g).to(dtype)
    w = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(dtype)
    want = _reference(h, x, w)
    before = h.clone()
    got = add_linear_(h, x, w, inplace=inplace)
    assert got.shape == h.shape and got.dtype == dtype
    # one rounding of the sum (plus the GEMM's own accumulation order): within a few units of the dtype's last place
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (1 + d_in**0.5))
    if inplace:
        assert got is h  # contiguous: written over the residual stream
    else:
        assert got is not h and torch.equal(h, before)


def test_add_linear_writes_a_new_tensor_for_a_strided_residual():
    """The prefill's last layer runs on a view of the last position (not contiguous): a new tensor, the view's base
    untouched, even when asked to write in place."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 4, generator=g)
    before = full.clone()
    h = full[:, -1:]
    x, w = torch.randn(3, 1, 6, generator=g), torch.randn(4, 6, generator=g)
    got = add_linear_(h, x, w, inplace=True)
    assert not h.is_contiguous() and torch.equal(full, before)
    torch.testing.assert_close(got.double(), _reference(h, x, w), rtol=1e-5, atol=1e-5)


def test_add_linear_propagates_non_finite_inputs_and_takes_empty_batches():
    h = torch.tensor([[1.0, float("inf")], [2.0, 3.0]])
    x = torch.tensor([[1.0], [float("nan")]])
    got = add_linear_(h.clone(), x, torch.ones(2, 1), inplace=True)
    assert torch.isinf(got[0, 1]) and got[0, 0] == 2.0 and torch.isnan(got[1]).all()
    empty = add_linear_(torch.zeros(0, 3), torch.zeros(0, 2), torch.ones(3, 2), inplace=True)
    assert empty.shape == (0, 3)


@pytest.mark.parametrize(
    ("h", "x", "w"),
    [((2, 3), (2, 4), (3, 5)), ((2, 3), (3, 4), (3, 4)), ((2, 3), (2, 4), (4, 4))],
)
def test_add_linear_names_the_shapes_it_cannot_combine(h, x, w):
    with pytest.raises(ValueError, match=r"h \(2, 3\)"):
        add_linear_(torch.zeros(h), torch.zeros(x), torch.zeros(w), inplace=True)


def _spy_adds(monkeypatch, module) -> list[bool]:
    """Record each ``add_linear_`` call's ``inplace`` (as ``module`` imported it)."""
    calls: list[bool] = []

    def spy(h, x, w, *, inplace):
        calls.append(inplace)
        return add_linear_(h, x, w, inplace=inplace)

    monkeypatch.setattr(module, "add_linear_", spy)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_loop_with_the_adds_in_the_products_draws_what_the_separate_adds_draw(kind, monkeypatch):
    """fp32 on the CPU, the fused adds forced on: the same greedy tokens and log-probs within fp32 rounding; the
    prefill adds through the products (two a layer, the first over a new tensor: the embedding's output is not the
    loop's to overwrite; the last layer's on its last position) and calls no add + norm kernel."""
    from ppo_core_decode import hf
    from ppo_core_decode.hf import HFRolloutEngine, _LlamaFamilyForward

    model = _hf(kind)
    ids, mask = _left_padded(5, 7, seed=3)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0)
    separate = HFRolloutEngine(model).generate(ids, mask, cfg)
    calls = _spy_adds(monkeypatch, hf)
    norms: list[int] = []
    add_norm = _LlamaFamilyForward._add_rms_norm

    def counting(self, h, delta, norm):
        norms.append(h.shape[1])
        return add_norm(self, h, delta, norm)

    monkeypatch.setattr(_LlamaFamilyForward, "_add_rms_norm", counting)
    monkeypatch.setattr(_LlamaFamilyForward, "_adds_residual_in_products", lambda self, h: True)
    fused = HFRolloutEngine(model).generate(ids, mask, cfg)
    layers = len(model.model.layers)
    # every forward (the prefill and each decode step of the unfused CPU path) adds through its products
    assert len(calls) == 2 * layers * cfg.max_new_tokens
    assert calls[: 2 * layers] == [False] + [True] * (2 * layers - 1)
    assert norms == []
    assert torch.equal(fused["responses"], separate["responses"])
    torch.testing.assert_close(
        fused["rollout_log_probs"], separate["rollout_log_probs"], rtol=1e-5, atol=1e-5
    )


def test_the_layer_loop_adds_separately_unless_the_subclass_fuses():
    """The base class's default (any subclass that does not opt in keeps the separate add + norm); and one with no
    layers is refused."""
    assert DecoderLayerLoop._adds_residual_in_products(DecoderLayerLoop(), torch.zeros(1, 1, 2)) is False

    class Empty(DecoderLayerLoop):
        def _attention(self, h, positions, cache):
            return None

        def _layers(self):
            return []

    with pytest.raises(ValueError, match="no layers"):
        Empty()._forward(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), None)


def test_hf_engine_keeps_the_models_roundings_on_the_cpu():
    """The default on the CPU (bit for bit the model's forward, see test_rollout_cached) and in fp32 anywhere."""
    from ppo_core_decode.hf import _LlamaFamilyForward

    loop = _LlamaFamilyForward(_hf("llama"))
    assert not loop._adds_residual_in_products(torch.zeros(1, 1, 32, dtype=torch.bfloat16))
    assert not loop._adds_residual_in_products(torch.zeros(1, 1, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_linear_on_cuda_is_the_sum_within_the_models_two_roundings():
    """bf16 on CUDA at a prefill's shape: written over the residual in place (cuBLAS reading and writing the same
    tensor), the same bits as the out-of-place ``addmm``, and within the error bound of the model's two roundings (the
    product's, then the sum's) of the exact sum at every entry. (How the GEMM's epilogue rounds is cuBLAS's: on one
    H200 71% of the entries equalled the correctly rounded exact sum, where one rounding of an fp32 sum would give
    nearly all, so it rounds the product first, as the model does.)"""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, k = 4096, 512, 2048
    h = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(d, k, device="cuda", generator=g) / k**0.5).bfloat16()
    exact = _reference(h, x, w)
    product = x.double() @ w.double().t()
    out = h.clone()
    got = add_linear_(out, x, w, inplace=True)
    assert got is out and torch.equal(got, torch.addmm(h, x, w.t()))
    unit = 2.0**-8  # bf16's unit roundoff
    bound = unit * (product.abs() + exact.abs()) * 1.01 + 1e-6
    assert ((got.double() - exact).abs() <= bound).all()
    separate = (h + torch.nn.functional.linear(x, w)).double()
    assert ((separate - exact).abs() <= bound).all()  # the bound is the model's own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_engine_adds_in_the_products_on_cuda_and_stays_near_the_fp32_model(kind, monkeypatch):
    """bf16 on CUDA: the prefill adds through its products by default, and its logits are as near an fp32 forward
    of the same model as those of the separate adds (within 10%, on average over rows and vocabulary)."""
    from ppo_core_decode import hf
    from ppo_core_decode.hf import HFRolloutEngine, _LlamaFamilyForward

    model = _hf(kind).cuda()
    ids, mask = (t.cuda() for t in _left_padded(16, 12, seed=4))
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        exact = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].double()
    model = model.bfloat16()
    calls = _spy_adds(monkeypatch, hf)
    fused = HFRolloutEngine(model).recompute_logits(ids, mask).double()
    assert len(calls) == 2 * len(model.model.layers)
    monkeypatch.setattr(_LlamaFamilyForward, "_adds_residual_in_products", lambda self, h: False)
    separate = HFRolloutEngine(model).recompute_logits(ids, mask).double()
    assert len(calls) == 2 * len(model.model.layers)  # the separate path adds nothing through its products
    err_fused, err_separate = (fused - exact).abs().mean(), (separate - exact).abs().mean()
    assert err_fused <= 1.1 * err_separate, (err_fused, err_separate)


@pytest.mark.parametrize("shape", [{}, {"tie_word_embeddings": True}, {"qkv_bias": True}])
def test_megatron_loop_with_the_adds_in_the_products_draws_what_the_separate_adds_draw(
    cpu_megatron, shape, monkeypatch
):
    """The megatron engine's own forward, fp32 on the CPU, the fused adds forced on: the same greedy tokens and
    log-probs within fp32 rounding as megatron's add + norm kernels, and every product's add through the GEMM."""
    pytest.importorskip("megatron.core")
    from _megatron import random_hf_state, tiny_config

    import ppo_core_decode.megatron as decode
    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.hf_loading import hf_to_megatron
    from ppo_core.workers.megatron.model import build_gpt_model
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine
    from ppo_core_decode.megatron import MegatronDecodeForward

    cfg = tiny_config(**shape)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    model.load_state_dict(hf_to_megatron(random_hf_state(cfg, 2), cfg, tp_rank=0, tp_size=1), strict=False)
    ids, mask = _left_padded(5, 6, seed=6)
    ids = ids % cfg.vocab_size
    config = SamplingConfig(max_new_tokens=5, temperature=0.0)
    separate = MegatronRolloutEngine(model, cfg).generate(ids, mask, config)
    calls = _spy_adds(monkeypatch, decode)
    monkeypatch.setattr(MegatronDecodeForward, "_adds_residual_in_products", lambda self, h: True)
    engine = MegatronRolloutEngine(model, cfg)
    assert engine.own_forward
    fused = engine.generate(ids, mask, config)
    layers = cfg.num_layers
    assert len(calls) == 2 * layers * config.max_new_tokens
    assert calls[: 2 * layers] == [False] + [True] * (2 * layers - 1)
    assert torch.equal(fused["responses"], separate["responses"])
    torch.testing.assert_close(
        fused["rollout_log_probs"], separate["rollout_log_probs"], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_hf_engine_normalises_and_gates_through_the_launches_where_they_apply(
    monkeypatch, device
) -> None:
    """With :func:`~ppo_core_decode.elementwise_launch.launches_directly` true (forced on the CPU, where the launches
    run their PyTorch form) the HF engine's layer loop normalises and gates through them, and its logits stay the
    model's own forward's."""
    import ppo_core_decode.elementwise_launch as el
    import ppo_core_decode.hf as hf

    model = _hf("llama").to(device)
    layers = model.config.num_hidden_layers
    prompts = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    prompts = prompts.to(device)
    calls = {"norm": 0, "swiglu": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(el, "launches_directly", lambda x: True)
    monkeypatch.setattr(el, "rms_norm_launch", counted("norm", el.rms_norm_launch))
    monkeypatch.setattr(el, "silu_mul_launch", counted("swiglu", el.silu_mul_launch))
    engine = hf.HFRolloutEngine(model)
    logits = engine.sequence_logits(prompts, torch.ones_like(prompts), keep=7)  # [B, S, V]
    # two norms a layer and the final one; SwiGLU once a layer
    assert calls == {"norm": 2 * layers + 1, "swiglu": layers}
    with torch.no_grad():
        want = model(prompts).logits
    torch.testing.assert_close(logits.float(), want.float(), rtol=1e-4, atol=1e-4)
