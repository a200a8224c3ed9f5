"""The fused Triton sampler draws exactly what ``sample_tokens``' PyTorch rule draws from the same logits and noise
(``TRITON_INTERPRET=1`` on CPU where Triton is installed, and on CUDA under the ``gpu`` marker)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.rollout.sampling import _draw, sample_tokens
from ppo_core_decode import fused_sampling
from ppo_core_decode.fused_sampling import (
    fused_sample,
    fused_sample_record,
    fused_sampling_available,
    fused_token_log_probs,
)

INTERPRET = fused_sampling.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and fused_sampling.triton is not None
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if CUDA else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _case(rows: int, vocab: int, seed: int, device: str, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    noise = torch.rand(rows, vocab, generator=g)
    return logits.to(device), noise.to(device)


def _reference(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float):
    """The PyTorch rule, in float64 on the CPU, with the fused path's ``x * (1 / T)``."""
    x = logits.double().cpu()
    if temperature > 0:
        x = x * (1.0 / temperature)
        score = x - torch.log(-torch.log(noise.double().cpu()))
    else:
        score = x
    tokens = score.argmax(-1)
    return tokens, x.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, 4096, 4097, 9000]),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    seed=st.integers(0, 2**16),
)
def test_fused_draw_matches_the_rule(device, rows, vocab, temperature, seed) -> None:
    """Blocks of the vocabulary (a non-multiple of the block included) combine into the row's draw."""
    logits, noise = _case(rows, vocab, seed, device)
    tokens, log_probs = fused_sample(logits, noise if temperature > 0 else None, temperature)
    want_tokens, want_lp = _reference(logits, noise, temperature)
    assert tokens.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(log_probs.double().cpu(), want_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lowest_index_across_blocks(device) -> None:
    logits = torch.zeros(2, 3 * fused_sampling.BLOCK_V, device=device)
    logits[0, [5, fused_sampling.BLOCK_V + 1, 2 * fused_sampling.BLOCK_V]] = 4.0
    logits[1, [2 * fused_sampling.BLOCK_V + 3, 2 * fused_sampling.BLOCK_V + 9]] = 4.0
    tokens, _ = fused_sample(logits, None, 0.0)
    assert tokens.tolist() == [5, 2 * fused_sampling.BLOCK_V + 3] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_read_in_fp32(device, dtype) -> None:
    logits, noise = _case(3, 5000, 7, device, dtype)
    tokens, log_probs = fused_sample(logits, noise, 1.0)
    want_tokens, want_lp = _reference(logits, noise, 1.0)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(log_probs.double().cpu(), want_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0), on purpose
def test_masked_vocabulary_and_zero_noise_are_never_drawn(device) -> None:
    logits, noise = _case(4, 300, 3, device)
    logits[:, :100] = float("-inf")  # e.g. a step hook forbidding tokens
    noise[:, 150] = 0.0  # u = 0 gives a Gumbel score of -inf
    logits[:, 150] = 50.0
    tokens, log_probs = fused_sample(logits, noise, 1.0)
    assert bool((tokens >= 100).all()) and bool((tokens != 150).all())
    assert bool(torch.isfinite(log_probs).all())


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=10, deadline=None)
@given(below=st.floats(20.0, 200.0), winner=st.integers(0, 8999), seed=st.integers(0, 2**16))
def test_the_largest_noise_cannot_lift_an_entry_far_below(device, below, winner, seed) -> None:
    """The kernel ranks by ``exp(x - m) / (-log u)``, in which an entry more than ~87 below its block's largest
    underflows to 0: it still draws what the Gumbel rule draws when such entries get the largest noise the kernel can
    make (the rule cannot lift them either), whichever block holds the largest logit."""
    logits, noise = _case(2, 9000, seed, device)
    logits = logits - below * (torch.arange(9000, device=device) % 2)  # every odd entry far below
    logits[:, winner] = 10.0
    noise[:, 1::2] = 1.0 - 2.0**-24  # the largest u: a Gumbel score of +16.6
    tokens, log_probs = fused_sample(logits, noise, 1.0)
    want_tokens, want_lp = _reference(logits, noise, 1.0)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(log_probs.double().cpu(), want_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_noise_is_named_and_no_rows_is_fine(device) -> None:
    logits, noise = _case(2, 10, 0, device)
    with pytest.raises(ValueError, match="noise"):
        fused_sample(logits, noise[:, :5], 1.0)
    tokens, log_probs = fused_sample(logits[:0], noise[:0], 1.0)
    assert tokens.shape == log_probs.shape == (0,)


def test_truncation_and_the_cpu_take_the_pytorch_rule() -> None:
    logits = torch.randn(2, 10)
    assert not fused_sampling_available(logits, 0, 1.0)  # CPU tensors: the PyTorch rule
    if CUDA:
        cuda = logits.cuda()
        assert fused_sampling_available(cuda, 0, 1.0) and fused_sampling_available(cuda, 10, 1.0)
        assert not fused_sampling_available(cuda, 3, 1.0) and not fused_sampling_available(cuda, 0, 0.9)
        assert not fused_sampling_available(cuda.double(), 0, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_tokens_on_cuda_matches_the_compiled_rule(temperature) -> None:
    """``sample_tokens`` takes the fused path on CUDA; it agrees with the PyTorch rule it replaces."""
    logits, noise = _case(64, 128256, 11, "cuda")
    tokens, log_probs = sample_tokens(logits, noise, temperature=temperature)
    want_tokens, want_lp = _draw(logits, noise if temperature > 0 else None, temperature, 0, 1.0)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(log_probs, want_lp, atol=1e-4, rtol=1e-5)


def _recorded(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and log-probs ``fused_sample_record`` writes for one step, in the decoder's mode (in-kernel
    noise when sampling)."""
    b, device = logits.shape[0], logits.device
    state = dict(
        responses=torch.zeros(b, 2, dtype=torch.long, device=device),
        response_mask=torch.zeros(b, 2, dtype=torch.bool, device=device),
        log_probs=torch.zeros(b, 2, device=device),
        done=torch.zeros(b, dtype=torch.bool, device=device),
        last_tok=torch.zeros(b, dtype=torch.long, device=device),
        last_valid=torch.zeros(b, dtype=torch.bool, device=device),
    )
    seed = torch.tensor(11, device=device) if temperature > 0 else None
    step = torch.zeros((), dtype=torch.long, device=device)
    fused_sample_record(logits, temperature, step=step, eos_token_id=None, pad_token_id=0, seed=seed, **state)
    return state["responses"][:, 0], state["log_probs"][:, 0]


@pytest.mark.parametrize(
    "device", [pytest.param(d, marks=pytest.mark.gpu) if d == "cuda" else d for d in DEVICES]
)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize(
    ("vocab", "dtype"), [(97, torch.float32), (9000, torch.bfloat16), (151_936, torch.bfloat16)]
)
def test_token_log_probs_are_what_the_decoder_records_in_any_rows(device, temperature, vocab, dtype) -> None:
    """``fused_token_log_probs`` of the drawn tokens: the recorded log-probs bit for bit, alone or among other rows
    (the training side of the exact on-policy mode)."""
    if device == "cpu" and vocab > 10_000:
        pytest.skip("the interpreter is slow on a real vocabulary")
    logits, _ = _case(37 if device == "cuda" else 5, vocab, vocab, device, dtype)
    tokens, recorded = _recorded(logits, temperature)
    got = fused_token_log_probs(logits, tokens, temperature)
    assert got.dtype == torch.float32 and torch.equal(got, recorded)
    rows = torch.tensor([3, 0, 2], device=device)
    assert torch.equal(fused_token_log_probs(logits[rows], tokens[rows], temperature), recorded[rows])
    x = logits.double().cpu() * (1.0 / temperature if temperature > 0 else 1.0)
    oracle = x.log_softmax(-1).gather(-1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(got.double().cpu(), oracle, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tokens"):
        fused_token_log_probs(logits, tokens[:1], temperature)
