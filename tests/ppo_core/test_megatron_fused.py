"""The fused pieces of the megatron model on the CPU: RMSNorm / LayerNorm, rotary embeddings, weight gradients
accumulated into ``main_grad``, the multi-tensor optimizer helpers, and ``cuda_compiled``'s fallback.

The CUDA side (compiled kernels, the fp32-output matrix product, megatron's own optimizer) is in
``test_megatron_gpu.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from _megatron import cpu_tensor_parallel, tiny_config

from ppo_core.kernels import compiled as _compiled
from ppo_core.workers.megatron.fused import FusedNorm, apply_rotary, rms_norm, rotary_tables
from ppo_core.workers.megatron.optim import clip_grads, grad_norm


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----- norms ------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 5),
    d=st.integers(1, 33),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    seed=st.integers(0, 99),
)
def test_rms_norm_matches_a_loop_reference(rows, d, eps, seed):
    x, w = _randn(seed, rows, d), _randn(seed + 1, d)
    ref = torch.stack([r / torch.sqrt((r * r).sum() / d + eps) * w for r in x]) if rows else x.clone()
    torch.testing.assert_close(rms_norm(x, w, eps), ref)  # fp64 in, fp64 maths
    torch.testing.assert_close(rms_norm(x.float(), w.float(), eps), ref.float(), rtol=1e-5, atol=1e-6)


def test_rms_norm_is_differentiable_and_keeps_the_input_dtype():
    x = _randn(0, 3, 7).requires_grad_()
    w = _randn(1, 7).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float64
    y.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.rms_norm(x2, (7,), w2, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)
    assert rms_norm(_randn(2, 2, 4, dtype=torch.bfloat16), torch.ones(4), 1e-5).dtype == torch.bfloat16


def _config(**kw):
    base = dict(
        normalization="RMSNorm",
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        sequence_parallel=False,
    )
    return SimpleNamespace(**{**base, **kw})


def test_fused_norm_holds_parameters_in_the_model_dtype_under_torch_names():
    norm = FusedNorm(config=_config(), hidden_size=6, eps=1e-5)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert norm.weight.dtype == torch.bfloat16 and not norm.weight.sequence_parallel
    ln = FusedNorm(
        config=_config(normalization="LayerNorm", params_dtype=torch.float32, sequence_parallel=True),
        hidden_size=6,
    )
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert all(p.sequence_parallel for p in ln.parameters())
    with torch.no_grad():
        ln.weight.copy_(_randn(0, 6).float())
        ln.bias.copy_(_randn(1, 6).float())
    x = _randn(2, 4, 6).float()
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (6,), ln.weight, ln.bias, 1e-5))
    ref = torch.nn.RMSNorm(6, eps=1e-5)
    torch.testing.assert_close(
        FusedNorm(config=_config(params_dtype=torch.float32), hidden_size=6, eps=1e-5)(x), ref(x)
    )


def test_fused_norm_rejects_other_normalizations():
    with pytest.raises(ValueError, match="L2Norm"):
        FusedNorm(config=_config(normalization="L2Norm"), hidden_size=4)


# ----- rotary embeddings ------------------------------------------------------------------------------------
def _complex_rotary(t: torch.Tensor, base: float) -> torch.Tensor:
    """Reference: channel pairs (i, i + d/2) as complex numbers multiplied by exp(i * p * theta_i)."""
    s, d = t.shape[0], t.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    phase = torch.polar(
        torch.ones(s, d // 2, dtype=torch.float64), torch.arange(s, dtype=torch.float64)[:, None] * theta
    )
    z = torch.complex(t[..., : d // 2], t[..., d // 2 :]) * phase[:, None, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


@settings(max_examples=30, deadline=None)
@given(
    s=st.integers(1, 9),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    half=st.integers(1, 8),
    base=st.sampled_from([1e4, 5e5]),
    seed=st.integers(0, 99),
)
def test_rotary_matches_complex_multiplication(s, heads, half, base, seed):
    d = 2 * half
    q, k = _randn(seed, s, 2, heads[0], d), _randn(seed + 1, s, 2, heads[1], d)
    cos, sin = rotary_tables(s, d, base)
    rq, rk = apply_rotary(q, k, cos, sin)
    # fp64 maths on fp32 tables (the angles of megatron's and Hugging Face's fp32 tables)
    torch.testing.assert_close(rq, _complex_rotary(q, base), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rk, _complex_rotary(k, base), rtol=1e-6, atol=1e-6)
    fq, fk = apply_rotary(q.float(), k.float(), cos, sin)
    torch.testing.assert_close(fq.double(), rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fk.double(), rk, rtol=1e-5, atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    d, s = 8, 6
    q = _randn(0, 1, 1, 1, d).expand(s, 1, 1, d).float()
    k = _randn(1, 1, 1, 1, d).expand(s, 1, 1, d).float()
    rq, rk = apply_rotary(q, k, *rotary_tables(s, d, 1e4))
    scores = torch.einsum("qd,kd->qk", rq[:, 0, 0], rk[:, 0, 0])
    for offset in range(-s + 1, s):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-4, atol=1e-5)


def test_rotary_tables_need_an_even_dimension():
    with pytest.raises(ValueError, match="dim=5"):
        rotary_tables(3, 5, 1e4)


# ----- weight gradients into main_grad ----------------------------------------------------------------------
def test_accumulate_weight_grad_adds_the_product_in_place():
    from ppo_core.workers.megatron.linear import accumulate_weight_grad

    g, x = _randn(0, 7, 3).float(), _randn(1, 7, 5).float()
    acc = _randn(2, 3, 5).float()
    expected = acc + g.T @ x
    accumulate_weight_grad(acc, g, x)
    torch.testing.assert_close(acc, expected)
    # a half-precision product into an fp32 accumulator (CPU: the add_ path)
    acc32 = torch.zeros(3, 5)
    accumulate_weight_grad(acc32, g.bfloat16(), x.bfloat16())
    torch.testing.assert_close(acc32, (g.bfloat16().T @ x.bfloat16()).float())


def _loss(model, ids):
    from ppo_core.workers.megatron.workers import position_ids

    return model(ids, position_ids(torch.ones_like(ids)), None).float().square().mean()


def test_main_grad_linears_accumulate_what_autograd_computes(cpu_megatron):
    """Two backward passes into main_grad equal twice autograd's gradient; DDP's protocol flag is set and the
    placeholder gradient is what the DDP hook discards."""
    from ppo_core.workers.megatron import ParallelConfig, build_gpt_model
    from ppo_core.workers.megatron.linear import MainGradColumnParallelLinear, MainGradRowParallelLinear

    model = build_gpt_model(tiny_config(), ParallelConfig())
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, MainGradColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, MainGradRowParallelLinear)
    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(0))
    _loss(model, ids).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = {layer.self_attention.linear_qkv.weight, layer.mlp.linear_fc1.weight}
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
        if p in fused:
            p.grad_added_to_main_grad = False
    for _ in range(2):
        _loss(model, ids).backward()
    for name, p in model.named_parameters():
        linear = name.endswith(
            ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
        )
        total = p.main_grad if linear else p.grad
        torch.testing.assert_close(total, 2 * ref[name], rtol=1e-5, atol=1e-7, msg=name)
        if p in fused:
            assert p.grad_added_to_main_grad and p.grad is not None  # the placeholder for megatron's hook
        elif linear:
            assert p.grad is None  # no DDP protocol: nothing written to .grad


def test_fused_and_megatron_linears_give_the_same_model(cpu_megatron):
    from ppo_core.workers.megatron import ParallelConfig, build_gpt_model

    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(1))
    fused, plain = (build_gpt_model(tiny_config(fused_kernels=f), ParallelConfig()) for f in (True, False))
    assert type(plain.decoder.layers[0].self_attention.linear_qkv).__name__ == "ColumnParallelLinear"
    assert fused.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(fused.state_dict())
    a, b = _loss(fused, ids), _loss(plain, ids)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_frozen_weights_take_megatrons_path(cpu_megatron, monkeypatch):
    from ppo_core.workers.megatron import ParallelConfig, build_gpt_model, linear

    calls = []
    fused_apply = linear._LinearMainGrad.apply
    monkeypatch.setattr(linear._LinearMainGrad, "apply", lambda *a: calls.append(1) or fused_apply(*a))
    ids = torch.randint(0, 70, (1, 5), generator=torch.Generator().manual_seed(2))
    model = build_gpt_model(tiny_config(), ParallelConfig())
    with torch.no_grad():
        trainable = _loss(model, ids)
    assert len(calls) == 4 * 2  # qkv, proj, fc1, fc2 of both layers
    model.requires_grad_(False)
    calls.clear()
    torch.testing.assert_close(_loss(model, ids), trainable)
    assert calls == []


def _tp_rank_main(rank: int, world: int, port: int, hf: dict | None, ids: torch.Tensor, out: dict) -> None:
    """One TP rank: the fused model's vocab-parallel loss and its gradients (main_grad for the linears), with
    Hugging Face names; ``hf=None`` keeps the random initialisation and also returns the weights."""
    from megatron.core import parallel_state as ps

    from ppo_core.workers.megatron import build_gpt_model, vocab_parallel_log_probs
    from ppo_core.workers.megatron.hf_loading import hf_to_megatron, megatron_to_hf

    with cpu_tensor_parallel(rank, world, port) as parallel:
        cfg = tiny_config()
        model = build_gpt_model(cfg, parallel)
        if hf is not None:
            model.load_state_dict(hf_to_megatron(hf, cfg, tp_rank=rank, tp_size=world), strict=False)
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
        loss = _tp_loss(model, ids, ps.get_tensor_model_parallel_group(), vocab_parallel_log_probs)
        loss.backward()
        grads = {n: p.main_grad + (0 if p.grad is None else p.grad) for n, p in model.named_parameters()}
        weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        out[rank] = (float(loss), grads, megatron_to_hf([weights], cfg) if hf is None else None)


def _tp_loss(model, ids, group, vocab_parallel_log_probs):
    from ppo_core.workers.megatron.workers import position_ids

    logits = model(ids[:, :-1], position_ids(torch.ones_like(ids[:, :-1])), None)
    return -vocab_parallel_log_probs(logits, ids[:, 1:], group, vocab_size=70).mean()


@pytest.mark.slow
def test_tensor_parallel_fused_model_matches_one_rank(rank_pool):
    """TP = 2 over gloo (our column-parallel linear all-reduces the input gradient): the loss of one rank, and
    the shards' gradients put together are the one-rank gradients."""
    from ppo_core.workers.megatron.hf_loading import megatron_to_hf

    ids = torch.randint(0, 70, (3, 10), generator=torch.Generator().manual_seed(4))
    ref_loss, ref_grads, hf = rank_pool.run(_tp_rank_main, 1, None, ids)[0]
    ref = megatron_to_hf([ref_grads], tiny_config())
    results = rank_pool.run(_tp_rank_main, 2, hf, ids)
    for rank in range(2):
        assert results[rank][0] == pytest.approx(ref_loss, rel=1e-5)
    got = megatron_to_hf([results[r][1] for r in range(2)], tiny_config())
    assert set(got) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


# ----- optimizer helpers ------------------------------------------------------------------------------------
class _FakeOptimizer:
    """The three methods of megatron's optimizer the helpers use, over plain parameters."""

    def __init__(self, params, for_norm=None):
        self.params = params
        self.for_norm = params if for_norm is None else for_norm

    def get_grad_stats_parallel_group(self):
        return None

    def get_main_grads_for_grad_norm(self):
        return [p.grad for p in self.for_norm]

    def get_parameters(self):
        return self.params


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    seed=st.integers(0, 99),
    max_norm=st.floats(0.01, 10),
)
def test_grad_norm_and_clipping_match_torch(sizes, seed, max_norm):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for i, p in enumerate(params):
        p.grad = _randn(seed + i, p.numel()).float()
    ref_params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p, q in zip(ref_params, params, strict=True):
        p.grad = q.grad.clone()
    norm = grad_norm(SimpleNamespace(chained_optimizers=[_FakeOptimizer(params)]))
    expected = float(torch.nn.utils.clip_grad_norm_(ref_params, max_norm))
    assert norm == pytest.approx(expected, rel=1e-6)
    clip_grads(_FakeOptimizer(params), max_norm, norm)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_grad_norm_counts_only_the_gradients_megatron_counts():
    shared = torch.nn.Parameter(torch.zeros(3))
    own = torch.nn.Parameter(torch.zeros(4))
    shared.grad, own.grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    # e.g. a tensor-parallel duplicate: stepped (and clipped) but not in the norm
    opt = _FakeOptimizer([shared, own], for_norm=[own])
    assert grad_norm(opt) == pytest.approx(2.0)
    clip_grads(opt, 1.0, 2.0)
    assert float(shared.grad[0]) == pytest.approx(2.0 / (2.0 + 1e-6))
    assert grad_norm(_FakeOptimizer([])) == 0.0


def test_clipping_leaves_small_gradients_alone():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    clip_grads(_FakeOptimizer([p]), 1.0, 0.5)
    torch.testing.assert_close(p.grad, torch.tensor([0.3, 0.4]))


# ----- cuda_compiled ----------------------------------------------------------------------------------------
class _LooksLikeCuda(torch.Tensor):
    """A CPU tensor that claims to be on CUDA, to drive cuda_compiled's compiled branch on the CPU."""

    @property
    def is_cuda(self):  # type: ignore[override]
        return True


def _fake_cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_LooksLikeCuda, t)


def test_cuda_compiled_falls_back_to_eager_once_when_compilation_fails(monkeypatch, caplog):
    calls = []

    def broken_compile(fn):
        def run(*args, **kwargs):
            calls.append(1)
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(_compiled.torch, "compile", broken_compile)

    @_compiled.cuda_compiled
    def plus_one(x):
        return x + 1

    x = _fake_cuda(torch.zeros(2))
    with caplog.at_level(logging.WARNING, logger=_compiled.__name__):
        assert plus_one(x).tolist() == [1.0, 1.0]
    assert "plus_one" in caplog.text and len(calls) == 1
    assert plus_one(x).tolist() == [1.0, 1.0]
    assert len(calls) == 1  # not retried
    assert plus_one(torch.ones(1)).tolist() == [2.0]  # CPU tensors never try


def test_cuda_compiled_raises_the_inputs_own_errors_and_keeps_compiling(monkeypatch):
    compiled_calls = []

    def fake_compile(fn):
        def run(*args, **kwargs):
            compiled_calls.append(1)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(_compiled.torch, "compile", fake_compile)

    @_compiled.cuda_compiled
    def matmul(a, b):
        return a @ b

    with pytest.raises(RuntimeError):
        matmul(_fake_cuda(torch.zeros(2, 3)), torch.zeros(2, 3))
    matmul(_fake_cuda(torch.zeros(2, 3)), torch.zeros(3, 2))
    assert len(compiled_calls) == 2  # the bad call did not switch compilation off


def test_cuda_compiled_passes_inductor_options(monkeypatch):
    seen = []

    def fake_compile(fn, options=None):
        seen.append(options)
        return fn

    monkeypatch.setattr(_compiled.torch, "compile", fake_compile)

    @_compiled.cuda_compiled(options={"emulate_precision_casts": True})
    def double(x):
        return x * 2

    assert double(torch.ones(1)).tolist() == [2.0] and seen == []  # the CPU runs eagerly, compiles nothing
    assert double(_fake_cuda(torch.ones(1))).tolist() == [2.0]
    assert seen == [{"emulate_precision_casts": True}]


@pytest.mark.parametrize("fused", [True, False])
def test_megatron_fusions_follow_fused_kernels_on_cuda_only(monkeypatch, fused):
    cfg = tiny_config(fused_kernels=fused)
    off = cfg.transformer_config()
    assert not off.bias_activation_fusion and not off.bias_dropout_fusion  # no CUDA here: no torch.compile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on = cfg.transformer_config()
    assert on.bias_activation_fusion is fused and on.bias_dropout_fusion is fused
