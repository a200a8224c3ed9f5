"""KV-cached rollout engines on CUDA: graph-captured decoding gives exactly what eager decoding gives, stops
early, and agrees with full recomputation (GPU only)."""

from __future__ import annotations

import pytest
import torch

from ppo_core.rollout import SamplingConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")


def _model(dtype: torch.dtype) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def _prompts(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(1, 512, (batch, width), generator=g) * mask
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_replay_equals_eager_decoding(temperature):
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.float32)
    ids, mask = _prompts(8, 40)
    cfg = SamplingConfig(max_new_tokens=300, temperature=temperature, top_p=0.95, top_k=50)
    outs = []
    for graphs in (True, False):
        engine = HFRolloutEngine(model, cuda_graphs=graphs, kv_bucket=64)
        outs.append(engine.generate(ids, mask, cfg, generator=torch.Generator("cuda").manual_seed(3)))
        assert engine.stats.cuda_graphs is graphs
    graphed, eager = outs
    assert engine.stats.host_capture_s == 0  # the eager engine captured nothing
    assert torch.equal(graphed["responses"], eager["responses"])
    torch.testing.assert_close(graphed["rollout_log_probs"], eager["rollout_log_probs"])
    assert engine.stats.decode_steps == 299


@pytest.mark.parametrize("eos", [None, 7])
def test_groups_of_steps_in_one_graph_draw_what_one_step_graphs_draw(eos):
    """``steps_per_graph`` changes how many launches replay the steps, not what they compute: the same tokens and
    log-probs (in-kernel randomness, EOS ending rows early) and the same early stop, cold and warm."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.bfloat16)
    ids, mask = _prompts(8, 40)
    cfg = SamplingConfig(max_new_tokens=90, temperature=1.0, eos_token_id=eos)
    outs, steps = [], []
    for per_graph in (1, 8, 3):
        engine = HFRolloutEngine(model, kv_bucket=32, steps_per_graph=per_graph)
        for _ in range(2):  # the second call is warm: its first group is captured during the prefill
            outs.append(engine.generate(ids, mask, cfg, generator=torch.Generator("cuda").manual_seed(5)))
        steps.append(engine.stats.decode_steps)
    for out in outs[1:]:
        for key in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(out[key], outs[0][key]), key
    assert len(set(steps)) == 1 and steps[0] <= 89


@pytest.mark.parametrize("eos", [None, 7])
def test_kernel_noise_sampling_is_the_same_with_and_without_graphs(eos):
    """Temperature sampling without truncation draws its noise in the sampling kernel: the same generator state gives
    the same tokens eagerly and through replayed graphs, a ``[B, V]`` noise buffer is never allocated, and another
    seed gives other tokens."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.float32)
    ids, mask = _prompts(8, 40)
    cfg = SamplingConfig(max_new_tokens=200, temperature=1.0, eos_token_id=eos)
    outs = []
    for graphs, seed in ((True, 3), (False, 3), (True, 4)):
        engine = HFRolloutEngine(model, cuda_graphs=graphs, kv_bucket=64, keep_cache=True)
        outs.append(engine.generate(ids, mask, cfg, generator=torch.Generator("cuda").manual_seed(seed)))
        state = engine.decoder._state
        assert state.fused is True and state.noise is None and state.seed is not None
        assert engine.stats.cuda_graphs is graphs and (engine.stats.graphs_captured >= 1) is graphs
        engine.release()
    graphed, eager, other = outs
    assert torch.equal(graphed["responses"], eager["responses"])
    assert torch.equal(graphed["response_mask"], eager["response_mask"])
    torch.testing.assert_close(graphed["rollout_log_probs"], eager["rollout_log_probs"])
    assert not torch.equal(graphed["responses"], other["responses"])
    # every step drew its own noise: the responses are not one token repeated
    assert len(set(graphed["responses"][0, :20].tolist())) > 1


@pytest.mark.parametrize("mode", ["moved", "in place", "keep_cache"])
def test_a_warm_generation_reuses_or_captures_during_the_prefill_and_draws_the_same_tokens(mode, monkeypatch):
    """A second call with the same shapes and settings skips the eager warm-up step. Where the tensors its graphs
    read are back at their addresses (the cache and the engine's concatenated weights, freed and made again; or
    kept with ``keep_cache``) it replays the previous call's graphs and captures none; where the cache landed
    elsewhere (``moved``: the freed memory taken between the calls, as a training step may) it captures its first
    graph while the prefill runs. Either way the tokens and log-probs equal the first call's for the same
    generator state, and another seed still gives other tokens."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.float32)
    ids, mask = _prompts(8, 40)
    cfg = SamplingConfig(max_new_tokens=100, temperature=1.0, eos_token_id=7)
    engine = HFRolloutEngine(model, kv_bucket=32, keep_cache=mode == "keep_cache")
    decoder = engine.decoder
    eager_steps = []
    decode = decoder._decode
    monkeypatch.setattr(
        decoder, "_decode", lambda s, k, smp, eager: (eager_steps.append(eager), decode(s, k, smp, eager))[1]
    )
    outs, stats, blockers = [], [], []
    for seed in (3, 3, 3, 4):
        outs.append(engine.generate(ids, mask, cfg, generator=torch.Generator("cuda").manual_seed(seed)))
        stats.append((engine.stats.graphs_captured, engine.stats.graphs_reused, engine.stats.decode_steps))
        if mode == "moved":  # the freed cache's memory taken until the next call has allocated its own
            blockers = [torch.empty(engine.stats.cache_bytes, dtype=torch.uint8, device="cuda")]
    del blockers
    assert eager_steps[0] is True and not any(eager_steps[1:])
    first, *warm, other = outs
    for out in warm:
        for key in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(first[key], out[key]), key
    assert not torch.equal(first["responses"], other["responses"])
    steps = stats[2][2]
    buckets = {min(-(-(40 + t) // 32) * 32, 140) for t in range(1, steps + 1)}  # cache of 40 + 100 slots
    assert stats[0][:2] == (len({min(-(-(40 + t) // 32) * 32, 140) for t in range(2, stats[0][2] + 1)}), 0)
    if mode == "moved":
        assert all(captured == len(buckets) and reused == 0 for captured, reused, _ in stats[1:3])
    else:  # the allocator settles by the third call: the second may have been handed other blocks
        assert stats[2][:2] == (0, len(buckets))
    engine.release()
    assert decoder._retired == [] and decoder._pool is None and decoder._state is None


@pytest.mark.parametrize("keep_cache", [False, True])
def test_replayed_graphs_follow_in_place_updates_and_a_moved_table_is_captured_anew(keep_cache):
    """Graphs replayed by a later generation read the weights of the moment (a training update in place, refolded
    into the same buffers): they draw what a fresh engine draws. A forward of another length between two
    generations (``sequence_logits``, as exact mode runs) replaces the rotary table the graphs read: the next
    generation sees the moved address and captures anew instead of replaying over freed memory, with or without
    ``keep_cache``."""
    import copy

    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.bfloat16)
    ids, mask = _prompts(8, 40)
    cfg = SamplingConfig(max_new_tokens=60, temperature=1.0)
    g = torch.Generator("cuda").manual_seed(0)
    deltas = [
        0.02 * torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) for p in model.parameters()
    ]

    def update(m):  # a training update, in place
        with torch.no_grad():
            for p, d in zip(m.parameters(), deltas, strict=True):
                p.add_(d)

    def run(engine, seed):
        return engine.generate(ids, mask, cfg, generator=torch.Generator("cuda").manual_seed(seed))

    # the references first (a fresh engine on a copy), so that nothing allocates between the engine's calls
    reference_model = copy.deepcopy(model)
    want = {seed: run(HFRolloutEngine(reference_model, kv_bucket=32), seed) for seed in range(3)}
    update(reference_model)
    want.update({seed: run(HFRolloutEngine(reference_model, kv_bucket=32), seed) for seed in (3, 4)})
    del reference_model
    engine = HFRolloutEngine(model, kv_bucket=32, keep_cache=keep_cache)

    def check(seed):
        out = run(engine, seed)
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(out[key], want[seed][key]), (seed, key)
        return engine.stats.graphs_captured, engine.stats.graphs_reused

    for seed in range(3):
        check(seed)
    update(model)
    captured, reused = check(3)
    assert captured == 0 and reused > 0
    table = engine._forward._rotary_table[1]
    engine.sequence_logits(ids[:, :30], mask[:, :30], keep=2)
    assert engine._forward._rotary_table[1] is not table
    captured, reused = check(4)
    assert captured > 0 and reused == 0
    engine.release()


@pytest.mark.parametrize("keep_cache", [False, True])
def test_generations_of_other_shapes_and_settings_keep_their_graphs(keep_cache):
    """Generations that alternate shapes and settings (a training rollout, a validation rollout, a smaller batch)
    capture graphs every time: each first call of a key decodes its first step eagerly and captures the rest, each
    repeated call captures during its prefill, and every call draws what a fresh engine draws. (Destroying the
    previous generation's graphs frees their memory pool; a generation that captures after that needs a new one:
    capturing into the freed pool failed and left the engine decoding eagerly.)"""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.float32)
    ids, mask = _prompts(8, 40)
    calls = [
        (ids, mask, SamplingConfig(max_new_tokens=20, temperature=1.0)),
        (ids, mask, SamplingConfig(max_new_tokens=12, temperature=0.0)),
        (ids[:4], mask[:4], SamplingConfig(max_new_tokens=20, temperature=1.0)),
        (ids, mask, SamplingConfig(max_new_tokens=20, temperature=1.0)),
        (ids, mask, SamplingConfig(max_new_tokens=12, temperature=0.0)),
    ]
    engine = HFRolloutEngine(model, kv_bucket=32, keep_cache=keep_cache)
    for i, (p, m, cfg) in enumerate(calls):
        out = engine.generate(p, m, cfg, generator=torch.Generator("cuda").manual_seed(i))
        assert engine.decoder.cuda_graphs and engine.stats.cuda_graphs, i
        assert engine.stats.graphs_captured > 0 or keep_cache, i
        fresh = HFRolloutEngine(model, kv_bucket=32).generate(
            p, m, cfg, generator=torch.Generator("cuda").manual_seed(i)
        )
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(out[key], fresh[key]), (i, key)
    engine.release()


def test_graphs_stop_early_once_every_row_has_finished():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.float32)
    ids, mask = _prompts(4, 16)
    eos = 5

    def force_eos(t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        boost = torch.zeros_like(logits)
        boost[:, eos] = 1e4
        return torch.where(t >= 20, logits + boost, logits)

    engine = HFRolloutEngine(model, check_every=4)
    out = engine.generate(
        ids, mask, SamplingConfig(max_new_tokens=200, temperature=0.0, eos_token_id=eos), step_hook=force_eos
    )
    assert (out["response_mask"].sum(1) <= 21).all()
    assert engine.stats.decode_steps <= 24
    assert engine.stats.graphs_captured >= 1


def test_bf16_cached_greedy_agrees_with_recomputation_up_to_near_ties():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(torch.bfloat16)
    ids, mask = _prompts(16, 32)
    out = HFRolloutEngine(model).generate(ids, mask, SamplingConfig(max_new_tokens=24, temperature=0.0))
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for t in range(24):
            pos = (seq_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=seq, attention_mask=seq_mask, position_ids=pos).logits[:, -1].float()
            ours = out["responses"][:, t]
            # every token we drew is the recomputed argmax or within bf16 rounding of it
            gap = logits.max(-1).values - logits.gather(1, ours[:, None]).squeeze(1)
            assert (gap <= 0.05 * logits.abs().max(-1).values.clamp(min=1)).all()
            seq = torch.cat([seq, ours[:, None]], 1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(ours[:, None])], 1)
        pos = (seq_mask.cumsum(-1) - 1).clamp(min=0)
        full = model(input_ids=seq, attention_mask=seq_mask, position_ids=pos).logits[:, 31:-1].float()
    lp = full.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    assert (lp - out["rollout_log_probs"]).abs().max() < 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "groups", "d"), [(32, 8, 64), (8, 8, 128), (16, 2, 64), (12, 4, 64)])
@pytest.mark.parametrize("kv_len", [1, 37, 64, 384, 1000])
def test_triton_decode_attention_matches_the_sdpa_reference(dtype, heads, groups, d, kv_len):
    from ppo_core_decode.decode_attention import decode_attention_sdpa, decode_attention_triton

    g = torch.Generator("cuda").manual_seed(kv_len * heads + d)
    b, length = 5, kv_len + 7  # the cache is longer than the slots attended to
    q = torch.randn(b, heads, 1, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, groups, length, d, device="cuda", generator=g).to(dtype)[:, :, :kv_len]
    v = torch.randn(b, groups, length, d, device="cuda", generator=g).to(dtype)[:, :, :kv_len]
    visible = torch.rand(b, kv_len, device="cuda", generator=g) > 0.4
    visible[:, -1] = True  # a query always sees its own slot
    bias = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    ours = decode_attention_triton(q, k, v, bias, 0.125).float()
    ref = decode_attention_sdpa(q.double(), k.double(), v.double(), bias.double(), 0.125).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("filled", [1, 63, 64, 65, 300])
def test_triton_decode_attention_stops_at_the_filled_slots(filled):
    """With ``filled`` (a device scalar) the kernel reads no slot past it: NaN there changes nothing."""
    from ppo_core_decode.decode_attention import decode_attention_sdpa, decode_attention_triton

    g = torch.Generator("cuda").manual_seed(filled)
    b, heads, groups, d, kv_len = 3, 16, 4, 64, 384
    q = torch.randn(b, heads, 1, d, device="cuda", generator=g, dtype=torch.float32)
    k = torch.randn(b, groups, kv_len, d, device="cuda", generator=g)
    v = torch.randn(b, groups, kv_len, d, device="cuda", generator=g)
    visible = torch.arange(kv_len, device="cuda")[None, :] < filled
    bias = torch.where(visible, 0.0, float("-inf")).expand(b, kv_len)[:, None, None, :]
    ref = decode_attention_sdpa(q.double(), k.double(), v.double(), bias.double(), 0.125).float()
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")  # never written, never read
    ours = decode_attention_triton(q, k, v, bias, 0.125, filled=torch.tensor(filled, device="cuda"))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
