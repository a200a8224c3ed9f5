"""The megatron rollout engine's own forward (:class:`~ppo_core_decode.megatron.MegatronDecodeForward`)
against megatron's ``GPTModel.forward`` through the same cache (the oracle): on the CPU both run eagerly with the
same roundings, so greedy and sampled tokens are equal, and their log-probs equal bit for bit in bf16, for every
model shape it supports (grouped, multi-head and single-group attention, a q/k/v bias, tied embeddings); in fp32
within 1e-6, because the own forward's prefill runs its last layer's output projection and MLP for the last position
only (GEMMs of ``B`` rows rather than ``B P``, whose fp32 sums the CPU's GEMM may block differently); both equal a
full forward of the model. Unsupported models and batch-invariant decoding keep megatron's forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron import random_hf_state, tiny_config

from ppo_core.rollout import SamplingConfig
from ppo_core.workers.megatron import ParallelConfig
from ppo_core.workers.megatron.engine import megatron_attention_mask, position_ids
from ppo_core.workers.megatron.hf_loading import hf_to_megatron
from ppo_core.workers.megatron.model import build_gpt_model
from ppo_core.workers.megatron.rollout import MegatronRolloutEngine
from ppo_core_decode.megatron import MegatronDecodeForward, qkv_row_order

SHAPES = {
    "gqa": {},  # 4 query heads in 2 groups: the q/k/v rows are re-laid out
    "mha": {"num_query_groups": 4},
    "one_group": {"num_query_groups": 1},  # megatron's rows already are [q; k; v]: no copy
    "qkv_bias": {"qkv_bias": True},
    "tied": {"tie_word_embeddings": True},
}


def _model(seed: int = 3, **kw):
    cfg = tiny_config(**kw)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    model.load_state_dict(hf_to_megatron(random_hf_state(cfg, seed), cfg, tp_rank=0, tp_size=1), strict=False)
    return cfg, model


def _prompts(batch: int = 5, width: int = 6, seed: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 1..width tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return torch.randint(1, 70, (batch, width), generator=g) * mask, mask


def _assert_same(own: torch.Tensor, ref: torch.Tensor, model_dtype: torch.dtype) -> None:
    """Equal bit for bit for a half-precision model; for an fp32 one within the reblocking of the last layer's sums
    (module docstring)."""
    if model_dtype == torch.float32:
        torch.testing.assert_close(own, ref, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(own, ref)


def _generate(engine, ids, mask, temperature: float):
    config = SamplingConfig(max_new_tokens=8, temperature=temperature, top_k=20 if temperature else 0)
    generator = torch.Generator().manual_seed(5) if temperature else None
    return engine.generate(ids, mask, config, generator=generator)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_own_forward_draws_what_megatrons_forward_draws(cpu_megatron, dtype, shape):
    cfg, model = _model(dtype=dtype, **SHAPES[shape])
    ids, mask = _prompts()
    engines = [MegatronRolloutEngine(model, cfg, own_forward=own) for own in (False, True)]
    assert [e.own_forward for e in engines] == [False, True]
    for temperature in (0.0, 1.0):
        ref, own = (_generate(e, ids, mask, temperature) for e in engines)
        assert torch.equal(own["responses"], ref["responses"])
        # the same kernels' arithmetic on the CPU (but for the last layer's row count)
        _assert_same(own["rollout_log_probs"], ref["rollout_log_probs"], cfg.torch_dtype)
    # prefill of whole sequences (prompt + response): the logits after each
    ref_logits, own_logits = (e.recompute_logits(ref["input_ids"], ref["attention_mask"]) for e in engines)
    assert own_logits.dtype == cfg.torch_dtype and own_logits.shape == (ids.shape[0], cfg.vocab_size)
    _assert_same(own_logits, ref_logits, cfg.torch_dtype)


def test_own_forward_equals_a_full_forward_of_the_model(cpu_megatron):
    """fp32: the cached decoding's tokens are the greedy ones of megatron's full forward (no cache) and its
    log-probs those of that forward, within 1e-5; recompute_logits is that forward's last position."""
    cfg, model = _model()
    ids, mask = _prompts()
    engine = MegatronRolloutEngine(model, cfg)
    assert engine.own_forward
    out = _generate(engine, ids, mask, 0.0)
    with torch.no_grad():
        full = model(
            out["input_ids"],
            position_ids(out["attention_mask"]),
            megatron_attention_mask(out["attention_mask"]),
        )
    full = full[..., : cfg.vocab_size].float()
    predicted = full[:, ids.shape[1] - 1 : -1]  # [B, R, V] the logits that drew each response token
    assert torch.equal(out["responses"], predicted.argmax(-1))
    expected = predicted.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"], expected, rtol=1e-5, atol=1e-5)
    last = engine.recompute_logits(out["input_ids"], out["attention_mask"]).float()
    torch.testing.assert_close(last, full[:, -1], rtol=1e-5, atol=1e-5)
    assert all(layer.kv_cache is None for layer in engine.attention)


def test_qkv_rows_are_laid_out_as_q_k_v(cpu_megatron):
    """megatron's interleaved linear_qkv weight, re-laid out, is the Hugging Face q, k and v weights stacked; a
    layer's layout is made at its first use after ``refresh``, not by it (the host makes it while the device runs
    the layers before)."""
    cfg = tiny_config(qkv_bias=True)
    hf = random_hf_state(cfg, 1)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    model.load_state_dict(hf_to_megatron(hf, cfg, tp_rank=0, tp_size=1), strict=False)
    forward = MegatronDecodeForward(model, cfg)
    with pytest.raises(RuntimeError, match="refresh"):
        forward._layer_qkv(0)
    forward.refresh()
    assert forward._qkv == [None] * len(forward.layers) and all(forward._stale)
    for i in range(len(forward.layers)):
        weight, bias = forward._layer_qkv(i)
        assert not forward._stale[i] and forward._stale[i + 1 :] == [True] * (len(forward.layers) - i - 1)
        names = [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        torch.testing.assert_close(weight, torch.cat([hf[n + ".weight"] for n in names]), rtol=0, atol=0)
        torch.testing.assert_close(bias, torch.cat([hf[n + ".bias"] for n in names]), rtol=0, atol=0)
    assert qkv_row_order(4, 2, 1, torch.device("cpu")).tolist() == [0, 1, 4, 5, 2, 6, 3, 7]


def test_each_generation_reads_the_current_weights_at_fixed_addresses(cpu_megatron):
    """With keep_cache the re-laid out q/k/v weights are rewritten in place at every generation (a kept CUDA graph
    reads those addresses), from the weights as training left them."""
    cfg, model = _model()
    ids, mask = _prompts()
    engine = MegatronRolloutEngine(model, cfg, keep_cache=True)
    _generate(engine, ids, mask, 0.0)
    addresses = [w.data_ptr() for w, _ in engine._own._qkv]
    with torch.no_grad():  # a training step
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    own = _generate(engine, ids, mask, 0.0)
    assert [w.data_ptr() for w, _ in engine._own._qkv] == addresses
    ref = _generate(MegatronRolloutEngine(model, cfg, own_forward=False), ids, mask, 0.0)
    assert torch.equal(own["responses"], ref["responses"])
    _assert_same(own["rollout_log_probs"], ref["rollout_log_probs"], cfg.torch_dtype)
    engine.release()
    assert engine._own._qkv is None


def test_megatrons_forward_where_the_own_forward_does_not_apply(cpu_megatron):
    cfg, model = _model(norm="LayerNorm")
    assert not MegatronRolloutEngine(model, cfg).own_forward
    with pytest.raises(ValueError, match=r"model\.norm='LayerNorm'"):
        MegatronRolloutEngine(model, cfg, own_forward=True)
    cfg, model = _model()
    assert not MegatronRolloutEngine(model, cfg, batch_invariant=True).own_forward
    with pytest.raises(ValueError, match="batch_invariant=False"):
        MegatronRolloutEngine(model, cfg, batch_invariant=True, own_forward=True)
    assert not MegatronRolloutEngine(model, cfg, own_forward=False).own_forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_forward_on_cuda_graphs_draws_what_megatrons_forward_draws(dtype):
    """On CUDA (graphs, the fused rotation + cache write, compiled element-wise kernels) both paths round alike but
    are not the same kernels: fp32 tokens equal and log-probs within 1e-4; bf16 log-probs of the same tokens close."""
    from ppo_core.workers.megatron import destroy_megatron_parallel, init_megatron_parallel

    init_megatron_parallel(ParallelConfig(), rank=0, world_size=1, device=torch.device("cuda", 0))
    try:
        # head width 32: the Triton rotation + cache write runs in decode steps
        shape = dict(hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=512)
        cfg, model = _model(dtype=dtype, max_position_embeddings=64, **shape)
        ids, mask = (t.cuda() for t in _prompts(batch=8, width=6))
        config = SamplingConfig(max_new_tokens=16, temperature=0.0)
        ref, own = (
            MegatronRolloutEngine(model, cfg, own_forward=o).generate(ids, mask, config)
            for o in (False, True)
        )
        if dtype == "float32":
            assert torch.equal(own["responses"], ref["responses"])
            torch.testing.assert_close(
                own["rollout_log_probs"], ref["rollout_log_probs"], rtol=1e-4, atol=1e-4
            )
        else:
            same = (own["responses"] == ref["responses"]).all(-1)
            assert same.float().mean() >= 0.5, same
            torch.testing.assert_close(
                own["rollout_log_probs"][same], ref["rollout_log_probs"][same], rtol=0.05, atol=0.05
            )
    finally:
        destroy_megatron_parallel()


def test_own_forward_normalises_and_gates_through_the_launches_where_they_apply(cpu_megatron, monkeypatch):
    """With :func:`~ppo_core_decode.elementwise_launch.launches_directly` forced true (on the CPU the launches run
    their PyTorch form), the own forward's norms and SwiGLU go through the launches in megatron's roundings (the
    norm's one rounding; SwiGLU's as ``bias_activation_fusion`` says), and its logits stay megatron's forward's."""
    import ppo_core_decode.elementwise_launch as el

    calls = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, kwargs.get("model_rounding")))
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(el, "launches_directly", lambda x: True)
    monkeypatch.setattr(el, "rms_norm_launch", counted("norm", el.rms_norm_launch))
    monkeypatch.setattr(el, "silu_mul_launch", counted("swiglu", el.silu_mul_launch))
    cfg, model = _model()
    ids, mask = _prompts()
    engines = [MegatronRolloutEngine(model, cfg, own_forward=own) for own in (False, True)]
    ref, own = (e.recompute_logits(ids, mask) for e in engines)
    layers = len(engines[1].attention)
    rounded = not model.config.bias_activation_fusion
    assert calls.count(("norm", False)) >= 2 * layers
    assert calls.count(("swiglu", rounded)) == layers and len(calls) == calls.count(("norm", False)) + layers
    torch.testing.assert_close(own, ref, rtol=1e-5, atol=1e-5)
