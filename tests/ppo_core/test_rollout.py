"""The rollout package: ``rollout_log_probs`` of :func:`generate`, :func:`sampling_log_probs` against a loop, the
``ModelRolloutEngine`` and the actor's ``rollout_engine`` argument."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.keys import KEYS
from ppo_core.models import TinyGPT, TinyGPTConfig
from ppo_core.rollout import ModelRolloutEngine, RolloutEngine, SamplingConfig, generate, sampling_log_probs
from ppo_core.workers.torch import TorchActorWorker

V, EOS, PAD = 9, 8, 0
CFG = TinyGPTConfig(vocab_size=V, max_seq_len=12, d_model=16, n_layers=1, n_heads=2)
LM = functools.partial(TinyGPT, CFG, seed=1)


def _prompts(seed: int, rows: int, width: int = 3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, EOS, (rows, width), generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return TensorDict({"input_ids": ids * mask, "attention_mask": mask}, batch_size=[rows])


class _NoCache(torch.nn.Module):
    """The LM without ``new_cache``: generation recomputes every step."""

    def __init__(self, lm: TinyGPT) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids, attention_mask=attention_mask)


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
    engine = ModelRolloutEngine(_NoCache(lm))
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
        responses = torch.ones(b, 2, dtype=torch.long)
        mask = torch.ones(b, 2, dtype=torch.long)
        return TensorDict(
            {
                KEYS.prompts: prompts,
                KEYS.responses: responses,
                KEYS.input_ids: torch.cat([prompts, responses], 1),
                KEYS.attention_mask: torch.cat([prompt_mask, mask], 1),
                KEYS.response_mask: mask,
            },
            batch_size=[b],
        )


def test_the_actor_samples_through_the_rollout_engine_it_is_given() -> None:
    actor = TorchActorWorker(LM, {"device": "cpu", "ppo_mini_batch_size": 1}, rollout_engine=_Greedy)
    assert actor.rollout.model is actor.module  # the factory got the policy module
    out = actor.generate_sequences(_prompts(0, 3), do_sample=False)
    assert (out[KEYS.responses] == 1).all()
    ((temperature, generator),) = actor.rollout.calls
    assert temperature == 0.0 and generator is actor.generator
