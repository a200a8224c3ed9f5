"""The decoder's fused step: in-kernel noise (a function of seed, step, row and column only, uniform, and the draw
from it follows softmax(logits / T)) and the recording kernel, which writes what ``StaticCacheDecoder._record``'s
PyTorch rule writes (``TRITON_INTERPRET=1`` on CPU where Triton is installed, and on CUDA under the ``gpu`` marker).
"""

from __future__ import annotations

import os

import pytest
import torch

from ppo_core.rollout import fused_sampling
from ppo_core.rollout.decoding import ModelSpec, StaticCacheDecoder, _Sampler, _State
from ppo_core.rollout.fused_sampling import fused_sample, fused_sample_record, fused_sampling_noise

INTERPRET = fused_sampling.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and fused_sampling.triton is not None
DEVICES = (["cpu"] if INTERPRET else []) + (["cuda"] if CUDA else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _scalar(value: int, device: str) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


def _state(rows: int, width: int, device: str, pad: int) -> _State:
    """The buffers ``_record`` writes, as a decoder holds them after its prefill's reset."""
    return _State(
        key=(),
        cache=None,
        prompt_len=torch.zeros(rows, dtype=torch.long, device=device),
        t=_scalar(0, device),
        last_tok=torch.zeros(rows, dtype=torch.long, device=device),
        last_valid=torch.zeros(rows, dtype=torch.bool, device=device),
        done=torch.zeros(rows, dtype=torch.bool, device=device),
        responses=torch.full((rows, width), pad, dtype=torch.long, device=device),
        response_mask=torch.zeros(rows, width, dtype=torch.bool, device=device),
        log_probs=torch.zeros(rows, width, dtype=torch.float32, device=device),
    )


def _record_buffers(state: _State) -> dict:
    names = ("responses", "response_mask", "log_probs", "done", "last_tok", "last_valid")
    return {name: getattr(state, name) for name in names}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("eos", [None, 3])
def test_fused_record_writes_what_the_pytorch_record_writes(device, temperature, eos) -> None:
    """Step by step on the same logits and noise: tokens, pad after EOS, masks, log-probs (0 once finished),
    ``done``, the fed token and ``t`` agree; EOS is forced on some rows at some steps so that rows finish."""
    rows, width, vocab, pad = 5, 6, 4200, 9
    decoder = StaticCacheDecoder(
        lambda *a: None, ModelSpec(1, 1, 1, torch.float32, torch.device(device)), vocab, cuda_graphs=False
    )
    sample = _Sampler(temperature, 0, 1.0, eos, pad)
    torch_state, fused_state = _state(rows, width, device, pad), _state(rows, width, device, pad)
    torch_state.fused = False  # the PyTorch rule, whatever the device
    g = torch.Generator().manual_seed(int(10 * temperature) + (eos or 0))
    for t in range(width):
        logits = 3 * torch.randn(rows, vocab, generator=g)
        if eos is not None:
            logits[t % rows, eos] = 60.0  # row t % rows finishes at step t
        noise = torch.rand(rows, vocab, generator=g)
        logits, noise = logits.to(device), noise.to(device)
        torch_state.noise = noise if temperature > 0 else None
        decoder._record(torch_state, logits, sample)
        fused_sample_record(
            logits,
            temperature,
            step=fused_state.t,
            eos_token_id=eos,
            pad_token_id=pad,
            noise=noise if temperature > 0 else None,
            **_record_buffers(fused_state),
        )
        assert int(fused_state.t) == int(torch_state.t) == t + 1
        for name, want in _record_buffers(torch_state).items():
            got = getattr(fused_state, name)
            if name == "log_probs":
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, want), name
    if eos is not None:
        assert bool(torch_state.done.all()) and bool((torch_state.responses == pad).any())
    else:
        assert not bool(fused_state.done.any()) and bool(fused_state.response_mask.all())


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_noise_depends_on_seed_step_row_and_column_only(device, monkeypatch) -> None:
    """The same ``(seed, step)`` gives the same noise, also with another block size; another step, seed or row gives
    other noise; every value is inside (0, 1)."""
    seed, rows, vocab = _scalar(1234, device), 3, 4100
    u = fused_sampling_noise(seed, _scalar(5, device), rows, vocab)
    assert torch.equal(u, fused_sampling_noise(seed, _scalar(5, device), rows, vocab))
    assert bool(((u > 0) & (u < 1)).all())
    monkeypatch.setattr(fused_sampling, "BLOCK_V", 64)
    assert torch.equal(u, fused_sampling_noise(seed, _scalar(5, device), rows, vocab))
    other_step = fused_sampling_noise(seed, _scalar(6, device), rows, vocab)
    other_seed = fused_sampling_noise(_scalar(1235, device), _scalar(5, device), rows, vocab)
    for other in (other_step, other_seed, u.roll(1, dims=0)):
        assert float((other == u).float().mean()) < 1e-3
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_kernel_noise_draw_is_the_rule_on_that_noise(device, temperature) -> None:
    """In-kernel noise draws what the tensor path draws from the materialised noise; log-probs are
    ``log_softmax(logits / T)`` at the token."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(4, 9000, generator=g)).to(device)
    seed, step = _scalar(77, device), _scalar(2, device)
    tokens, log_probs = fused_sample(logits, None, temperature, seed=seed, step=step)
    again, _ = fused_sample(logits, None, temperature, seed=seed, step=step)
    noise = fused_sampling_noise(seed, step, *logits.shape)
    want, want_lp = fused_sample(logits, noise, temperature)
    assert torch.equal(tokens, again) and torch.equal(tokens, want) and torch.equal(log_probs, want_lp)
    ref = (logits.double().cpu() / temperature).log_softmax(-1).gather(-1, tokens.cpu()[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs.double().cpu(), ref, atol=1e-5, rtol=1e-5)
    other, _ = fused_sample(logits, None, temperature, seed=seed, step=_scalar(3, device))
    assert not torch.equal(other, tokens)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


LOGITS_7 = torch.tensor([1.0, 0.0, -0.5, 0.5, 1.5, -0.8, 0.2])
"""A 7-token vocabulary whose least likely token still has probability > 0.01 at T = 0.6."""


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_noise_draws_follow_the_tempered_softmax(device, monkeypatch) -> None:
    """Pearson's chi-square of the kernel's draws over a 7-token vocabulary (600 rows; a fixed seed: deterministic)
    against softmax(logits / T): below the 0.999 quantile for 6 degrees of freedom (22.46), while softmax(logits),
    the temperature ignored, is rejected (about 90 expected)."""
    monkeypatch.setattr(
        fused_sampling, "BLOCK_V", 8
    )  # the noise does not depend on it; the interpreter is faster
    temperature, rows = 0.6, 600
    batch = LOGITS_7.expand(rows, -1).contiguous().to(device)
    tokens, log_probs = fused_sample(
        batch, None, temperature, seed=_scalar(20240611, device), step=_scalar(3, device)
    )
    counts = torch.bincount(tokens.cpu(), minlength=7).double()
    want = (LOGITS_7.double() / temperature).log_softmax(-1)
    torch.testing.assert_close(log_probs.double().cpu(), want[tokens.cpu()], atol=1e-5, rtol=1e-5)
    assert _chi_square(counts, want.exp()) < 22.46
    assert _chi_square(counts, LOGITS_7.double().softmax(-1)) > 40


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_max_on_the_kernel_noise_follows_the_tempered_softmax(device) -> None:
    """The same check with 30000 draws: Gumbel-max over consecutive groups of 7 columns of the kernel's noise (the
    draw of the test above is the rule on that noise, see ``test_kernel_noise_draw_is_the_rule_on_that_noise``)."""
    temperature, draws = 0.6, 30000
    u = (
        fused_sampling_noise(_scalar(5, device), _scalar(0, device), 1, 7 * draws)
        .double()
        .cpu()
        .view(draws, 7)
    )
    tokens = (LOGITS_7.double() / temperature - torch.log(-torch.log(u))).argmax(-1)
    counts = torch.bincount(tokens, minlength=7).double()
    assert _chi_square(counts, (LOGITS_7.double() / temperature).softmax(-1)) < 22.46
    assert _chi_square(counts, LOGITS_7.double().softmax(-1)) > 1000


@pytest.mark.parametrize("device", DEVICES)
def test_recording_with_kernel_noise_is_reproducible_and_advances_the_step(device) -> None:
    g = torch.Generator().manual_seed(4)
    logits = [(2 * torch.randn(3, 300, generator=g)).to(device) for _ in range(4)]
    runs = []
    for _ in range(2):
        state = _state(3, 4, device, pad=0)
        seed = _scalar(99, device)
        for step_logits in logits:
            fused_sample_record(
                step_logits,
                1.0,
                step=state.t,
                eos_token_id=None,
                pad_token_id=0,
                seed=seed,
                **_record_buffers(state),
            )
        assert int(state.t) == 4 and bool(state.response_mask.all())
        assert torch.equal(state.last_tok, state.responses[:, -1])
        runs.append(state.responses)
    assert torch.equal(runs[0], runs[1])
    assert len({tuple(r) for r in runs[0].tolist()}) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_bad_seed_step_and_buffers_are_named(device) -> None:
    logits = torch.zeros(2, 10, device=device)
    step = _scalar(0, device)
    with pytest.raises(ValueError, match="seed"):
        fused_sample(logits, None, 1.0, seed=torch.zeros((), dtype=torch.int32, device=device), step=step)
    with pytest.raises(ValueError, match="step is required"):
        fused_sample(logits, None, 1.0, seed=_scalar(1, device))
    with pytest.raises(ValueError, match="not both"):
        fused_sample(logits, torch.rand(2, 10, device=device), 1.0, seed=_scalar(1, device), step=step)
    state = _state(2, 3, device, pad=0)
    buffers = {**_record_buffers(state), "response_mask": state.response_mask.long()}
    with pytest.raises(ValueError, match="response_mask"):
        fused_sample_record(
            logits, 1.0, step=step, eos_token_id=None, pad_token_id=0, seed=_scalar(1, device), **buffers
        )
