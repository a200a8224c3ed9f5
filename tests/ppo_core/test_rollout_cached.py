"""KV-cached decoding (``ppo_core.rollout``) against full recomputation: tiny Hugging Face Llama / Qwen2 / Mistral
models built from configs and a tiny megatron GPT, fp32 on the CPU, where cached and recomputed greedy decoding
must give the same tokens and the rollout log-probs must equal one forward over the finished sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.rollout import SamplingConfig
from ppo_core.rollout.sampling import sample_tokens, top_k_filter, top_p_filter
from ppo_core_decode.decoding import ModelSpec, StaticCacheDecoder
from ppo_core_decode.kv_cache import KVCache, prefill_attention_mask

transformers = pytest.importorskip("transformers")

VOCAB = 61


def _hf(kind: str, seed: int = 0) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "llama3_rope":
        cfg = transformers.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        return transformers.LlamaForCausalLM(cfg).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=None)
        ).eval()
    if kind == "qwen3":  # per-head q/k norms, with weights other than ones (and unlike each other)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(-1.5, 1.5)
        return model
    raise ValueError(kind)


def _left_padded(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, width), generator=g) * mask
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits.float()


@torch.no_grad()
def _recompute_greedy(
    logits_fn, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: int | None
) -> torch.Tensor:
    """Greedy decoding by recomputing the whole sequence for every token (the oracle)."""
    tokens, done = [], torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(new):
        tok = logits_fn(ids, mask)[:, -1].argmax(-1)
        tok = torch.where(done, 0, tok)
        tokens.append(tok)
        ids = torch.cat([ids, tok[:, None]], 1)
        mask = torch.cat([mask, (~done).long()[:, None]], 1)
        if eos is not None:
            done = done | (tok == eos)
    return torch.stack(tokens, 1)


# ----- sampling ------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(2, 40))
def test_gumbel_draw_matches_the_softmax_distribution_in_expectation(seed, rows, vocab):
    """The empirical frequency of each token over many noise draws approaches softmax(logits / T)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    draws = 3000
    counts = torch.zeros(rows, vocab, dtype=torch.float64)
    for _ in range(draws // 100):
        noise = torch.rand(100, rows, vocab, generator=g, dtype=torch.float64)
        tok, _ = sample_tokens(
            logits.expand(100, rows, vocab).reshape(-1, vocab), noise.reshape(-1, vocab), temperature=0.7
        )
        counts += torch.nn.functional.one_hot(tok.view(100, rows), vocab).sum(0)
    expected = (logits / 0.7).softmax(-1)
    assert (counts / draws - expected).abs().max() < 0.05


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 10), st.floats(0.05, 1.0))
def test_truncated_draws_stay_in_the_nucleus_and_top_k(seed, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 12, generator=g)
    keep = top_p_filter(top_k_filter(logits, top_k), top_p) > float("-inf")
    for _ in range(5):
        tok, logp = sample_tokens(
            logits, torch.rand(8, 12, generator=g), temperature=1.0, top_k=top_k, top_p=top_p
        )
        assert keep.gather(1, tok[:, None]).all()
        # the log-prob is the untruncated one at the sampling temperature
        torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, tok[:, None]).squeeze(1))


def test_greedy_scores_at_temperature_one_and_needs_no_noise():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    tok, logp = sample_tokens(logits, None, temperature=0.0)
    assert tok.tolist() == [1, 2]
    torch.testing.assert_close(logp, logits.log_softmax(-1)[[0, 1], [1, 2]])


def test_sampling_without_noise_names_the_argument():
    with pytest.raises(ValueError, match="noise"):
        sample_tokens(torch.zeros(2, 3), None, temperature=1.0)
    with pytest.raises(ValueError, match="noise"):
        sample_tokens(torch.zeros(2, 3), torch.zeros(2, 4), temperature=1.0)


# ----- the cache ------------------------------------------------------------------------------------------------
def test_prefill_mask_is_causal_over_prompt_tokens_and_keeps_padding_finite():
    mask = prefill_attention_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))[:, 0]
    expected_full = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(mask[1], expected_full)
    assert mask[0].diagonal().all()  # every query sees itself
    assert not mask[0][:, :2].tril(-1).any()  # nobody sees a padding key except itself
    assert mask[0][3].tolist() == [False, False, True, True]


@pytest.mark.parametrize("layers", [1, 3])
def test_a_cache_is_zeroed_views_of_one_allocation_one_per_layer(layers):
    """``KVCache.allocate`` makes one zeroed allocation (one fill kernel on CUDA) and hands out a key and a value
    buffer per layer as views of it: each ``[B, G, L, d]``, disjoint, writes to one never seen in another.
    ``free_slots`` drops them and ``allocate_slots`` makes them again, zeroed, of the same shape (a cache of no layers
    stays empty)."""
    cache = KVCache.allocate(
        layers=layers, batch=2, kv_heads=3, head_dim=4, length=5, dtype=torch.bfloat16, device="cpu"
    )
    buffers = [*cache.keys, *cache.values]
    assert len(buffers) == 2 * layers and cache.nbytes == 2 * layers * 2 * 3 * 5 * 4 * 2
    base = buffers[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in buffers)
    assert all(t.shape == (2, 3, 5, 4) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in buffers)
    assert all(t.eq(0).all() for t in buffers) and not cache.key_valid.any()
    for i, t in enumerate(buffers):
        t.fill_(i + 1)
    assert [int(t.float().mean()) for t in buffers] == list(range(1, 2 * layers + 1))
    cache.key_valid[0, 1] = True
    cache.free_slots()  # between generations: the buffers go, what the slots hold and the shape stay
    assert cache.keys == [] and cache.values == [] and cache.nbytes == 0 and cache.key_valid[0, 1]
    cache.allocate_slots()
    again = [*cache.keys, *cache.values]
    assert len(again) == 2 * layers and all(t.shape == (2, 3, 5, 4) and t.eq(0).all() for t in again)
    assert all(t.dtype == torch.bfloat16 for t in again) and cache.nbytes == 2 * layers * 2 * 3 * 5 * 4 * 2
    none = KVCache.allocate(
        layers=0, batch=2, kv_heads=3, head_dim=4, length=5, dtype=torch.bfloat16, device="cpu"
    )
    none.free_slots()
    none.allocate_slots()
    assert none.keys == [] and none.values == [] and none.nbytes == 0


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    groups=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    p=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_unpadded_prefill_attends_as_the_masked_path(b, groups, p, seed):
    """Without padding the prefill runs SDPA causal with shared key/value heads (no mask, no repeat: CUDA's flash
    kernel); it computes what the padded path's mask and repeated heads give."""
    h, g = groups
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, p, 8, generator=gen, dtype=torch.float64) for n in (h, g, g))
    cache = KVCache.allocate(
        layers=1, batch=b, kv_heads=g, head_dim=8, length=p + 2, dtype=torch.float64, device="cpu"
    )
    cache.begin_prefill(torch.ones(b, p, dtype=torch.long))
    assert cache.prefill_mask is None
    got = cache.attend(0, q, k, v, scale=0.3)
    cache.prefill_mask = prefill_attention_mask(torch.ones(b, p))  # the padded path's mask
    want = cache.attend(0, q, k, v, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    padded = torch.ones(b, p, dtype=torch.long)
    padded[0, 0] = 0
    cache.begin_prefill(padded)
    assert cache.prefill_mask is not None


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    groups=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    p=st.integers(1, 9),
    padding=st.sampled_from(["none", "left", "invariant"]),
    seed=st.integers(0, 2**16),
)
def test_prefill_of_the_last_query_only_is_the_last_row_of_the_full_attention(b, groups, p, padding, seed):
    """``last_query_only`` (the prefill's last layer): every key and value is written as in the full prefill, and
    the output is the last query's row of the full attention (causal, left-padded and batch-invariant paths)."""
    h, g = groups
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, p, 8, generator=gen, dtype=torch.float64) for n in (h, g, g))
    mask = torch.ones(b, p, dtype=torch.long)
    if padding == "left":
        mask[:, : p - 1] = (torch.rand(b, p - 1, generator=gen) > 0.5).long().cummin(-1).values.flip(-1)
    results = []
    for last_only in (False, True):
        cache = KVCache.allocate(
            layers=1, batch=b, kv_heads=g, head_dim=8, length=p + 2, dtype=torch.float64, device="cpu"
        )
        cache.batch_invariant = padding == "invariant"
        cache.begin_prefill(mask)
        cache.last_query_only = last_only
        results.append((cache.attend(0, q, k, v, scale=0.3), cache.keys[0], cache.values[0]))
    (full, keys, values), (last, last_keys, last_values) = results
    assert last.shape == (b, h, 1, 8)
    torch.testing.assert_close(last, full[:, :, -1:], rtol=1e-12, atol=1e-12)
    assert torch.equal(last_keys, keys) and torch.equal(last_values, values)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), length=st.integers(1, 12), data=st.data())
def test_begin_decode_records_the_fed_token_and_masks_the_valid_slots(b, length, data):
    """``begin_decode(slot, kv_len, fed_valid)`` writes ``fed_valid`` into ``key_valid`` at ``slot`` (nothing else),
    and the step's mask is 0 on the valid slots below ``kv_len``, -inf elsewhere, in the cache's dtype."""
    slot = data.draw(st.integers(0, length - 1))
    kv_len = data.draw(st.integers(slot + 1, length))
    before = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * length, max_size=b * length))).view(
        b, length
    )
    fed = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    cache = KVCache.allocate(
        layers=1, batch=b, kv_heads=1, head_dim=2, length=length, dtype=torch.bfloat16, device="cpu"
    )
    cache.key_valid.copy_(before)
    cache.begin_decode(torch.tensor(slot), kv_len, fed_valid=fed)
    expected = before.clone()
    expected[:, slot] = fed
    assert torch.equal(cache.key_valid, expected)
    mask = cache._decode_mask
    assert mask.shape == (b, 1, 1, kv_len) and mask.dtype == torch.bfloat16
    assert torch.equal(mask[:, 0, 0] == 0, expected[:, :kv_len])
    assert torch.isneginf(mask[:, 0, 0][~expected[:, :kv_len]]).all()
    assert int(cache._filled) == slot + 1
    cache.begin_decode(torch.tensor(slot), kv_len)  # no fed token to record: key_valid unchanged
    assert torch.equal(cache.key_valid, expected)


def test_decode_attention_equals_attention_over_the_valid_prefix():
    """One decode step through the cache == plain softmax attention over the valid slots (grouped heads)."""
    g = torch.Generator().manual_seed(0)
    b, h, gq, d, length = 3, 4, 2, 8, 10
    cache = KVCache.allocate(
        layers=1, batch=b, kv_heads=gq, head_dim=d, length=length, dtype=torch.float64, device="cpu"
    )
    cache.keys[0].copy_(torch.randn(b, gq, length, d, generator=g, dtype=torch.float64))
    cache.values[0].copy_(torch.randn(b, gq, length, d, generator=g, dtype=torch.float64))
    cache.key_valid[:] = torch.rand(b, length, generator=g) > 0.3
    slot = 6
    cache.key_valid[:, slot] = True
    cache.key_valid[:, slot + 1 :] = False
    q = torch.randn(b, h, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, gq, 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, gq, 1, d, generator=g, dtype=torch.float64)
    cache.begin_decode(torch.tensor(slot), kv_len=8)
    out = cache.attend(0, q, k, v)
    for row in range(b):
        valid = cache.key_valid[row, :8]
        for head in range(h):
            keys = cache.keys[0][row, head // 2, :8][valid]
            values = cache.values[0][row, head // 2, :8][valid]
            weights = (keys @ q[row, head, 0] / d**0.5).softmax(0)
            torch.testing.assert_close(out[row, head, 0], weights @ values)
    assert torch.equal(cache.keys[0][:, :, slot], k[:, :, 0])


# ----- engines == recomputation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "mistral"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_hf_cached_greedy_equals_recomputation_with_left_padding(kind, fast_path):
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf(kind)
    ids, mask = _left_padded(4, 6, seed=1)
    engine = HFRolloutEngine(model, fast_path=fast_path)
    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=7, temperature=0.0))
    ref = _recompute_greedy(lambda i, m: _hf_logits(model, i, m), ids, mask, 7, None)
    assert torch.equal(out["responses"], ref)
    # rollout log-probs are what one forward over the finished sequences gives (temperature 1 when greedy)
    full = _hf_logits(model, out["input_ids"], out["attention_mask"])[:, ids.shape[1] - 1 : -1]
    expected = full.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-5, rtol=1e-5)
    assert engine.stats.decode_steps == 6 and not engine.stats.cuda_graphs


def test_hf_cached_eos_masks_and_pads_and_stops_when_every_row_is_done():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf("llama")
    ids, mask = _left_padded(5, 4, seed=2)
    ref = _recompute_greedy(lambda i, m: _hf_logits(model, i, m), ids, mask, 12, None)
    eos = int(ref[0, 1])  # a token row 0 emits second: at least one row finishes early
    engine = HFRolloutEngine(model, check_every=1)
    out = engine.generate(
        ids,
        mask,
        SamplingConfig(max_new_tokens=12, temperature=0.0, eos_token_id=eos, pad_token_id=VOCAB - 1),
    )
    expected = _recompute_greedy(lambda i, m: _hf_logits(model, i, m), ids, mask, 12, eos)
    resp, rmask = out["responses"], out["response_mask"].bool()
    for row in range(5):
        hits = (expected[row] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 12
        assert torch.equal(resp[row, :end], expected[row, :end])
        assert rmask[row, :end].all() and not rmask[row, end:].any()
        assert (resp[row, end:] == VOCAB - 1).all()
        assert (out["rollout_log_probs"][row, end:] == 0).all()
    assert torch.equal(out["attention_mask"][:, ids.shape[1] :], out["response_mask"])
    # counted from the response mask the generation assembled (queued before the final sync)
    assert engine.stats.new_tokens == int(rmask.sum()) < 5 * 12
    if bool((expected == eos).any(1).all()):
        assert engine.stats.decode_steps < 11


def test_hf_sampling_is_reproducible_from_the_generator_and_matches_the_recompute_path():
    from ppo_core.rollout import generate
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf("qwen2")
    ids, mask = _left_padded(4, 5, seed=3)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20)
    engine = HFRolloutEngine(model)
    a = engine.generate(ids, mask, cfg, generator=torch.Generator().manual_seed(5))
    b = engine.generate(ids, mask, cfg, generator=torch.Generator().manual_seed(5))
    c = engine.generate(ids, mask, cfg, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])
    slow = generate(
        model,
        ids,
        mask,
        SamplingConfig(**{**cfg.to_dict(), "use_cache": False}),
        generator=torch.Generator().manual_seed(5),
    )
    assert torch.equal(slow["responses"], a["responses"])


def test_cpu_sampling_fills_a_noise_buffer_from_the_generator():
    """Without the fused Triton rule (CPU logits) the noise is ``[B, V]`` from the generator, refilled each step."""
    from ppo_core_decode.hf import HFRolloutEngine

    ids, mask = _left_padded(2, 3, seed=4)
    engine = HFRolloutEngine(_hf("llama"), keep_cache=True)
    engine.generate(ids, mask, SamplingConfig(max_new_tokens=3), generator=torch.Generator().manual_seed(0))
    state = engine.decoder._state
    assert state.fused is False and state.seed is None and state.noise.shape == (2, VOCAB)


def test_cache_is_freed_unless_kept_and_reused_for_the_same_shapes():
    """Without ``keep_cache`` the cache's memory is freed at the end of a call (nothing references it) while the
    rest of the generation's state stays for the next call of the same shapes, which allocates the cache again;
    with it the cache itself is kept; ``release`` drops both."""
    import weakref

    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf("llama")
    ids, mask = _left_padded(2, 3, seed=4)
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.0)
    engine = HFRolloutEngine(model)
    first = engine.generate(ids, mask, cfg)
    state = engine.decoder._state
    assert state.cache.keys == [] and state.cache.values == [] and state.cache.nbytes == 0
    engine.decoder._prepare(state.key)  # the next call's first step: the same state, its cache made again
    assert engine.decoder._state is state and state.cache.nbytes == engine.stats.cache_bytes > 0
    storage = weakref.ref(state.cache.keys[0]._base)
    again = engine.generate(ids, mask, cfg)
    assert engine.decoder._state is state and storage() is None  # freed again at the end of the call
    assert torch.equal(again["responses"], first["responses"])
    kept = HFRolloutEngine(model, keep_cache=True)
    first = kept.generate(ids, mask, cfg)
    state = kept.decoder._state
    keys = state.cache.keys[0]
    second = kept.generate(ids, mask, cfg)
    assert kept.decoder._state is state and state.cache.keys[0] is keys
    assert torch.equal(first["responses"], second["responses"])
    kept.release()
    assert kept.decoder._state is None


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "dynamic_rope"])
def test_decode_steps_gather_the_models_rotary_tables_from_the_prefills_table(kind):
    """The prefill tabulates every position of the cache with the model's rotary module; the prefill's rows and a
    decode step's rows of that table are the bits the module gives for those positions. Rope types whose
    frequencies depend on the longest position seen (dynamic) are computed per call, never from a table; the table
    outlives the concatenated weights (the next generation of the same cache length reuses it) and is rebuilt for
    another cache length."""
    from ppo_core_decode.hf import HFRolloutEngine

    if kind == "dynamic_rope":
        model = _hf("llama")
        model.model.rotary_emb.rope_type = (
            "dynamic"  # what the module consults for the kind of its frequencies
        )
    else:
        model = _hf(kind)
    forward = HFRolloutEngine(model)._forward

    def cache(length):
        return KVCache.allocate(
            layers=2, batch=3, kv_heads=2, head_dim=8, length=length, dtype=torch.float32, device="cpu"
        )

    h = torch.zeros(3, 5, 32)
    prompt_positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2], [3, 4, 5, 6, 7]])
    short = cache(20)
    for positions in (prompt_positions, torch.tensor([[19], [0], [7]])):  # a prefill, then a decode step
        got = forward._rotary(h[:, : positions.shape[1]], positions, short)
        want = model.model.rotary_emb(h, positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    table = forward._rotary_table[1]
    assert (table is None) is (kind == "dynamic_rope")
    forward.free()
    assert forward._rotary_table[1] is table
    positions = torch.tensor([[29], [0], [21]])
    got = forward._rotary(h[:, :1], positions, cache(30))  # another cache length: a table of 30 positions
    assert all(torch.equal(g, w) for g, w in zip(got, model.model.rotary_emb(h, positions), strict=True))
    if kind != "dynamic_rope":
        assert forward._rotary_table[1].shape[0] == 30


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_fused_projections_match_separate_ones_and_follow_weight_updates(kind):
    """The concatenated q/k/v and gate/up weights give the separate projections' tokens and log-probs, are rebuilt
    from the weights of the moment at every generation (in place when the cache and graphs are kept), and are
    dropped after a generation otherwise."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf(kind)
    model.model.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.randn(48))  # an MLP bias on one of two
    ids, mask = _left_padded(3, 5, seed=2)
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0)

    def run(engine):
        return engine.generate(ids, mask, cfg, generator=torch.Generator().manual_seed(9))

    separate = HFRolloutEngine(model, fuse_projections=False)
    fused, kept = HFRolloutEngine(model), HFRolloutEngine(model, keep_cache=True)
    for step in range(2):
        want = run(separate)
        for engine in (fused, kept):
            got = run(engine)
            assert torch.equal(got["responses"], want["responses"]), (kind, step)
            torch.testing.assert_close(
                got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-5, rtol=1e-5
            )
        assert fused._forward._fused is None and kept._forward._fused is not None
        with torch.no_grad():  # a training update between two rollouts
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    buffers = [t.data_ptr() for t in kept._forward._fused[0] if t is not None]
    run(kept)
    assert [t.data_ptr() for t in kept._forward._fused[0] if t is not None] == buffers
    kept.release()
    assert kept._forward._fused is None


def test_decoder_rejects_bad_inputs_by_name():
    spec = ModelSpec(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    decoder = StaticCacheDecoder(lambda i, p, c: torch.zeros(i.shape[0], 3), spec, 3)
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="generator"):
        decoder.generate(ids, torch.ones(2, 3), max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(ids, torch.ones(2, 3), max_new_tokens=0, temperature=0.0)
    with pytest.raises(ValueError, match="prompt_mask"):
        decoder.generate(ids, torch.ones(2, 4), max_new_tokens=1, temperature=0.0)
    with pytest.raises(ValueError, match="kv_bucket"):
        StaticCacheDecoder(lambda i, p, c: i, spec, 3, kv_bucket=0)
    calls = []
    counting = StaticCacheDecoder(lambda i, p, c: calls.append(i) or torch.zeros(i.shape[0], 3), spec, 3)
    with pytest.raises(ValueError, match="prompt_mask must contain only 0 and 1"):  # before any forward
        counting.generate(ids, torch.tensor([[1, 1, 1], [0, 2, 1]]), max_new_tokens=2, temperature=0.0)
    assert calls == []


@pytest.mark.parametrize("moved", [False, True])
def test_a_generation_keeps_the_previous_graphs_where_nothing_moved_and_else_retires_them_during_its_prefill(
    moved, monkeypatch
):
    """The graphs (stand-ins here: the CPU captures none) outlive a generation without ``keep_cache``. The next one
    of the same shapes and settings keeps them where the addresses they read are those of their capture
    (``graphs_reused``); where one moved, and for another shape, it retires them: they still exist when its prefill
    is launched and are gone when it returns. ``release`` destroys them too."""
    import weakref

    from ppo_core_decode.hf import HFRolloutEngine

    class Graph:  # a stand-in for a captured torch.cuda.CUDAGraph
        pass

    ids, mask = _left_padded(2, 3, seed=4)
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.0)
    engine = HFRolloutEngine(_hf("llama"))
    decoder = engine.decoder
    first = engine.generate(ids, mask, cfg)
    addresses = iter(range(100))  # what each look at the addresses finds: the same (not moved) or another
    monkeypatch.setattr(decoder, "_addresses", lambda state: next(addresses) if moved else 0)
    prefills = []
    real = decoder._prefill

    def prefill(*args):
        prefills.append(alive() is not None)  # the graph exists when the prefill is launched
        return real(*args)

    monkeypatch.setattr(decoder, "_prefill", prefill)
    for end in ("same", "other shape", "release"):
        state = decoder._state
        graph = Graph()
        state.graphs[(8,)], state.addresses = graph, 0 if not moved else -1
        alive = weakref.ref(graph)
        del graph
        prefills.clear()
        if end == "release":
            engine.release()
            assert alive() is None and decoder._state is None and decoder._retired == []
            break
        call = (ids, mask, cfg) if end == "same" else (ids[:1], mask[:1], cfg)
        out = engine.generate(*call)
        assert torch.equal(out["responses"], first["responses"][: call[0].shape[0]])
        assert prefills == [True] and decoder._retired == []
        kept = end == "same" and not moved
        assert (alive() is not None) is kept and engine.stats.graphs_reused == int(kept)
        assert (decoder._state.graphs == {(8,): alive()}) if kept else decoder._state.graphs == {}
        if end == "other shape":
            assert decoder._state is not state


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_decoders_addresses_follow_the_engines_per_generation_weights_and_tables(kind):
    """What the decoder compares between two generations: unchanged when nothing was made again; changed when the
    forward's concatenated weights, a model weight or the rotary table (another cache length's forward, such as
    ``sequence_logits`` of other sequences) or the cache moved."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf(kind)
    engine = HFRolloutEngine(model, keep_cache=True)
    ids, mask = _left_padded(2, 3, seed=4)
    engine.generate(ids, mask, SamplingConfig(max_new_tokens=3, temperature=0.0))
    decoder, forward = engine.decoder, engine._forward
    state = decoder._state
    before = decoder._addresses(state)
    assert decoder._addresses(state) == before
    held = {a for a, _ in before}
    assert forward._fused[1][2].data_ptr() in held and forward._rotary_table[1].data_ptr() in held
    assert state.cache.keys[0].data_ptr() in held and model.lm_head.weight.data_ptr() in held

    forward._fused[1][2] = forward._fused[1][2].clone()
    assert decoder._addresses(state) != before
    before = decoder._addresses(state)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1.0)  # a training update, in place
    assert decoder._addresses(state) == before
    engine.sequence_logits(torch.ones(2, 7, dtype=torch.long), torch.ones(2, 7), keep=2)
    assert decoder._addresses(state) != before  # a table of 7 positions replaced the cache's
    before, slots = decoder._addresses(state), state.cache.keys[0].data_ptr()
    state.cache.free_slots()
    blocker = torch.empty(
        2 * state.cache.length * 64
    )  # may take the freed memory, as a training step's would
    state.cache.allocate_slots()
    assert (decoder._addresses(state) == before) is (state.cache.keys[0].data_ptr() == slots)
    del blocker


def test_unsupported_architectures_take_the_generic_path():
    from ppo_core_decode.hf import HFRolloutEngine, supports_fast_path

    model = _hf("llama")
    model.config.hidden_act = "gelu"  # not the SwiGLU the fused path computes
    assert not supports_fast_path(model)
    assert not HFRolloutEngine(model).fast_path
    with pytest.raises(ValueError, match="fast_path"):
        HFRolloutEngine(model, fast_path=True)


def test_generic_path_restores_the_attention_implementation():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf("llama")
    before = model.config._attn_implementation
    ids, mask = _left_padded(2, 3, seed=5)
    HFRolloutEngine(model, fast_path=False).generate(
        ids, mask, SamplingConfig(max_new_tokens=2, temperature=0.0)
    )
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, "_ppo_core_kv_cache") for m in model.modules())


def _tiny_megatron():
    """The tests' tiny megatron ``GPTModel`` (eval mode) and its config (megatron's parallel state set up by the
    ``cpu_megatron`` fixture)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _megatron import tiny_config

    from ppo_core.workers.megatron import ParallelConfig
    from ppo_core.workers.megatron.model import build_gpt_model

    cfg = tiny_config()
    return build_gpt_model(cfg, ParallelConfig()).eval(), cfg


def test_megatron_cached_greedy_equals_recomputation(cpu_megatron):
    from ppo_core.workers.megatron.engine import megatron_attention_mask, position_ids
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    model, cfg = _tiny_megatron()

    @torch.no_grad()
    def logits(ids, mask):
        return model(ids, position_ids(mask), megatron_attention_mask(mask))[..., : cfg.vocab_size].float()

    ids, mask = _left_padded(4, 5, seed=6)
    ids = ids % cfg.vocab_size
    engine = MegatronRolloutEngine(model, cfg)
    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert torch.equal(out["responses"], _recompute_greedy(logits, ids, mask, 6, None))
    full = logits(out["input_ids"], out["attention_mask"])[:, ids.shape[1] - 1 : -1]
    expected = full.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-5, rtol=1e-5)
    assert all(layer.kv_cache is None for layer in engine.attention)


@pytest.mark.parametrize("own_forward", [True, False])
def test_megatron_generation_sets_the_eval_mode_only_for_gptmodels_forward(
    cpu_megatron, monkeypatch, own_forward
):
    """The own forward (its functions on the weights) samples from a module in training mode without switching it to
    eval mode and back; ``GPTModel.forward`` (dropout included) switches it; both draw what eval mode draws."""
    from ppo_core.workers.megatron.rollout import MegatronRolloutEngine

    model, cfg = _tiny_megatron()
    ids, mask = _left_padded(3, 5, seed=8)
    ids = ids % cfg.vocab_size
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    engine = MegatronRolloutEngine(model, cfg, own_forward=own_forward)
    want = engine.generate(ids, mask, greedy)
    calls = []
    train = model.train
    monkeypatch.setattr(model, "train", lambda mode=True: (calls.append(mode), train(mode))[1])
    model.train(True)
    calls.clear()
    got = engine.generate(ids, mask, greedy)
    assert model.training and all(m.training for m in model.modules())
    assert calls == ([] if own_forward else [False, True])
    assert torch.equal(got["responses"], want["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], rtol=0, atol=0)


def test_per_forward_values_are_shared_by_the_layers_of_one_forward_only():
    """What the layers of one forward share (the rotary tables at its positions) is made once per forward: a new
    assignment of ``positions`` (the next forward) starts afresh."""
    cache = KVCache.allocate(
        layers=2, batch=1, kv_heads=1, head_dim=2, length=4, dtype=torch.float32, device="cpu"
    )
    calls = []

    def make():
        calls.append(1)
        return cache.positions + 1

    cache.positions = torch.tensor([[0, 1]])
    first = [cache.per_forward("rotary", make) for _ in range(3)]  # three layers
    assert len(calls) == 1 and all(t is first[0] for t in first)
    cache.positions = torch.tensor([[2]])
    assert torch.equal(cache.per_forward("rotary", make), torch.tensor([[3]])) and len(calls) == 2


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("fuse_projections", [False, True])
def test_bf16_fast_path_computes_what_the_models_own_forward_computes(kind, fuse_projections):
    """In bf16 the fused Llama-family path rounds as the model's own eager forward does (norm, rotation, SwiGLU),
    so it draws the same tokens with the same log-probs as the model's own modules run through the cache, bit
    for bit (on the CPU, where both run eagerly)."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf(kind).to(torch.bfloat16)
    ids, mask = _left_padded(6, 9, seed=8)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
    outs = [
        HFRolloutEngine(model, **options).generate(ids, mask, cfg, generator=torch.Generator().manual_seed(4))
        for options in ({"fast_path": False}, {"fast_path": True, "fuse_projections": fuse_projections})
    ]
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    assert torch.equal(outs[0]["rollout_log_probs"], outs[1]["rollout_log_probs"])


_DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.integers(1, 9), min_size=1, max_size=3), k=st.integers(1, 12), seed=st.integers(0, 2**16)
)
def test_folded_group_is_each_weight_times_the_norm_weight(device, rows, k, seed):
    """The HF engine's refresh writes a group's weights stacked, each column times the norm's weight, in one call
    (one Triton launch on CUDA): the same bits as ``fold_norm_weight`` of each weight into its rows."""
    from ppo_core_decode.decode_linear import fold_norm_weight, fold_norm_weights

    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device) for n in rows]
    scale = (torch.randn(k, generator=gen) * 3).to(torch.bfloat16).to(device)
    out = torch.full((sum(rows), k), float("nan"), dtype=torch.bfloat16, device=device)
    fold_norm_weights(out, scale, weights)
    assert torch.equal(out, torch.cat([fold_norm_weight(w, scale) for w in weights]))


@pytest.mark.parametrize("fused_decode", [False, True])
def test_refresh_builds_each_group_once_per_generation_at_its_first_use(monkeypatch, fused_decode):
    """refresh() only marks the concatenated weights stale; the prefill builds them from the weights of the moment,
    every group once per generation. Without ``fused_decode`` each layer's q/k/v and gate/up groups are built right
    before their products (the host's work on layer i + 1's overlaps the device's on layer i); with it (the norm
    weights folded in) every layer's groups are built at the first layer's first use, in one call (one launch on
    CUDA), and the generation samples the same tokens as separate projections."""
    from ppo_core_decode import hf
    from ppo_core_decode.hf import HFRolloutEngine, _LlamaFamilyForward

    events = []
    concatenated_all, mlp, projections = (
        hf._concatenated_all,
        _LlamaFamilyForward._mlp,
        _LlamaFamilyForward._projections,
    )

    def building(groups):
        events.append(("build", tuple(group[0][0] for group in groups)))
        return concatenated_all(groups)

    def running_mlp(self, i, layer, x):
        events.append(("mlp", i))
        return mlp(self, i, layer, x)

    def running_qkv(self, i, layer, x):
        events.append(("qkv", i))
        return projections(self, i, layer, x)

    monkeypatch.setattr(hf, "_concatenated_all", building)
    monkeypatch.setattr(_LlamaFamilyForward, "_mlp", running_mlp)
    monkeypatch.setattr(_LlamaFamilyForward, "_projections", running_qkv)
    model = _hf("llama")
    layers = model.model.layers
    ids, mask = _left_padded(3, 6, seed=2)
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.0)
    separate = HFRolloutEngine(model, fuse_projections=False)
    want = []
    if fused_decode:
        every = tuple(p for layer in layers for p in (layer.self_attn.q_proj, layer.mlp.gate_proj))
        want = [("qkv", 0), ("build", every), ("mlp", 0)]
        want += [kind for i in range(1, len(layers)) for kind in (("qkv", i), ("mlp", i))]
    else:
        for i, layer in enumerate(layers):
            want += [
                ("qkv", i),
                ("build", (layer.self_attn.q_proj,)),
                ("mlp", i),
                ("build", (layer.mlp.gate_proj,)),
            ]
    for keep_cache in (False, True):
        engine = HFRolloutEngine(model, keep_cache=keep_cache, fused_decode=fused_decode)
        for _ in range(2):
            events.clear()
            got = engine.generate(ids, mask, cfg)
            assert events[: len(want)] == want, keep_cache
            assert all(kind != "build" for kind, _ in events[len(want) :])  # decode steps build nothing
            assert torch.equal(got["responses"], separate.generate(ids, mask, cfg)["responses"])
            with torch.no_grad():  # a training update: the next generation builds from it
                layers[1].mlp.up_proj.weight.mul_(-1.0)
        engine.release()


def test_prefill_runs_the_last_layers_mlp_for_the_last_position_only(monkeypatch):
    """Only the last position's output of the last layer reaches the logits: the prefill's other layers run their
    MLP over every position, the last one over one position per row (and decode steps over their one token)."""
    from ppo_core_decode.hf import HFRolloutEngine, _LlamaFamilyForward

    seen = []
    mlp = _LlamaFamilyForward._mlp

    def recording(self, i, layer, x):
        seen.append((i, x.shape[1]))
        return mlp(self, i, layer, x)

    monkeypatch.setattr(_LlamaFamilyForward, "_mlp", recording)
    model = _hf("llama")
    ids, mask = _left_padded(3, 6, seed=2)
    engine = HFRolloutEngine(model)
    out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert seen == [(0, 6), (1, 1), (0, 1), (1, 1)]  # prefill (2 layers), then one decode step
    ref = _recompute_greedy(lambda i, m: _hf_logits(model, i, m), ids, mask, 2, None)
    assert torch.equal(out["responses"], ref)


@pytest.mark.parametrize("fast_path", [True, False])
def test_generation_sets_the_eval_mode_only_where_the_forward_depends_on_it(monkeypatch, fast_path):
    """A model in training mode with attention dropout samples as in eval mode and is left in training mode; the
    Llama-family path (its own functions on the weights) never toggles the mode, the generic path (the model's own
    forward, dropout included) does, and no path toggles a model already in eval mode."""
    from ppo_core_decode.hf import HFRolloutEngine

    cfg = _hf("llama").config
    cfg.attention_dropout = 0.5
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(_hf("llama").state_dict())
    ids, mask = _left_padded(3, 5, seed=4)
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    want = HFRolloutEngine(model.eval(), fast_path=fast_path).generate(ids, mask, greedy, generator=None)
    calls = []
    train = model.train
    monkeypatch.setattr(model, "train", lambda mode=True: (calls.append(mode), train(mode))[1])
    engine = HFRolloutEngine(model, fast_path=fast_path)
    engine.generate(ids, mask, greedy, generator=None)
    assert calls == []  # already in eval mode
    model.train(True)
    calls.clear()
    got = engine.generate(ids, mask, greedy, generator=None)
    assert model.training and all(m.training for m in model.modules())
    assert calls == ([] if fast_path else [False, True])
    assert torch.equal(got["responses"], want["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], rtol=0, atol=0)


def test_generate_waits_for_the_device_once_and_times_prefill_and_decode(monkeypatch):
    """The host does not wait for the prefill before it queues the decode steps: one synchronisation per
    ``generate`` (at its end), and the two spans of the stats (events on CUDA) are positive and fit in the call."""
    import time

    from ppo_core_decode import decoding
    from ppo_core_decode.hf import HFRolloutEngine

    model = _hf("llama")
    ids, mask = _left_padded(3, 5, seed=2)
    engine = HFRolloutEngine(model)
    syncs = []
    real = decoding._sync
    monkeypatch.setattr(decoding, "_sync", lambda device: (syncs.append(device), real(device))[1])
    start = time.perf_counter()
    engine.generate(ids, mask, SamplingConfig(max_new_tokens=6, temperature=0.0))
    wall = time.perf_counter() - start
    assert len(syncs) == 1
    stats = engine.stats
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.prefill_s + stats.decode_s <= wall
    # the host's own spans: queuing the prefill (on the CPU, running it), no graph to capture or destroy
    assert 0 < stats.host_prefill_s <= wall
    assert stats.host_capture_s == 0 and stats.graphs_captured == 0
    assert 0 <= stats.host_release_s < stats.host_prefill_s


@pytest.mark.parametrize("check_every, per_graph", [(8, 8), (8, 3), (4, 8), (5, 1)])
def test_decode_steps_are_grouped_up_to_steps_per_graph_and_never_past_a_check(check_every, per_graph):
    """The decoder's launches: from step 1, groups of at most ``steps_per_graph`` steps that end at every multiple
    of ``check_every`` (where it checks for finished rows) and at the last step; single steps where a noise buffer
    is filled before each step; each group keyed by its steps' cache lengths."""
    from ppo_core_decode.decoding import ModelSpec, StaticCacheDecoder

    decoder = StaticCacheDecoder(
        lambda *a: None,
        ModelSpec(1, 1, 1, torch.float32, torch.device("cpu")),
        16,
        kv_bucket=16,
        check_every=check_every,
        steps_per_graph=per_graph,
    )
    r, t, starts = 50, 1, []
    state = type("S", (), {"noise": None, "prompt_width": 20, "cache": type("C", (), {"length": 70})()})()
    while t < r:
        n = decoder._group_length(state, t, r)
        assert 1 <= n <= per_graph and t + n <= r
        # no group crosses a check: the checks fall on group starts
        assert all((t + i) % check_every for i in range(1, n))
        assert decoder._kv_lens(state, t, n) == tuple(
            min(-(-(20 + s) // 16) * 16, 70) for s in range(t, t + n)
        )
        starts.append(t)
        t += n
    assert t == r and set(range(check_every, r, check_every)) <= set(starts)
    state.noise = torch.zeros(1)
    assert decoder._group_length(state, 1, r) == 1
    with pytest.raises(ValueError, match="steps_per_graph"):
        StaticCacheDecoder(
            lambda *a: None, ModelSpec(1, 1, 1, torch.float32, torch.device("cpu")), 16, steps_per_graph=0
        )
