"""Training's exact log-probs from the rollout engine (``ppo_core_decode.sequence_log_probs``,
``CachedRolloutEngine.sequence_logits``, ``fused_token_log_probs``): a full forward of generated sequences gives,
bit for bit, the logits and log-probs the batch-invariant cached decoding sampled with, whatever rows go together."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.rollout import SamplingConfig
from ppo_core.rollout.sampling import sampling_log_probs
from ppo_core_decode.sequence_log_probs import sampler_log_probs, sequence_log_probs

transformers = pytest.importorskip("transformers")

VOCAB, EOS = 16, 3  # a small vocabulary: EOS ends some rows early (padding inside the sequences)


def _model(kind: str, dtype: torch.dtype, device: str = "cpu", vocab: int = VOCAB) -> torch.nn.Module:
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(device, dtype).eval()


def _prompts(batch: int, width: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(EOS + 1, VOCAB, (batch, width), generator=g) * mask
    return ids.to(device), mask.to(device)


def _generate(engine, config: SamplingConfig, batch: int = 7, seed: int = 3, device: str = "cpu"):
    """A generation and the logits each of its steps sampled from (``[B, V]`` per step)."""
    seen: list[torch.Tensor] = []

    def keep(t, logits):
        seen.append(logits.clone())
        return logits

    ids, mask = _prompts(batch, 9, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = engine.generate(ids, mask, config, generator=gen, step_hook=keep)
    return out, seen


SAMPLED = SamplingConfig(max_new_tokens=12, temperature=0.7, eos_token_id=EOS, batch_invariant=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_logits_are_the_logits_every_step_sampled_from(kind, dtype):
    from ppo_core_decode.hf import HFRolloutEngine

    engine = HFRolloutEngine(_model(kind, dtype), batch_invariant=True)
    out, seen = _generate(engine, SAMPLED)
    r = out["responses"].shape[1]
    logits = engine.sequence_logits(out["input_ids"], out["attention_mask"], r + 1)
    assert logits.shape == (7, r + 1, VOCAB) and logits.dtype == dtype
    valid = out["response_mask"].bool()
    assert bool((~valid).any()), "EOS should end some rows early (padding inside the sequences)"
    for t, step in enumerate(seen):
        rows = valid[:, t]
        assert torch.equal(logits[rows, t], step[rows]), f"step {t}"
    exact = sequence_log_probs(
        engine, out["input_ids"], out["attention_mask"], out["responses"], temperature=0.7
    )
    assert torch.equal(exact[valid], out["rollout_log_probs"][valid])


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_a_row_s_log_probs_do_not_depend_on_the_rows_computed_with_it(data):
    from ppo_core_decode.hf import HFRolloutEngine

    engine = HFRolloutEngine(_model("llama", torch.bfloat16), batch_invariant=True)
    out, _ = _generate(engine, SAMPLED, batch=6, seed=data.draw(st.integers(0, 50)))
    rows = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
    pick = torch.tensor(rows)
    exact = sequence_log_probs(
        engine, out["input_ids"][pick], out["attention_mask"][pick], out["responses"][pick], temperature=0.7
    )
    valid = out["response_mask"][pick].bool()
    assert torch.equal(exact[valid], out["rollout_log_probs"][pick][valid])


def test_greedy_rollouts_score_at_temperature_one():
    from ppo_core_decode.hf import HFRolloutEngine

    engine = HFRolloutEngine(_model("qwen2", torch.float32), batch_invariant=True)
    config = SamplingConfig(max_new_tokens=6, temperature=0.0, batch_invariant=True)
    out, _ = _generate(engine, config)
    exact = sequence_log_probs(
        engine, out["input_ids"], out["attention_mask"], out["responses"], temperature=0.0
    )
    assert torch.equal(exact, out["rollout_log_probs"])


def test_the_model_s_own_forward_is_not_exact():
    """Why exact mode exists: the model's forward (the training engine's fast path) differs in the last bits."""
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model("llama", torch.float32)
    out, _ = _generate(HFRolloutEngine(model, batch_invariant=True), SAMPLED)
    r = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(out["input_ids"], attention_mask=out["attention_mask"]).logits[:, -r - 1 : -1]
    plain = sampling_log_probs(logits.reshape(-1, VOCAB), out["responses"].reshape(-1), temperature=0.7)
    valid = out["response_mask"].bool()
    diff = (plain.view_as(out["rollout_log_probs"]) - out["rollout_log_probs"])[valid].abs()
    assert 0 < float(diff.max()) < 1e-4


def test_sequence_logits_need_the_engine_s_layer_loop_and_a_valid_keep():
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model("llama", torch.float32)
    ids, mask = _prompts(2, 5, seed=0)
    with pytest.raises(ValueError, match="layer loop"):
        HFRolloutEngine(model, fast_path=False).sequence_logits(ids, mask, 1)
    with pytest.raises(ValueError, match="keep must be in"):
        HFRolloutEngine(model, batch_invariant=True).sequence_logits(ids, mask, 6)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 20),
    vocab=st.integers(2, 300),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_sampler_log_probs_on_the_cpu_are_the_sampler_s_and_row_invariant(rows, vocab, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(rows, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    got = sampler_log_probs(logits, tokens, temperature=temperature)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    t = temperature if temperature > 0 else 1.0
    oracle = torch.log_softmax(logits.double() / t, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-5)
    i = int(torch.randint(0, rows, (1,), generator=gen))
    assert torch.equal(
        sampler_log_probs(logits[i : i + 1], tokens[i : i + 1], temperature=temperature), got[i : i + 1]
    )


# ----- CUDA ---------------------------------------------------------------------------------------------------


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ppo_core_decode import fused_sampling

    if fused_sampling.triton is None:
        pytest.skip("needs Triton")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_sequence_log_probs_are_the_rollout_log_probs(kind, temperature):
    _cuda()
    from ppo_core_decode.hf import HFRolloutEngine

    model = _model(kind, torch.bfloat16, "cuda", vocab=5000)
    config = SamplingConfig(
        max_new_tokens=40, temperature=temperature, eos_token_id=EOS, batch_invariant=True
    )
    engine = HFRolloutEngine(model, batch_invariant=True)  # CUDA graphs, as the workers sample
    ids, mask = _prompts(48, 30, seed=1, device="cuda")
    out = engine.generate(ids, mask, config, generator=torch.Generator(device="cuda").manual_seed(2))
    valid = out["response_mask"].bool()
    for rows in (slice(0, 48), slice(3, 4), slice(10, 27)):
        exact = sequence_log_probs(
            engine,
            out["input_ids"][rows],
            out["attention_mask"][rows],
            out["responses"][rows],
            temperature=temperature,
        )
        assert torch.equal(exact[valid[rows]], out["rollout_log_probs"][rows][valid[rows]]), rows
