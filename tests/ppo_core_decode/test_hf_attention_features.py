"""What the ``hf`` engine's cached attention computes besides plain causal attention, and what it refuses.

Sliding windows (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, Gemma 2's sliding layers) are computed
by the cache (:meth:`KVCache.attend`'s ``window``): an engine's tokens and log-probs equal the model's own once the
sequence is longer than the window. Soft-capped scores (Gemma 2's ``attn_logit_softcapping``) and attention sinks
are not: ``auto`` picks the reference engine for such a model, the ``hf`` engine refuses it by name, and an attention
call carrying them is refused rather than computed without them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ppo_core.rollout import SamplingConfig, auto_engine_name, generate
from ppo_core_decode.kv_cache import KVCache

transformers = pytest.importorskip("transformers")

VOCAB = 48
WINDOW = 3


def _common(**extra) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**_common(sliding_window=WINDOW)))
    elif kind == "qwen2":  # every layer sliding
        cfg = transformers.Qwen2Config(
            **_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "gemma2":  # sliding and full layers alternating; no soft-capping (refused: below)
        cfg = transformers.Gemma2Config(
            **_common(
                sliding_window=WINDOW, head_dim=8, attn_logit_softcapping=None, final_logit_softcapping=None
            )
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma2_softcap":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_common(head_dim=8)))
    else:
        raise ValueError(kind)
    return model.eval()


def _left_padded(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    return torch.randint(1, VOCAB, mask.shape, generator=g) * mask, mask


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sliding_windows_sample_what_the_model_samples(kind, temperature):
    """Prompts of up to 6 tokens and 8 new ones against a window of 3: the hf engine (its generic path) draws the
    reference loop's tokens (the model's own forward) from the same generator, with its log-probs."""
    model = _model(kind)
    ids, mask = _left_padded(seed=1)
    assert auto_engine_name(model) == "hf"
    config = dict(max_new_tokens=8, temperature=temperature)
    out = {}
    for engine in ("hf", "reference"):
        g = torch.Generator().manual_seed(7)
        out[engine] = generate(model, ids, mask, SamplingConfig(engine=engine, **config), generator=g)
    assert torch.equal(out["hf"]["responses"], out["reference"]["responses"])
    torch.testing.assert_close(out["hf"]["rollout_log_probs"], out["reference"]["rollout_log_probs"])


def test_without_the_window_the_engine_would_sample_otherwise():
    """The test above can fail: the same model with its window removed from the cached attention (every slot
    attended) samples other tokens."""
    from ppo_core_decode import hf

    model = _model("mistral")
    ids, mask = _left_padded(seed=1)
    windowed = generate(model, ids, mask, SamplingConfig(engine="hf", max_new_tokens=8, temperature=0.0))
    attend = KVCache.attend

    def no_window(self, *args, window=None, **kwargs):
        return attend(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCache, "attend", no_window)
        hf_engine = hf.HFRolloutEngine(model)  # a fresh engine: generate() keeps the one it built
        full = hf_engine.generate(
            ids, mask, SamplingConfig(max_new_tokens=8, temperature=0.0), generator=None
        )
    assert not torch.equal(windowed["responses"], full["responses"])


def _naive_attention(q, keys, values, allowed, scale):
    """``q [B, H, S, d]`` over ``keys``/``values [B, G, L, d]`` where ``allowed [B, S, L]``, in float64."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).double()
    v = values.repeat_interleave(rep, dim=1).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),  # rows
    st.integers(1, 6),  # prompt width
    st.integers(1, 8),  # window
    st.integers(0, 2**31 - 1),
)
def test_the_cache_attends_within_the_window_in_prefill_and_decode(b, p, window, seed):
    """Query slot ``i`` sees the valid slots ``j <= i`` with ``i - j < window``: a prefill (left padding, every
    query) and three decode steps against attention over exactly those slots."""
    g = torch.Generator().manual_seed(seed)
    h, groups, d, steps = 4, 2, 8, 3
    length = p + steps
    cache = KVCache.allocate(
        layers=1, batch=b, kv_heads=groups, head_dim=d, length=length, dtype=torch.float64, device="cpu"
    )
    pad = torch.randint(0, p, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None] >= pad[:, None]).long()
    cache.begin_prefill(prompt_mask)
    q = torch.randn(b, h, p, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, groups, p, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, groups, p, d, generator=g, dtype=torch.float64)
    out = cache.attend(0, q, k, v, window=window)
    i = torch.arange(p)
    near = (i[:, None] - i[None, :] < window) & (i[None, :] <= i[:, None])
    allowed = (near[None] & prompt_mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool)[None]
    torch.testing.assert_close(out, _naive_attention(q, k, v, allowed, d**-0.5))
    valid = torch.cat([prompt_mask.bool(), torch.zeros(b, steps, dtype=torch.bool)], 1)
    for t in range(steps):
        slot = p + t
        fed = torch.rand(b, generator=g) > 0.2  # a row may have finished: its token is not attended
        cache.begin_decode(torch.tensor(slot), kv_len=length, fed_valid=fed)
        valid[:, slot] = fed
        q = torch.randn(b, h, 1, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, groups, 1, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, groups, 1, d, generator=g, dtype=torch.float64)
        out = cache.attend(0, q, k, v, window=window)
        j = torch.arange(length)
        allowed = valid & (slot - j < window) & (j <= slot)
        allowed[:, slot] = True  # a finished row sees its own slot (finite; its output is never used)
        expected = _naive_attention(q, cache.keys[0], cache.values[0], allowed[:, None, :], d**-0.5)
        rows = fed  # the running rows: what they attend to is exactly the window's valid slots
        torch.testing.assert_close(out[rows], expected[rows])
        assert torch.isfinite(out).all()


def test_a_window_no_query_reaches_past_changes_nothing():
    """A window shorter than the cache (8 slots) but longer than any distance in the forward (a 4-token prefill):
    the windowed path (its own mask) gives the unwindowed attention; a window as long as the cache is not applied."""
    outs = []
    for window in (None, 4, 100):
        cache = KVCache.allocate(
            layers=1, batch=2, kv_heads=1, head_dim=4, length=8, dtype=torch.float64, device="cpu"
        )
        cache.begin_prefill(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
        q, k, v = (
            torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in (1, 2, 3)
        )
        outs.append(cache.attend(0, q, k, v, window=window))
    torch.testing.assert_close(outs[1], outs[0])
    assert torch.equal(outs[2], outs[0])


def test_soft_capped_attention_goes_to_the_reference_engine():
    """Gemma 2's default soft-capping: ``auto`` picks the reference loop, which samples what ``transformers``
    samples; the hf engine, named, refuses the model naming the setting."""
    from ppo_core_decode.hf import HFRolloutEngine, unsupported_attention

    model = _model("gemma2_softcap")
    assert "attn_logit_softcapping=50.0" in unsupported_attention(model)
    assert auto_engine_name(model) == "reference"
    with pytest.raises(
        ValueError, match=r"cannot sample Gemma2ForCausalLM exactly: .*attn_logit_softcapping"
    ):
        HFRolloutEngine(model)
    ids, mask = _left_padded(seed=2)
    out = generate(model, ids, mask, SamplingConfig(max_new_tokens=5, temperature=0.0))
    truth = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None
    )[:, ids.shape[1] :]
    assert torch.equal(out["responses"], truth)


def test_attention_sinks_are_named():
    from ppo_core_decode.hf import unsupported_attention

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_idx = 0
            self.sinks = nn.Parameter(torch.zeros(4))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = transformers.LlamaConfig(**_common())
            self.attn = Attention()

    assert "attention sinks" in unsupported_attention(Model())
    model = Model()
    model.attn.sinks = None
    assert unsupported_attention(model) is None


@pytest.mark.parametrize(("argument", "meaning"), [("softcap", "soft-capped"), ("s_aux", "attention sinks")])
def test_an_attention_call_with_what_the_cache_does_not_compute_is_refused(argument, meaning):
    """A model the check above does not know still cannot be sampled without its soft-capping or sinks: the
    attention call carrying them stops with the layer and what to use instead."""
    from ppo_core_decode.hf import _cached_attention

    module = nn.Module()
    module.layer_idx = 3
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(
        ValueError, match=rf"layer 3\) calls its attention with {argument} \({meaning}.*reference"
    ):
        _cached_attention(module, q, q, q, None, **{argument: torch.ones(2) if argument == "s_aux" else 30.0})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_windows_on_cuda_in_graphs_sample_what_the_model_samples(kind):
    """On CUDA the generic path's decode steps are CUDA graphs around the Triton decode attention: the window's
    mask is made inside each captured step from the step's device slot. Greedy tokens equal the model's own
    (``transformers.generate``) in float32, over more steps than the window and past a cache bucket."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(kind).cuda()
    ids, mask = (t.cuda() for t in _left_padded(seed=3))
    engine = HFRolloutEngine(model, kv_bucket=8)
    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=12, temperature=0.0), generator=None)
    assert engine.stats.cuda_graphs
    truth = model.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )[:, ids.shape[1] :]
    assert torch.equal(out["responses"], truth)
