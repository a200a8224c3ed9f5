"""The rollout package: top-p and sampling against loops, :func:`generate` (layout, KV cache = recompute, left
padding), ``rollout_log_probs`` against ``compute_log_prob`` and :func:`sampling_log_probs` against a loop, the
``ModelRolloutEngine`` and the actor's ``rollout_engine`` argument."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny_lm import CFG, EOS, LM, PAD, NoCache
from _tiny_lm import left_padded_prompts as _prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.keys import KEYS
from ppo_core.models import TinyGPT
from ppo_core.rollout import (
    ModelRolloutEngine,
    RolloutEngine,
    SamplingConfig,
    generate,
    rollout_batch,
    sample_from_logits,
    sampling_log_probs,
    top_p_filter,
)
from ppo_core.workers.torch import TorchActorWorker
from ppo_core.workers.torch import generate as torch_generate


@settings(max_examples=50)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.01, 1.0))
def test_top_p_filter_matches_loop(seed: int, top_p: float) -> None:
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = top_p_filter(logits, top_p)
    for row in range(3):
        probs = logits[row].softmax(-1).tolist()
        order = sorted(range(6), key=lambda v: -probs[v])
        mass, keep = 0.0, set()
        for v in order:
            if mass >= top_p:
                break
            keep.add(v)
            mass += probs[v]
        for v in range(6):
            assert (out[row, v] == float("-inf")) == (v not in keep)
            if v in keep:
                assert out[row, v] == logits[row, v]


def test_sample_from_logits_greedy_and_frequencies() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20_000, 3)
    assert sample_from_logits(logits[:2], temperature=0, generator=None).tolist() == [2, 2]
    draws = sample_from_logits(logits, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).double() / draws.numel()
    assert torch.allclose(freq, logits[0].double().softmax(-1), atol=0.015)
    hot = sample_from_logits(logits, temperature=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(
        torch.bincount(hot, minlength=3).double() / hot.numel(),
        (logits[0] / 0.5).double().softmax(-1),
        atol=0.015,
    )
    nucleus = sample_from_logits(logits, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert set(nucleus.tolist()) == {1, 2}  # p = (.09, .24, .67): mass 0.7 needs the top two
    with pytest.raises(ValueError, match="generator"):
        sample_from_logits(logits, generator=None)


def test_sampling_config_validation() -> None:
    for bad in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)
    assert SamplingConfig.from_dict(SamplingConfig(top_p=0.9).to_dict()) == SamplingConfig(top_p=0.9)


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([0.8, 1.0]),
)
def test_generate_layout_and_cache_equivalence(seed: int, temperature: float, top_p: float) -> None:
    lm = TinyGPT(CFG, seed=seed)
    p = _prompts(seed, batch=5)
    cfg = SamplingConfig(
        max_new_tokens=5, eos_token_id=EOS, pad_token_id=PAD, temperature=temperature, top_p=top_p
    )
    out = generate(
        lm, p["input_ids"], p["attention_mask"], cfg, generator=torch.Generator().manual_seed(seed)
    )
    ref = generate(
        NoCache(lm), p["input_ids"], p["attention_mask"], cfg, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(out["responses"], ref["responses"])
    resp, rmask = out["responses"], out["response_mask"]
    assert resp.shape == (5, 5)
    for row in range(5):
        tokens = resp[row].tolist()
        end = tokens.index(EOS) + 1 if EOS in tokens else len(tokens)
        assert rmask[row].tolist() == [1] * end + [0] * (5 - end)
        assert tokens[end:] == [PAD] * (5 - end)
    assert torch.equal(out["input_ids"], torch.cat([p["input_ids"], resp], 1))
    assert torch.equal(out["attention_mask"], torch.cat([p["attention_mask"], rmask], 1))
    assert torch.equal(out["prompts"], p["input_ids"])


def test_generate_left_padded_batch_equals_one_by_one() -> None:
    p = _prompts(3, batch=6)
    cfg = SamplingConfig(max_new_tokens=4, eos_token_id=EOS, temperature=0.0)
    lm = LM()
    batched = generate(lm, p["input_ids"], p["attention_mask"], cfg)["responses"]
    for row in range(6):
        keep = p["attention_mask"][row].bool()
        single = generate(lm, p["input_ids"][row, keep][None], torch.ones(1, int(keep.sum())), cfg)[
            "responses"
        ]
        assert torch.equal(batched[row], single[0])


@settings(max_examples=20)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=7).map(
        lambda v: torch.tensor([v], dtype=torch.float64)
    ),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    data=st.data(),
)
def test_sampling_log_probs_matches_a_loop(
    logits: torch.Tensor, temperature: float, data: st.DataObject
) -> None:
    token = data.draw(st.integers(0, logits.shape[1] - 1))
    t = temperature if temperature > 0 else 1.0
    scaled = [x / t for x in logits[0].tolist()]
    top = max(scaled)
    want = scaled[token] - top - math.log(sum(math.exp(x - top) for x in scaled))
    got = sampling_log_probs(logits, torch.tensor([token]), temperature=temperature)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_sampling_log_probs_of_half_precision_logits_are_fp32() -> None:
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = sampling_log_probs(logits, torch.tensor([0, 1, 2, 3]), temperature=0.7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (logits.float() / 0.7).log_softmax(-1)[torch.arange(4), :4].diagonal())


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([0.6, 1.0]),
    use_cache=st.booleans(),
)
def test_rollout_log_probs_are_what_compute_log_prob_gives(
    seed: int, temperature: float, top_p: float, use_cache: bool
) -> None:
    """Same tokens, same distribution: the sampler's log-probs equal the training log-probs (top-p truncation and
    greedy decoding included: both score ``log_softmax(logits / T)``, ``T = 1`` when greedy); 0 after the end."""
    rollout = {"max_new_tokens": 5, "eos_token_id": EOS, "temperature": temperature, "top_p": top_p}
    actor = TorchActorWorker(
        LM,
        {
            "device": "cpu",
            "seed": seed,
            "ppo_mini_batch_size": 1,
            "rollout": {**rollout, "use_cache": use_cache},
        },
    )
    out = actor.generate_sequences(_prompts(seed, 6))
    scored = actor.compute_log_prob(out)[KEYS.old_log_probs]
    mask = out[KEYS.response_mask].bool()
    got = out[KEYS.rollout_log_probs]
    assert got.shape == scored.shape
    torch.testing.assert_close(got[mask], scored[mask], rtol=1e-5, atol=1e-5)
    assert (got[~mask] == 0).all()
    assert (got[mask] <= 0).all()


def test_generate_pads_log_probs_when_every_response_ends_early() -> None:
    lm = TinyGPT(CFG, seed=3)
    with torch.no_grad():
        lm.head.bias.fill_(0.0)
        lm.head.bias[EOS] = 50.0  # EOS first: every response ends at step 0
    p = _prompts(0, 3)
    out = generate(
        lm,
        p["input_ids"],
        p["attention_mask"],
        SamplingConfig(max_new_tokens=4, eos_token_id=EOS, temperature=0),
    )
    assert out[KEYS.responses][:, 0].tolist() == [EOS] * 3
    assert out[KEYS.rollout_log_probs].shape == (3, 4)
    assert (out[KEYS.rollout_log_probs][:, 1:] == 0).all() and (
        out[KEYS.rollout_log_probs][:, 0] > -1e-3
    ).all()


def test_generate_of_no_prompts() -> None:
    p = _prompts(0, 0)
    out = generate(LM(), p["input_ids"], p["attention_mask"], SamplingConfig(max_new_tokens=2, temperature=0))
    assert out[KEYS.rollout_log_probs].shape == (0, 2) and out[KEYS.responses].shape == (0, 2)


def test_model_rollout_engine_restores_the_mode_and_matches_generate() -> None:
    lm = LM().train()
    engine = ModelRolloutEngine(NoCache(lm))
    assert isinstance(engine, RolloutEngine)
    p = _prompts(4, 5)
    cfg = SamplingConfig(max_new_tokens=4, eos_token_id=EOS)
    got = engine.generate(
        p["input_ids"], p["attention_mask"], cfg, generator=torch.Generator().manual_seed(1)
    )
    want = generate(lm, p["input_ids"], p["attention_mask"], cfg, generator=torch.Generator().manual_seed(1))
    assert lm.training  # put back after sampling in eval mode
    for key in want.keys():  # noqa: SIM118 (iterating a TensorDict yields rows)
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ModelRolloutEngine(lambda ids: ids)  # type: ignore[arg-type]


class _Greedy:
    """A rollout engine that answers ``[B, 2]`` ones and records what it was given."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, []

    def generate(self, prompts, prompt_mask, config, *, generator):
        self.calls.append((config.temperature, generator))
        b = prompts.shape[0]
        ones = torch.ones(b, 2, dtype=torch.long)
        return rollout_batch(prompts, prompt_mask, ones, ones)


def test_the_actor_samples_through_the_rollout_engine_it_is_given() -> None:
    actor = TorchActorWorker(LM, {"device": "cpu", "ppo_mini_batch_size": 1}, rollout_engine=_Greedy)
    assert actor.rollout.model is actor.module  # the factory got the policy module
    out = actor.generate_sequences(_prompts(0, 3), do_sample=False)
    assert (out[KEYS.responses] == 1).all()
    ((temperature, generator),) = actor.rollout.calls
    assert temperature == 0.0 and generator is actor.generator


def test_generate_is_re_exported_by_the_torch_workers() -> None:
    assert torch_generate is generate


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_left_padded_prompt_samples_as_alone_on_a_raw_absolute_position_model(use_cache: bool) -> None:
    """GPT-2 (learned absolute positions) called directly, not through HFCausalLM: the reference loop (use_cache
    False) and the hf engine count a row's positions from its first real token, so left padding changes
    neither the tokens nor their log-probs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ).eval()
    prompts = torch.tensor([[0, 0, 0, 0, 21, 22], [21, 22, 23, 24, 25, 26]])
    mask = (prompts != 0).long()
    config = SamplingConfig(max_new_tokens=4, temperature=0.0, use_cache=use_cache)
    padded = generate(model, prompts, mask, config)
    alone = generate(model, prompts[:1, 4:], mask[:1, 4:], config)
    assert torch.equal(padded["responses"][:1], alone["responses"])
    torch.testing.assert_close(padded["rollout_log_probs"][:1], alone["rollout_log_probs"])
