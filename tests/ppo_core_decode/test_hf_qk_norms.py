"""Qwen3's query and key norms in one kernel: :func:`ppo_core_decode.hf._adjacent_heads` views ``q`` and ``k`` as one
tensor exactly where they are adjacent heads of the fused q/k/v product, and the engine's cached decoding stays the
model's own (its ``q_norm``/``k_norm`` modules through the cache), bit for bit on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode.decoder_loop import split_qkv
from ppo_core_decode.hf import _adjacent_heads


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    s=st.integers(1, 4),
    h=st.integers(1, 4),
    g=st.integers(1, 2),
    d=st.sampled_from([1, 4, 8]),
)
def test_split_qkv_views_are_one_view_of_both(b, s, h, g, d) -> None:
    qkv = torch.randn(b, s, (h + 2 * g) * d)
    q, k, _ = split_qkv(qkv, h, g, d)
    both = _adjacent_heads(q, k)
    assert both is not None
    assert torch.equal(both, torch.cat([q, k], dim=2))
    assert both.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # a view, no copy
    # the same with the decode step's view of a [B, W] product
    q1, k1, _ = split_qkv(qkv[:, 0][:, None], h, g, d)
    assert torch.equal(_adjacent_heads(q1, k1), torch.cat([q1, k1], dim=2))


def test_tensors_that_are_not_adjacent_heads_are_refused() -> None:
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 8)
    q, k, v = split_qkv(qkv, 4, 2, 8)
    assert _adjacent_heads(q, v) is None  # v does not follow q
    assert _adjacent_heads(k, q) is None  # the wrong order
    assert _adjacent_heads(q.clone(), k.clone()) is None  # separate memory
    assert _adjacent_heads(q, k.contiguous().clone()) is None
    assert _adjacent_heads(q.float().double(), k) is None  # another dtype
    padded = torch.randn(2, 3, 4 + 2, 9)[..., :8]  # heads 9 apart: not [d]-strided
    assert _adjacent_heads(padded[:, :, :4], padded[:, :, 4:]) is None
    assert _adjacent_heads(q[:, :2], k[:, 1:]) is None  # other rows
    assert _adjacent_heads(q.flatten(2), k.flatten(2)) is None  # not [B, S, heads, d]


def _qwen3(transformers, *, vocab: int, width: int, kv_heads: int, head_dim: int):
    """A 2-layer Qwen3 of four query heads (seed 0, eval mode, fp32) whose q/k norm weights are unlike ones and
    unlike each other (the keys' with signs)."""
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 3 // 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(-1.5, 1.5)
    return model


def test_qwen3_engine_with_one_norm_kernel_is_the_models_modules() -> None:
    """Fused path (q/k norms in one call over the q/k/v product) against the model's own modules through the
    cache (the generic path): in bf16, where the fused path keeps the model's roundings, the same tokens and
    log-probs, bit for bit, with q/k norm weights unlike ones, one key head and a padded prompt."""
    dtype = torch.bfloat16
    transformers = pytest.importorskip("transformers")
    from ppo_core.rollout import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine

    # G = 1: the keys' heads dim has size 1
    model = _qwen3(transformers, vocab=64, width=32, kv_heads=1, head_dim=8).to(dtype)
    prompts = torch.randint(1, 64, (5, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0)
    outs = [
        HFRolloutEngine(model, fast_path=fast).generate(
            prompts * mask, mask, cfg, generator=torch.Generator().manual_seed(2)
        )
        for fast in (False, True)
    ]
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    assert torch.equal(outs[0]["rollout_log_probs"], outs[1]["rollout_log_probs"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen3_rollouts_take_the_norms_into_the_rotation_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a Qwen3 prefill passes its q/k norms to its rotation launch and a decode step to the one-launch
    attention (a launch a layer less each), and the rollout draws what it draws with the norms before those
    launches (greedy), log-probs within bf16 noise."""
    transformers = pytest.importorskip("transformers")
    from ppo_core.rollout import SamplingConfig
    from ppo_core_decode.hf import HFRolloutEngine, _LlamaFamilyForward

    model = _qwen3(transformers, vocab=128, width=64, kv_heads=2, head_dim=16).to("cuda", torch.bfloat16)
    prompts = torch.randint(1, 128, (6, 9), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(prompts)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    chosen = []
    in_kernel = _LlamaFamilyForward._qk_norm_in_kernel

    def recording(self, *args):
        out = in_kernel(self, *args)
        chosen.append(out is not None)
        return out

    monkeypatch.setattr(_LlamaFamilyForward, "_qk_norm_in_kernel", recording)
    fused = HFRolloutEngine(model, cuda_graphs=False).generate(prompts, mask, greedy)
    assert chosen and all(chosen)  # the prefill's layers and the decode steps
    monkeypatch.setattr(_LlamaFamilyForward, "_qk_norm_in_kernel", lambda self, *args: None)
    before = HFRolloutEngine(model, cuda_graphs=False).generate(prompts, mask, greedy)
    assert torch.equal(fused["responses"], before["responses"])
    torch.testing.assert_close(fused["rollout_log_probs"], before["rollout_log_probs"], atol=2e-2, rtol=0)
