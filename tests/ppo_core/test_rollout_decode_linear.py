"""The decode-step GEMM with its fused prologue and epilogue (:mod:`ppo_core_decode.decode_linear`) equals its
PyTorch contract, and the contract equals the models' own steps (``TRITON_INTERPRET=1`` on CPU where Triton is
installed, and on CUDA under the ``gpu`` marker; the contract's own tests always run)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode import decode_linear as dl
from ppo_core_decode.decode_linear import (
    MAX_ROWS,
    DecodeLinearConfig,
    decode_linear,
    decode_linear_reference,
    fold_norm_weight,
)
from ppo_core_decode.eager_rounding import rms_norm_as_model, silu_mul_as_model
from ppo_core_decode.split_launch import arrival_counters

INTERPRET = dl.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and dl.triton is not None
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if CUDA else [])
kernel = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _inputs(m, n, k, dtype, device, seed, *, norm=False, residual=False, bias=False, swiglu=False):
    """Rows, weight, bias, partial sums of squares of the rows (three blocks, as a producer writes them) and a
    residual stream of the output's width."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    sq = None
    if norm:
        squares = x.float().square()
        sq = torch.stack([part.sum(-1) for part in squares.tensor_split(3, dim=-1)])  # [3, M]
    r = torch.randn(m, n // 2 if swiglu else n, generator=gen).to(dtype) if residual else None
    return [None if t is None else t.to(device) for t in (x, w, b, sq, r)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, device: str) -> None:
    """Both sides round to ``dtype`` from fp32 sums in different orders: a step of ``dtype`` at the value's size,
    a few steps through SwiGLU's three roundings. Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to
    nearest), one more step each."""
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    steps = 8 if dtype == torch.bfloat16 and device == "cpu" else 4
    torch.testing.assert_close(got.float(), want.float(), atol=steps * step, rtol=steps * step)


# ----- the contract against the models' own arithmetic (always runs) -----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contract_norm_epilogue_is_the_models_norm_then_the_product(dtype) -> None:
    x, w, b, sq, _ = _inputs(5, 24, 40, dtype, "cpu", 0, norm=True, bias=True)
    nw = (1 + 0.2 * torch.randn(40, generator=torch.Generator().manual_seed(9))).to(dtype)
    y, none, _ = decode_linear_reference(x, fold_norm_weight(w, nw), b, sumsq=sq, eps=1e-5)
    assert none is None
    want = F.linear(rms_norm_as_model(x, nw, 1e-5).float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 4 * 2.0**-7
    torch.testing.assert_close(y.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_contract_residual_epilogue_is_the_models_add_and_its_statistics() -> None:
    x, w, b, _, r = _inputs(4, 16, 24, torch.bfloat16, "cpu", 1, residual=True, bias=True)
    y, sq, _ = decode_linear_reference(x, w, b, residual=r)
    assert torch.equal(y, r + F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
    assert torch.equal(sq, y.float().square().sum(-1))


def test_contract_scaled_copy_is_the_new_residual_times_the_next_norm_weight() -> None:
    x, w, b, _, r = _inputs(4, 16, 24, torch.bfloat16, "cpu", 2, residual=True, bias=True)
    nw = torch.linspace(0.5, 2.0, 16).to(torch.bfloat16)
    y, _, scaled = decode_linear_reference(x, w, b, residual=r, next_norm_weight=nw)
    assert torch.equal(scaled, y * nw)
    assert decode_linear_reference(x, w, b, residual=r).scaled is None


def test_first_norm_statistics_are_the_rows_sums_of_squares_and_the_scaled_rows() -> None:
    from ppo_core_decode.decode_linear import row_sumsq, row_sumsq_scaled

    x, _, _, _, _ = _inputs(5, 8, 24, torch.bfloat16, "cpu", 3)
    nw = torch.linspace(0.5, 2.0, 24).to(torch.bfloat16)
    want = torch.tensor([[sum(float(v) ** 2 for v in row) for row in x.float()]])
    torch.testing.assert_close(row_sumsq(x), want, rtol=1e-6, atol=0)
    sq, scaled = row_sumsq_scaled(x, nw)
    assert sq.shape == (1, 5) and sq.dtype == torch.float32 and torch.equal(sq, row_sumsq(x))
    assert scaled.dtype == torch.bfloat16 and torch.equal(scaled, (x.float() * nw.float()).to(torch.bfloat16))


def test_arrival_counters_are_one_zeroed_buffer_per_device_that_only_grows() -> None:
    from ppo_core_decode import split_launch

    cpu = torch.device("cpu")
    assert split_launch.sm_count(cpu) == 132  # off CUDA: shaped as on an H100/H200
    small = split_launch.arrival_counters(cpu, 10)
    assert small.dtype == torch.int32 and small.numel() >= 10 and not small.any()
    assert split_launch.arrival_counters(cpu, small.numel()) is small
    grown = split_launch.arrival_counters(cpu, small.numel() + 1)
    assert grown.numel() > small.numel() and not grown.any()
    assert split_launch.arrival_counters(cpu, 1) is grown
    assert any(t is small for t in split_launch._OUTGROWN)  # kept alive for graphs captured with it


def test_contract_swiglu_rounds_as_the_model() -> None:
    x, w, b, _, _ = _inputs(4, 32, 16, torch.bfloat16, "cpu", 1, bias=True)
    y, _, _ = decode_linear_reference(x, w, b, swiglu=True)
    gate, up = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16).chunk(2, dim=-1)
    assert torch.equal(y, silu_mul_as_model(gate, up))


def test_unavailable_inputs_are_refused_with_their_shapes() -> None:
    x, w, *_ = _inputs(MAX_ROWS + 1, 16, 16, torch.bfloat16, "cpu", 2)
    with pytest.raises(ValueError, match=r"M <= 64.*\(65, 16\)"):
        decode_linear(x, w)


# ----- the kernel against the contract ------------------------------------------------------------------------
@kernel
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, MAX_ROWS),
    n=st.integers(1, 90),
    k=st.integers(1, 300),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    split=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_contract(device, m, n, k, flags, split, dtype, seed) -> None:
    norm, residual, bias, swiglu = flags
    n = 2 * n if swiglu else n
    x, w, b, sq, r = _inputs(
        m, n, k, dtype, device, seed, norm=norm, residual=residual, bias=bias, swiglu=swiglu
    )
    cfg = DecodeLinearConfig(block_n=16, block_k=32, split_k=split)
    gen = torch.Generator().manual_seed(seed + 1)
    width = n // 2 if swiglu else n
    nw = (1 + torch.randn(width, generator=gen)).to(dtype).to(device) if residual else None
    kw = {"sumsq": sq, "eps": 1e-5, "residual": r, "swiglu": swiglu, "next_norm_weight": nw}
    y, sq_out, scaled = decode_linear(x, w, b, config=cfg, **kw)
    want_y, _, _ = decode_linear_reference(x, w, b, **kw)
    assert y.shape == want_y.shape and y.dtype == dtype
    _close(y, want_y, dtype, device)
    if residual:  # the statistics and the scaled copy of the output the kernel wrote
        assert sq_out.shape == (-(-y.shape[1] // 16), m)
        torch.testing.assert_close(sq_out.sum(0), y.float().square().sum(-1), rtol=1e-5, atol=1e-5)
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter truncates to bf16: one step
            torch.testing.assert_close(scaled.float(), (y * nw).float(), atol=0, rtol=2.0**-7)
        else:  # one rounding of the exact product, as torch's multiply
            assert torch.equal(scaled, y * nw)
    else:
        assert sq_out is None and scaled is None


@kernel
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, MAX_ROWS),
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    norm=st.booleans(),
    bias=st.booleans(),
    sms=st.integers(1, 6),
    tiles=st.integers(1, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_persistent_launch_equals_the_contract(device, m, n, k, norm, bias, sms, tiles, dtype, seed) -> None:
    """One program per SM (``sms`` of them), ``tiles`` column tiles each: every column written once, as the
    contract computes it, whether the tiles fill ``block_n`` or leave lanes masked, and with fewer tiles than
    programs."""
    x, w, b, sq, _ = _inputs(m, n, k, dtype, device, seed, norm=norm, bias=bias)
    cols = -(-n // (sms * tiles))
    block_n = max(16, 1 << (cols - 1).bit_length())
    cfg = DecodeLinearConfig(block_n=block_n, block_k=32, num_stages=2, tiles_per_program=tiles)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dl, "sm_count", lambda device: sms)
        y, sq_out, scaled = decode_linear(x, w, b, sumsq=sq, eps=1e-5, config=cfg)
    want = decode_linear_reference(x, w, b, sumsq=sq, eps=1e-5).y
    assert y.shape == want.shape and y.dtype == dtype and sq_out is None and scaled is None
    _close(y, want, dtype, device)
    # on CUDA the grid launch is the same sums in the same order: the same bits (the interpreter's fp32 matmul
    # sums a column in an order that depends on the columns beside it)
    if device == "cuda":
        grid = decode_linear(
            x, w, b, sumsq=sq, eps=1e-5, config=DecodeLinearConfig(block_n=block_n, block_k=32)
        )
        assert torch.equal(y, grid.y)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_persistent_launch_refuses_what_it_does_not_fuse(device, monkeypatch) -> None:
    monkeypatch.setattr(dl, "sm_count", lambda device: 2)
    x, w, _, sq, r = _inputs(4, 64, 32, torch.bfloat16, device, 5, norm=True, residual=True)
    cfg = DecodeLinearConfig(block_n=16, block_k=32, tiles_per_program=2)
    with pytest.raises(ValueError, match="takes no residual"):
        decode_linear(x, w, sumsq=sq, residual=r, config=cfg)
    with pytest.raises(ValueError, match="takes no residual"):
        decode_linear(x, w, swiglu=True, config=cfg)
    with pytest.raises(ValueError, match="takes no residual"):
        decode_linear(x, w, config=dataclasses.replace(cfg, split_k=2))
    with pytest.raises(ValueError, match="more than block_n = 16"):  # 64 columns in 2 x 1 tiles: 32 a tile
        decode_linear(x, w, config=dataclasses.replace(cfg, tiles_per_program=1))


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_split_k_is_deterministic_and_resets_its_counters(device) -> None:
    x, w, b, sq, r = _inputs(9, 48, 256, torch.float16, device, 3, norm=True, residual=True, bias=True)
    cfg = DecodeLinearConfig(block_n=16, block_k=32, split_k=4)
    first = decode_linear(x, w, b, sumsq=sq, residual=r, config=cfg)
    for _ in range(3):
        again = decode_linear(x, w, b, sumsq=sq, residual=r, config=cfg)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not arrival_counters(x.device, 1).any()
    single = decode_linear(x, w, b, sumsq=sq, residual=r, config=DecodeLinearConfig(block_n=16, block_k=32))
    _close(first[0], single[0], torch.float16, device)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_refused_arguments(device) -> None:
    x, w, _, sq, r = _inputs(6, 32, 64, torch.bfloat16, device, 4, norm=True, residual=True)
    wide = torch.zeros(6, 80, dtype=x.dtype, device=device)
    wide[:, :64] = x
    y, _, _ = decode_linear(wide[:, :64], w, sumsq=sq, residual=r)
    want_y, _, _ = decode_linear_reference(x, w, sumsq=sq, residual=r)
    _close(y, want_y, torch.bfloat16, device)
    with pytest.raises(ValueError, match="even number"):
        decode_linear(x, w[:31], swiglu=True)
    with pytest.raises(ValueError, match="residual must be"):
        decode_linear(x, w, residual=r[:, :3])
    with pytest.raises(ValueError, match="next_norm_weight needs residual"):
        decode_linear(x, w, next_norm_weight=torch.ones(w.shape[0], dtype=x.dtype, device=x.device))
    with pytest.raises(ValueError, match="sumsq must be"):
        decode_linear(x, w, sumsq=sq.double())


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_engine_fused_decode_matches_the_default_engine(device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_core.rollout.sampling import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    lm = LlamaForCausalLM(config).to(torch.float16).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 64, (3, 6), generator=gen).to(device)
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    want = HFRolloutEngine(lm, fused_decode=False).generate(prompts, mask, sampling)
    fused = HFRolloutEngine(lm, fused_decode=True)
    got = fused.generate(prompts, mask, sampling)
    assert fused._forward.fused_decode and (HFRolloutEngine(lm)._forward.fused_decode is (device == "cuda"))
    assert torch.equal(got["responses"], want["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=2e-3, rtol=0)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("fold_norms", [True, False])
def test_megatron_engine_fused_decode_matches_its_unfused_forward(cpu_megatron, fold_norms) -> None:
    """The megatron engine's decode steps through ``decode_linear`` (the norms' weights folded into copies of the
    q/k/v and fc1 weights, or the residual epilogue writing the next norm's input and no weight copied) draw the
    greedy tokens of its unfused forward, and their log-probs are as close to the same model's in fp32 (its real
    vocabulary, the padded entries dropped) as the unfused fp16 forward's, at worst and on average, up to the
    interpreter's truncating conversions."""
    pytest.importorskip("megatron.core")
    from _megatron import random_hf_state, tiny_config

    from ppo_core.rollout.sampling import SamplingConfig
    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.engine import megatron_attention_mask, position_ids
    from ppo_core.workers.megatron.hf_loading import hf_to_megatron
    from ppo_core.workers.megatron.model import build_gpt_model
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    for shape in ({}, {"num_query_groups": 1, "tie_word_embeddings": True, "qkv_bias": True}):
        cfg = tiny_config(dtype="float16", hidden_size=64, ffn_hidden_size=96, **shape)
        model = build_gpt_model(cfg, ParallelConfig()).eval()
        state = hf_to_megatron(random_hf_state(cfg, 2), cfg, tp_rank=0, tp_size=1)
        model.load_state_dict(state, strict=False)
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, 70, (3, 6), generator=gen)
        mask = torch.ones_like(prompts)
        mask[0, :2] = 0
        sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
        assert not MegatronRolloutEngine(model, cfg).fused_decode  # on by default on CUDA only
        want = MegatronRolloutEngine(model, cfg, fused_decode=False).generate(prompts, mask, sampling)
        fused = MegatronRolloutEngine(model, cfg, fused_decode=True, fold_norms=fold_norms)
        calls = []
        step = fused._own._decode_step
        own = fused._own
        fused._own._decode_step = lambda *a, calls=calls, step=step, own=own: (
            calls.append(own._fold_now),
            step(*a),
        )[1]
        got = fused.generate(prompts, mask, sampling)
        # every decode step took the fused path, with the folded weights where asked for
        assert calls == [fold_norms] * (sampling.max_new_tokens - 1)
        assert torch.equal(got["responses"], want["responses"])
        # the same model in fp32, its log-probs of the drawn tokens by a full forward
        cfg32 = tiny_config(dtype="float32", hidden_size=64, ffn_hidden_size=96, **shape)
        model32 = build_gpt_model(cfg32, ParallelConfig())
        model32.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        seq = torch.cat([prompts, want["responses"]], 1)
        seq_mask = torch.cat([mask, torch.ones_like(want["responses"])], 1)
        with torch.no_grad():
            logits = model32.eval()(seq, position_ids(seq_mask), megatron_attention_mask(seq_mask))
        p = prompts.shape[1]
        logits = logits[:, p - 1 : -1, : cfg.vocab_size].float()  # the padded vocabulary's entries dropped
        exact = logits.log_softmax(-1).gather(-1, want["responses"][..., None])[..., 0]
        unfused_error = (want["rollout_log_probs"] - exact).abs()
        fused_error = (got["rollout_log_probs"] - exact).abs()
        assert unfused_error.max() > 0
        # as close to the fp32 model as megatron's own fp16 forward, at worst and on average, up to the
        # interpreter's conversions (it truncates fp32 -> half precision where the GPU rounds to nearest: up to 1.2x
        # the unfused gap here); a 0.3% error in a folded weight gives 2.5x
        slack = 1.5
        assert fused_error.max() <= slack * unfused_error.max(), (fused_error.max(), unfused_error.max())
        assert fused_error.mean() <= slack * unfused_error.mean(), (fused_error.mean(), unfused_error.mean())


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 with Triton")
def test_megatron_engine_refolds_the_current_weights_in_place(cpu_megatron) -> None:
    """With ``keep_cache`` (kept CUDA graphs read fixed addresses) every generation folds the norms' weights as
    training left them into the same buffers, and draws what a fresh engine draws; a generation whose decode steps
    cannot take the fused step (more than ``MAX_ROWS`` rows) folds nothing."""
    pytest.importorskip("megatron.core")
    from _megatron import random_hf_state, tiny_config

    from ppo_core.rollout.sampling import SamplingConfig
    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.hf_loading import hf_to_megatron
    from ppo_core.workers.megatron.model import build_gpt_model
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    cfg = tiny_config(dtype="float16", hidden_size=64, ffn_hidden_size=96)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    model.load_state_dict(hf_to_megatron(random_hf_state(cfg, 4), cfg, tp_rank=0, tp_size=1), strict=False)
    prompts = torch.randint(1, 70, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    engine = MegatronRolloutEngine(model, cfg, fused_decode=True, keep_cache=True)
    engine.generate(prompts, mask, sampling)
    addresses = [t.data_ptr() for pair in engine._own._folded for t in pair]
    with torch.no_grad():  # a training step, norms included
        for p in model.parameters():
            p.mul_(
                1 + 0.2 * torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype)
            )
    got = engine.generate(prompts, mask, sampling)
    assert [t.data_ptr() for pair in engine._own._folded for t in pair] == addresses
    layer = model.decoder.layers[1]
    torch.testing.assert_close(
        engine._own._folded[1][1],
        layer.mlp.linear_fc1.weight * layer.pre_mlp_layernorm.weight,
        rtol=0,
        atol=0,
    )
    want = MegatronRolloutEngine(model, cfg, fused_decode=True).generate(prompts, mask, sampling)
    assert torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["rollout_log_probs"], want["rollout_log_probs"])
    engine.release()
    assert engine._own._folded is None
    wide = MegatronRolloutEngine(model, cfg, fused_decode=True, keep_cache=True)  # nothing freed after it
    rows = dl.MAX_ROWS + 1
    wide.generate(torch.ones(rows, 3, dtype=torch.long), torch.ones(rows, 3, dtype=torch.long), sampling)
    assert wide._own._qkv is not None and wide._own._folded is None and not wide._own._fold_now
    wide.release()


def test_megatron_engine_refuses_fused_decode_without_its_own_forward_or_with_tp(cpu_megatron) -> None:
    pytest.importorskip("megatron.core")
    from _megatron import tiny_config

    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.model import build_gpt_model
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    cfg = tiny_config()
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    with pytest.raises(ValueError, match="fused_decode=True needs the engine's own forward"):
        MegatronRolloutEngine(model, cfg, own_forward=False, fused_decode=True)


def test_engine_refuses_fused_decode_with_batch_invariance() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_core_decode.hf import HFRolloutEngine

    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="fused_decode=True needs"):
        HFRolloutEngine(lm, fused_decode=True, batch_invariant=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
def test_cuda_graph_replays_split_k_with_fresh_inputs() -> None:
    shapes = (64, 2048, 2048, torch.bfloat16, "cuda")
    x, w, b, sq, r = _inputs(*shapes, 5, norm=True, residual=True, bias=True)
    cfg = DecodeLinearConfig(split_k=4)
    decode_linear(x, w, b, sumsq=sq, residual=r, config=cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, sq_out, _ = decode_linear(x, w, b, sumsq=sq, residual=r, config=cfg)
    for seed in range(3):
        fresh = _inputs(*shapes, 10 + seed, norm=True, residual=True, bias=True)
        for buf, new in zip((x, sq, r), (fresh[0], fresh[3], fresh[4]), strict=True):
            buf.copy_(new)
        graph.replay()
        want_y, want_sq, _ = decode_linear(x, w, b, sumsq=sq, residual=r, config=cfg)
        assert torch.equal(y, want_y) and torch.equal(sq_out, want_sq)
        ref_y, _, _ = decode_linear_reference(x, w, b, sumsq=sq, residual=r)
        _close(y, ref_y, torch.bfloat16, "cuda")


def test_folded_concatenation_is_the_concatenation_of_scaled_weights() -> None:
    from ppo_core_decode.hf import _concatenated_all

    gen = torch.Generator().manual_seed(6)
    layers = tuple(torch.nn.Linear(12, n, bias=n == 5) for n in (4, 5, 3))
    for layer in layers:
        torch.nn.init.normal_(layer.weight, generator=gen)
    scale = torch.rand(12, generator=gen) + 0.5
    with torch.no_grad():  # as refresh() builds them
        weight, bias = _concatenated_all([(layers, None, scale)])[0]
        want = torch.cat([layer.weight * scale for layer in layers])
        assert torch.equal(weight, want)
        assert torch.equal(bias, torch.cat([torch.zeros(4), layers[1].bias, torch.zeros(3)]))
        out = (torch.empty_like(weight), torch.empty_like(bias))
        again, _ = _concatenated_all([(layers, out, scale * 2)])[0]
        assert again.data_ptr() == out[0].data_ptr()
        assert torch.equal(again, torch.cat([layer.weight * (scale * 2) for layer in layers]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_folded_norms_samples_what_the_default_engine_samples_on_the_cpu(dtype) -> None:
    """Without the kernel (the CPU) a fused_decode engine still folds the norms' weights into the concatenated
    projections and normalises without them: the same greedy tokens, log-probs within the roundings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_core.rollout.sampling import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine

    torch.manual_seed(0)
    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).to(dtype)
    for layer in lm.model.layers:  # norms whose weights matter
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    prompts = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    want = HFRolloutEngine(lm).generate(prompts, mask, sampling)
    engine = HFRolloutEngine(lm, fused_decode=True)
    got = engine.generate(prompts, mask, sampling)
    assert torch.equal(got["responses"], want["responses"])
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=tol, rtol=0)
    assert engine._forward._fused is None  # dropped after the generation (no keep_cache)


def test_weights_up_to_the_prefetch_limit_are_prefetched() -> None:
    """The gate of the L2 prefetch before the wait: a weight of exactly ``PREFETCH_MAX_BYTES`` is prefetched, one row
    more is not, in either half precision (the bytes count, not the entries); Qwen3-0.6B's four products are under
    it, Llama-3.2-1B's MLP weights over it."""
    from ppo_core_decode.decode_linear import PREFETCH_MAX_BYTES, prefetches_weight

    for dtype in (torch.bfloat16, torch.float16):
        k = 1024
        rows = PREFETCH_MAX_BYTES // (2 * k)
        assert prefetches_weight(torch.empty(rows, k, dtype=dtype, device="meta"))
        assert not prefetches_weight(torch.empty(rows + 1, k, dtype=dtype, device="meta"))
    qwen3 = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
    llama_mlp = [(16384, 2048), (2048, 8192)]
    assert all(prefetches_weight(torch.empty(shape, dtype=torch.bfloat16, device="meta")) for shape in qwen3)
    assert not any(prefetches_weight(torch.empty(s, dtype=torch.bfloat16, device="meta")) for s in llama_mlp)


def test_default_launch_shapes_of_a_llama_layer() -> None:
    cpu = torch.device("cpu")  # sized as for an H100/H200's 132 SMs
    qkv, o = dl._default_config(3072, 2048, False, cpu), dl._default_config(2048, 2048, False, cpu)
    gate_up, down = dl._default_config(8192, 2048, True, cpu), dl._default_config(2048, 8192, False, cpu)
    head = dl._default_config(128256, 2048, False, cpu)
    # q/k/v: 96 programs of one column block each, so a deeper pipeline; the others fill the SMs by splitting K
    assert (qkv.block_n, qkv.split_k, qkv.num_stages) == (32, 1, 6)
    assert (o.block_n, o.split_k, o.num_stages) == (32, 2, 4)
    assert (gate_up.block_n, gate_up.split_k, gate_up.num_stages) == (64, 1, 3)
    assert (down.block_n, down.split_k, down.num_stages) == (64, 4, 4)
    # the vocabulary: persistent, 8 tiles of ceil(128256 / (132 * 8)) = 122 columns a program
    assert (head.block_n, head.block_k, head.split_k, head.num_stages, head.tiles_per_program) == (
        128,
        128,
        1,
        4,
        8,
    )
    assert dl._default_config(128256, 2048, False, cpu, plain=False).tiles_per_program == 0


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 200_000), k=st.integers(1, 20_000), swiglu=st.booleans())
def test_default_launch_shape_fits_shared_memory(width, k, swiglu) -> None:
    """Every default shape's tiles in shared memory (``stages + 1`` of them: 64 rows of x and the weight's block,
    twice with SwiGLU; what Triton allocates for these loops) fit the 227 KiB of an H100/H200, and a split keeps at
    least four K blocks per program."""
    cfg = dl._default_config(width, k, swiglu, torch.device("cpu"))
    tile_bytes = (MAX_ROWS + cfg.block_n * (2 if swiglu else 1)) * cfg.block_k * 2
    # the grid launch loads its first tile before the pipelined loop; the persistent one's loop holds them all
    buffers = cfg.num_stages + (cfg.tiles_per_program == 0)
    assert buffers * tile_bytes <= 227 * 1024
    assert cfg.split_k == 1 or k // cfg.split_k >= 4 * cfg.block_k
    if cfg.tiles_per_program:  # enough tiles for every column
        assert -(-width // (132 * cfg.tiles_per_program)) <= cfg.block_n
    assert cfg.num_stages in (3, 4, 6)


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal outside NaNs, NaN at the same places (a NaN's payload differs between Triton and PyTorch)."""
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
    return torch.equal(got.masked_fill(nan, 0).view(bits), want.masked_fill(nan, 0).view(bits))


def _fold_case(rows, k, dtype, device, seed, specials):
    gen = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(n, k, generator=gen) * 4).to(dtype) for n in rows]
    # fp32: cast to the weights' dtype first, as fold_norm_weight does
    scale = torch.randn(k, generator=gen) * 3
    if specials and k >= 4 and sum(rows):
        scale[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-30])
        first = next(w for w in weights if w.shape[0])
        first[0, : min(k, 3)] = torch.tensor([-0.0, float("-inf"), 0.0])[: min(k, 3)].to(dtype)
    return [w.to(device) for w in weights], scale.to(device)


_FOLD_DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.mark.parametrize("device", _FOLD_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(st.integers(0, 37), min_size=1, max_size=5),
    k=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
)
def test_fold_norm_weights_is_each_weight_folded_into_its_rows(
    device, dtype, rows, k, seed, specials
) -> None:
    """One launch on CUDA (up to four weights; five take the per-weight path): the same bits as
    ``fold_norm_weight`` of each weight, including -0.0, infinities and NaN."""
    weights, scale = _fold_case(rows, k, dtype, device, seed, specials)
    out = torch.full((sum(rows), k), 7.0, dtype=dtype, device=device)
    dl.fold_norm_weights(out, scale, weights)
    want = torch.cat([fold_norm_weight(w, scale) for w in weights])
    assert _same_values(out, want)


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows", "k"),
    [((3,), 5), ((16, 0, 17), 256), ((2048 // 64, 512 // 64, 512 // 64), 300), ((1, 2, 3, 40), 513)],
)
def test_fold_kernel_is_each_weight_folded_into_its_rows(device, rows, k) -> None:
    """The Triton launch itself (under the interpreter on CPU too), with row ranges that straddle its 16-row tiles
    and a width that is not a multiple of its 256 columns. The interpreter converts fp32 -> bf16 by truncation, so
    bf16 is checked on CUDA only."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        weights, scale = _fold_case(rows, k, dtype, device, 3, specials=True)
        out = torch.full((sum(rows), k), 7.0, dtype=dtype, device=device)
        dl._fold_norm_weights_triton(out, scale, weights)
        assert _same_values(out, torch.cat([fold_norm_weight(w, scale) for w in weights])), dtype


@pytest.mark.parametrize("device", _FOLD_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=12, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.lists(st.integers(0, 37), min_size=1, max_size=5), st.integers(1, 300)),
        min_size=0,
        max_size=4,
    ),
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
)
def test_fold_norm_weights_all_is_each_jobs_own_fold(device, dtype, jobs, seed, specials) -> None:
    """Every job of one call (one launch on CUDA where each would take the one-launch path: up to four weights a
    job; a job of five sends every job through ``fold_norm_weights``): the bits ``fold_norm_weights`` writes for
    that job alone, empty jobs and rows included."""
    cases, outs = [], []
    for i, (rows, k) in enumerate(jobs):
        weights, scale = _fold_case(rows, k, dtype, device, seed + i, specials)
        cases.append((torch.full((sum(rows), k), 7.0, dtype=dtype, device=device), scale, weights))
        outs.append(torch.full((sum(rows), k), 7.0, dtype=dtype, device=device))
    dl.fold_norm_weights_all(cases)
    for (got, scale, weights), want in zip(cases, outs, strict=True):
        dl.fold_norm_weights(want, scale, weights)
        assert _same_values(got, want)


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aligned", [True, False])
def test_fold_pieces_kernel_is_each_weight_folded_into_its_rows(device, aligned) -> None:
    """The one launch of ``fold_norm_weights_all`` itself (under the interpreter on CPU too): stacks of several
    widths and dtypes of scale, row ranges that straddle its 16-row tiles, widths that are not multiples of its
    column block; ``aligned``: every address 16-byte aligned and every width a multiple of 16 (the vector loads'
    case), else one stack of an odd width. The interpreter converts fp32 -> bf16 by truncation, so bf16 is checked
    on CUDA only."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    shapes = [((16, 0, 17), 256), ((32, 8, 8), 512), ((1, 2, 3, 40), 528)]
    if not aligned:
        shapes.append(((3, 5), 301))
    for dtype in dtypes:
        jobs, wants = [], []
        for i, (rows, k) in enumerate(shapes):
            weights, scale = _fold_case(rows, k, dtype, device, 3 + i, specials=True)
            jobs.append((torch.full((sum(rows), k), 7.0, dtype=dtype, device=device), scale, weights))
            wants.append(torch.cat([fold_norm_weight(w, scale) for w in weights]))
        dl._fold_pieces_triton(jobs)
        for (out, _, _), want in zip(jobs, wants, strict=True):
            assert _same_values(out, want), (dtype, tuple(out.shape))


def test_fold_norm_weights_all_names_the_bad_job() -> None:
    w = torch.ones(2, 3)
    good = (torch.empty(2, 3), torch.ones(3), [w])
    with pytest.raises(ValueError, match=r"jobs\[1\]: scale must be \[3\]"):
        dl.fold_norm_weights_all([good, (torch.empty(4, 3), torch.ones(4), [w, w])])
    dl.fold_norm_weights_all([])


def test_fold_norm_weights_names_bad_shapes() -> None:
    w = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"out must be \[sum N_i, K\] = \[4, K\]"):
        dl.fold_norm_weights(torch.empty(5, 3), torch.ones(3), [w, w])
    with pytest.raises(ValueError, match=r"scale must be \[3\]"):
        dl.fold_norm_weights(torch.empty(4, 3), torch.ones(4), [w, w])
