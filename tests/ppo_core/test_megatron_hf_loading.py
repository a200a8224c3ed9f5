"""Hugging Face Llama/Qwen2 <-> megatron state dicts: exact round trips over TP/PP shards, and a tiny random
safetensors checkpoint loaded into a CPU megatron model gives the logits of a plain-torch Llama forward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")

from _megatron import random_hf_state as _random_hf
from _megatron import tiny_config

from ppo_core.workers.megatron import MegatronModelConfig, ParallelConfig
from ppo_core.workers.megatron.hf_loading import hf_to_megatron, megatron_to_hf


@settings(max_examples=25)
@given(
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    qkv_bias=st.booleans(),
    tied=st.booleans(),
    norm=st.sampled_from(["RMSNorm", "LayerNorm"]),
    groups=st.sampled_from([2, 4]),
    seed=st.integers(0, 1000),
)
def test_shards_round_trip_exactly(tp, pp, qkv_bias, tied, norm, groups, seed):
    cfg = tiny_config(qkv_bias=qkv_bias, tie_word_embeddings=tied, norm=norm, num_query_groups=groups)
    hf = _random_hf(cfg, seed)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [
            hf_to_megatron(hf, cfg, tp_rank=t, tp_size=tp, pp_rank=stage, pp_size=pp) for t in range(tp)
        ]
        for s in shards:
            for name, t in s.items():
                if "word_embeddings" in name or "output_layer" in name:
                    assert t.shape[0] * tp % (cfg.make_vocab_size_divisible_by * tp) == 0  # padded vocabulary
        back |= megatron_to_hf(shards, cfg, pp_rank=stage, pp_size=pp)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_qkv_fusion_puts_each_group_query_heads_before_its_key_and_value():
    cfg = tiny_config(
        num_attention_heads=4, num_query_groups=2, hidden_size=8, ffn_hidden_size=8, num_layers=1
    )
    hf = _random_hf(cfg, 0)
    d = cfg.head_dim  # 2
    a = "model.layers.0.self_attn."
    qkv = hf_to_megatron(hf, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]
    # group 0: query heads 0 and 1, key head 0, value head 0; then group 1
    expected = torch.cat([q[: 2 * d], k[:d], v[:d], q[2 * d :], k[d:], v[d:]])
    assert torch.equal(qkv, expected)


def test_missing_or_misshapen_tensors_are_named():
    cfg = tiny_config()
    hf = _random_hf(cfg, 0)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_megatron(hf, cfg)
    hf = _random_hf(cfg, 0)
    hf["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\)"):
        hf_to_megatron(hf, cfg)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of ``x [B, S, H, d]`` with the Hugging Face (non-interleaved) convention."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[None, :, None], torch.cat([ang, ang], -1).sin()[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_llama(
    hf: dict[str, torch.Tensor], cfg: MegatronModelConfig, ids: torch.Tensor
) -> torch.Tensor:
    """Plain float64 Llama/Qwen2 forward: the oracle for the loaded megatron model."""
    w = {k: t.double() for k, t in hf.items()}
    b, s = ids.shape
    h, g, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        y = _rms(x, w[p + "input_layernorm.weight"], cfg.norm_epsilon)

        def proj(name: str, heads: int, y: torch.Tensor = y, p: str = p) -> torch.Tensor:
            out = y @ w[p + f"self_attn.{name}.weight"].T
            if cfg.qkv_bias:
                out = out + w[p + f"self_attn.{name}.bias"]
            return out.view(b, s, heads, d)

        q, k, v = (
            _rotate(proj("q_proj", h), cfg.rotary_base),
            _rotate(proj("k_proj", g), cfg.rotary_base),
            proj("v_proj", g),
        )
        k, v = k.repeat_interleave(h // g, dim=2), v.repeat_interleave(h // g, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.norm_epsilon)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], cfg.norm_epsilon)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])
def test_safetensors_checkpoint_gives_reference_logits(cpu_megatron, tmp_path, family):
    safetensors = pytest.importorskip("safetensors.torch")
    from ppo_core.workers.megatron import build_gpt_model, load_hf_checkpoint
    from ppo_core.workers.megatron.workers import position_ids

    cfg = tiny_config(qkv_bias=family != "llama", tie_word_embeddings=family != "llama", rotary_base=1e4)
    hf = _random_hf(cfg, 3)
    names = sorted(hf)
    # two shards, as large checkpoints come
    safetensors.save_file({k: hf[k] for k in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors.save_file({k: hf[k] for k in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, str(tmp_path), cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, position_ids(torch.ones_like(ids)), None)[..., : cfg.vocab_size]
    ref = _reference_llama(hf, cfg, ids)
    rel = (ours.double() - ref).norm() / ref.norm()
    assert rel < 1e-5, float(rel)
    # the padded vocabulary rows were zero-filled: their logits are exactly 0
    assert bool((model(ids, position_ids(torch.ones_like(ids)), None)[..., cfg.vocab_size :] == 0).all())


def test_loading_rejects_an_incomplete_checkpoint(cpu_megatron, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    from ppo_core.workers.megatron import build_gpt_model, load_hf_checkpoint

    cfg = tiny_config()
    model = build_gpt_model(cfg, ParallelConfig())
    with pytest.raises(ValueError, match="holds no"):
        load_hf_checkpoint(model, str(tmp_path), cfg)
    hf = _random_hf(cfg, 0)
    del hf["lm_head.weight"]
    safetensors.save_file(hf, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_hf_checkpoint(model, str(tmp_path), cfg)


# ----- a checkpoint as transformers saves it: SmolLM2's family (Llama, tied embeddings, 3 query heads per group) --
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
"""SmolLM2-135M-Instruct's config.json (as its GGUF file converts)."""


def test_smollm2_shape_maps_to_megatron():
    transformers = pytest.importorskip("transformers")
    from ppo_core.workers.megatron.hf_config import model_config_from_hf

    cfg = model_config_from_hf(transformers.LlamaConfig(**SMOLLM2_135M), dtype="bfloat16")
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size) == (30, 576, 1536, 49152)
    assert (cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and not cfg.qkv_bias and cfg.rotary_base == 100000.0
    assert cfg.norm == "RMSNorm" and cfg.norm_epsilon == pytest.approx(1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_a_saved_transformers_llama_gives_its_own_logits(cpu_megatron, tmp_path, tied):
    """What ``save_pretrained`` writes (a tied model: no ``lm_head.weight``) loads into the megatron model, which
    then gives the ``transformers`` model's logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from ppo_core.workers.megatron import build_gpt_model, load_hf_checkpoint
    from ppo_core.workers.megatron.hf_config import model_config_from_hf
    from ppo_core.workers.megatron.workers import position_ids

    shape = {
        **SMOLLM2_135M,
        "vocab_size": 70,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 32,
        "tie_word_embeddings": tied,
    }
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.1) + (p.ndim == 1))
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in set(f.keys())) == (not tied)
    cfg = model_config_from_hf(
        transformers.AutoConfig.from_pretrained(tmp_path), dtype="float32", make_vocab_size_divisible_by=8
    )
    assert cfg.tie_word_embeddings == tied
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    load_hf_checkpoint(model, str(tmp_path), cfg)
    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, position_ids(torch.ones_like(ids)), None)[..., :70]
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
