"""The decoder's fused step: in-kernel randomness (two uniforms a row, a function of seed, step and row only; the
draw from them is the two-level inverse-CDF rule and follows softmax(logits / T)) and the recording kernel, which writes what ``StaticCacheDecoder._record``'s
PyTorch rule writes (``TRITON_INTERPRET=1`` on CPU where Triton is installed, and on CUDA under the ``gpu`` marker).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode import fused_sampling
from ppo_core_decode.decoding import ModelSpec, StaticCacheDecoder, _Sampler, _State
from ppo_core_decode.fused_sampling import (
    fused_sample,
    fused_sample_record,
    fused_sampling_uniforms,
    inverse_cdf_draw,
)

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
def test_kernel_uniforms_depend_on_seed_step_and_row_only(device, monkeypatch) -> None:
    """The same ``(seed, step)`` gives the same uniforms, also with another block size; another step, seed or row
    gives others; every value is inside (0, 1), the two columns are uniform and uncorrelated."""
    seed, rows = _scalar(1234, device), 3000
    u = fused_sampling_uniforms(seed, _scalar(5, device), rows)
    assert u.shape == (rows, 2) and u.dtype == torch.float32
    assert torch.equal(u, fused_sampling_uniforms(seed, _scalar(5, device), rows))
    assert torch.equal(u[:7], fused_sampling_uniforms(seed, _scalar(5, device), 7))
    assert bool(((u > 0) & (u < 1)).all())
    monkeypatch.setattr(fused_sampling, "BLOCK_V", 64)
    assert torch.equal(u, fused_sampling_uniforms(seed, _scalar(5, device), rows))
    other_step = fused_sampling_uniforms(seed, _scalar(6, device), rows)
    other_seed = fused_sampling_uniforms(_scalar(1235, device), _scalar(5, device), rows)
    for other in (other_step, other_seed, u.roll(1, dims=0)):
        assert float((other == u).float().mean()) < 1e-3
    flat = u.double().cpu()
    for column in (flat[:, 0], flat[:, 1]):
        assert abs(float(column.mean()) - 0.5) < 0.015 and abs(float(column.var()) - 1 / 12) < 0.006
    assert abs(float(torch.corrcoef(flat.T)[0, 1])) < 0.06
    assert fused_sampling_uniforms(seed, _scalar(5, device), 0).shape == (0, 2)


def _near_a_boundary(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, block: int
) -> torch.Tensor:
    """``[B]``: whether a row's uniforms fall within fp32 rounding of a boundary of the two-level rule (where the
    kernel, summing in another order, may choose a neighbour of what :func:`inverse_cdf_draw` chooses)."""
    x = logits.double().cpu() / temperature
    rows, vocab = x.shape
    n = -(-vocab // block)
    xb = torch.full((rows, n * block), float("-inf"), dtype=torch.float64)
    xb[:, :vocab] = x
    p = (xb - x.amax(-1, keepdim=True)).exp().view(rows, n, block)
    mass = p.sum(-1)
    edges = mass.cumsum(-1) / mass.sum(-1, keepdim=True)
    chosen, _ = inverse_cdf_draw(logits.cpu(), uniforms.cpu(), temperature, block)
    inner = p[torch.arange(rows), chosen // block]
    inner_edges = inner.cumsum(-1) / inner.sum(-1, keepdim=True)
    u = uniforms.double().cpu()
    tol = 1e-5
    return ((edges - u[:, :1]).abs() < tol).any(-1) | ((inner_edges - u[:, 1:]).abs() < tol).any(-1)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.sampled_from([1, 7, 300, 4096, 4097, 9000]),
    temperature=st.sampled_from([0.6, 1.0, 1.5]),
    scale=st.sampled_from([0.0, 1.0, 3.0, 30.0]),
    seed=st.integers(0, 2**31),
    step=st.integers(0, 2**20),
)
def test_kernel_draw_is_the_inverse_cdf_rule_on_its_uniforms(
    device, rows, vocab, temperature, scale, seed, step
) -> None:
    """In-kernel randomness draws what :func:`inverse_cdf_draw` draws from the materialised uniforms (but where they
    fall within rounding of a boundary), flat and peaked rows and vocabularies of one block, several blocks and a
    partial last block included; log-probs are ``log_softmax(logits / T)`` at the token."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(rows, vocab, generator=g)).to(device)
    seed_t, step_t = _scalar(seed, device), _scalar(step, device)
    tokens, log_probs = fused_sample(logits, None, temperature, seed=seed_t, step=step_t)
    again, _ = fused_sample(logits, None, temperature, seed=seed_t, step=step_t)
    assert torch.equal(tokens, again)
    uniforms = fused_sampling_uniforms(seed_t, step_t, rows)
    want, want_lp = inverse_cdf_draw(logits, uniforms, temperature)
    same = tokens.cpu() == want.cpu()
    assert bool((same | _near_a_boundary(logits, uniforms, temperature, fused_sampling.BLOCK_V)).all())
    ref = (logits.double().cpu() / temperature).log_softmax(-1).gather(-1, tokens.cpu()[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs.double().cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want_lp.double().cpu()[same], ref[same], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_kernel_draw_changes_with_the_step_and_is_the_rule(device, temperature) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(4, 9000, generator=g)).to(device)
    seed, step = _scalar(77, device), _scalar(2, device)
    tokens, _ = fused_sample(logits, None, temperature, seed=seed, step=step)
    want, _ = inverse_cdf_draw(logits, fused_sampling_uniforms(seed, step, 4), temperature)
    assert torch.equal(tokens, want)
    other, _ = fused_sample(logits, None, temperature, seed=seed, step=_scalar(3, device))
    assert not torch.equal(other, tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0), on purpose
def test_kernel_draw_never_takes_a_masked_entry_or_leaves_the_vocabulary(device, monkeypatch) -> None:
    """Entries at ``-inf`` (a step hook forbidding tokens) are never drawn, whichever block holds the mass and for
    uniforms at the edges of (0, 1); a row with one allowed entry always draws it; half precision logits too."""
    monkeypatch.setattr(fused_sampling, "BLOCK_V", 16)
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (3 * torch.randn(64, 100, generator=g)).to(dtype)
        logits[:, 10:90] = float("-inf")
        logits[:8, :] = float("-inf")
        logits[:8, 95] = 0.0  # one allowed entry, in the partial last block
        logits[8:16, :96] = float("-inf")  # the whole mass in the last block
        logits = logits.to(device)
        for step in range(6):
            tokens, log_probs = fused_sample(
                logits, None, 1.0, seed=_scalar(9, device), step=_scalar(step, device)
            )
            t = tokens.cpu()
            assert bool(((t < 10) | (t >= 90)).all()) and bool((t < 100).all())
            assert t[:8].tolist() == [95] * 8 and bool((t[8:16] >= 96).all())
            assert bool(torch.isfinite(log_probs).all()) and bool((log_probs[:8] == 0).all())
    with pytest.raises(ValueError, match=r"uniforms \[B, 2\].*\(2, 3\)"):
        inverse_cdf_draw(torch.zeros(2, 5), torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match=r"temperature must be > 0.*temperature 0\.0"):
        inverse_cdf_draw(torch.zeros(2, 5), torch.zeros(2, 2), 0.0)
    edge = torch.tensor([[0.0, 0.0, float("-inf")], [float("-inf"), 0.0, 0.0]])
    for u in (5.960464477539063e-08, 1 - 5.960464477539063e-08):
        tokens, _ = inverse_cdf_draw(edge, torch.full((2, 2), u), 1.0, block=2)
        assert torch.isfinite(edge.gather(-1, tokens[:, None])).all()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


LOGITS_7 = torch.tensor([1.0, 0.0, -0.5, 0.5, 1.5, -0.8, 0.2])
"""A 7-token vocabulary whose least likely token still has probability > 0.01 at T = 0.6."""


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_noise_draws_follow_the_tempered_softmax(device, monkeypatch) -> None:
    """Pearson's chi-square of the kernel's draws over a 7-token vocabulary in blocks of 2 (600 rows; a fixed seed:
    deterministic) against softmax(logits / T): below the 0.999 quantile for 6 degrees of freedom (22.46), while
    softmax(logits), the temperature ignored, is rejected (about 90 expected)."""
    monkeypatch.setattr(fused_sampling, "BLOCK_V", 2)  # four blocks: both levels of the draw
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
@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_inverse_cdf_on_the_kernel_uniforms_follows_the_tempered_softmax(device, block) -> None:
    """The same check with 30000 draws: the rule (:func:`inverse_cdf_draw`, which the kernel's draw is, see
    ``test_kernel_draw_is_the_inverse_cdf_rule_on_its_uniforms``) on 30000 rows of the kernel's uniforms, for
    every way to cut the 7 tokens into blocks."""
    temperature, draws = 0.6, 30000
    u = fused_sampling_uniforms(_scalar(5, device), _scalar(0, device), draws).cpu()
    tokens, _ = inverse_cdf_draw(LOGITS_7.expand(draws, -1), u, temperature, block)
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
