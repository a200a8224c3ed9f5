"""KL estimators: values against float64 oracles, verl's examples, straight-through gradients, the exact KL."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.kl import KL_ESTIMATORS, kl_penalty
from ppo_core.testing.kl_oracles import full_kl_oracle, kl_penalty_oracle

SAMPLED = [name for name in KL_ESTIMATORS if not name.startswith("full")]
BASES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@st.composite
def logprob_pairs(
    draw: st.DrawFn, *, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` log-prob pairs, from nearby values to far apart ones (so the k3 clamps engage)."""
    batch = draw(st.integers(min_value=0, max_value=6))
    length = draw(st.integers(min_value=1, max_value=9))
    spread = draw(st.sampled_from([0.01, 0.5, 3.0, 40.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    logprob = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 5
    ref = logprob + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return logprob.to(dtype), ref.clamp(max=0.0).to(dtype)


@st.composite
def logits_pairs(draw: st.DrawFn, *, scale_max: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    batch = draw(st.integers(min_value=0, max_value=4))
    length = draw(st.integers(min_value=1, max_value=5))
    vocab = draw(st.integers(min_value=1, max_value=8))
    scale = draw(st.floats(min_value=0.1, max_value=scale_max))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    logits = scale * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64)
    ref = logits + scale * torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64)
    return logits, ref


@given(logprob_pairs(), st.sampled_from(SAMPLED))
def test_sampled_estimators_match_float64_oracle(pair: tuple, estimator: str) -> None:
    logprob, ref = pair
    out = kl_penalty(logprob, ref, estimator)
    assert out.shape == logprob.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, kl_penalty_oracle(logprob, ref, estimator), rtol=1e-12, atol=1e-12)


@given(logprob_pairs(dtype=torch.float32))
def test_k3_is_non_negative_and_bounded(pair: tuple) -> None:
    for name in ("k3", "low_var_kl", "k3+"):
        out = kl_penalty(*pair, name)
        assert bool((out >= 0).all()) and bool((out <= 10).all())


def test_verl_example_values_derived_from_the_formulas() -> None:
    """logprob=(0, -1, -30), ref=(-0.5, -1, 0): each value follows from its formula, as verl computes it."""
    logprob, ref = [0.0, -1.0, -30.0], [-0.5, -1.0, 0.0]
    deltas = [a - b for a, b in zip(logprob, ref, strict=True)]
    lp, rp = torch.tensor([logprob]), torch.tensor([ref])

    def k3(d: float) -> float:
        x = min(max(-d, -20.0), 20.0)
        return min(math.exp(x) - x - 1.0, 10.0)

    torch.testing.assert_close(kl_penalty(lp, rp, "k1"), torch.tensor([deltas]))
    torch.testing.assert_close(kl_penalty(lp, rp, "abs"), torch.tensor([[abs(d) for d in deltas]]))
    torch.testing.assert_close(kl_penalty(lp, rp, "k2"), torch.tensor([[0.5 * d * d for d in deltas]]))
    torch.testing.assert_close(kl_penalty(lp, rp, "k3"), torch.tensor([[k3(d) for d in deltas]]))
    assert kl_penalty(lp, rp, "k3")[0, 2].item() == 10.0  # clamped


@pytest.mark.parametrize("alias", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases_are_identical(alias: tuple) -> None:
    lp, rp = torch.tensor([[0.0, -2.0, -30.0]]), torch.tensor([[-0.5, -1.0, 0.0]])
    assert torch.equal(kl_penalty(lp, rp, alias[0]), kl_penalty(lp, rp, alias[1]))
    assert torch.equal(kl_penalty(lp, rp, alias[0] + "+"), kl_penalty(lp, rp, alias[1] + "+"))


@given(logprob_pairs(dtype=torch.float32), st.sampled_from(BASES))
def test_straight_through_value_of_base_gradient_of_k2(pair: tuple, base: str) -> None:
    logprob = pair[0].clone().requires_grad_(True)
    ref = pair[1]
    st_out = kl_penalty(logprob, ref, base + "+")
    assert torch.equal(st_out.detach(), kl_penalty(pair[0], ref, base))
    (grad,) = torch.autograd.grad(st_out.sum(), logprob)
    torch.testing.assert_close(grad, (pair[0] - ref), rtol=1e-6, atol=1e-6)


@given(logprob_pairs())
def test_k3_gradient_is_one_minus_ratio_and_zero_when_clamped(pair: tuple) -> None:
    logprob = pair[0].clone().requires_grad_(True)
    out = kl_penalty(logprob, pair[1], "k3")
    (grad,) = torch.autograd.grad(out.sum(), logprob)
    delta = pair[0] - pair[1]
    clamped = (delta.abs() > 20) | (out.detach() >= 10)
    expected = torch.where(clamped, torch.zeros_like(delta), 1 - torch.exp(-delta))
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)


def test_clamped_k3_and_its_straight_through_variant() -> None:
    logprob = torch.tensor([[-30.0]], requires_grad=True)
    ref = torch.tensor([[0.0]])
    value = kl_penalty(logprob, ref, "k3")
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    assert value.item() == 10.0 and grad.item() == 0.0
    value = kl_penalty(logprob, ref, "k3+")
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    assert value.item() == 10.0 and grad.item() == -30.0
    lp, rp = torch.tensor([[0.3, -2.0]]), torch.tensor([[-1.0, 0.0]])
    assert torch.equal(kl_penalty(lp, rp, "k2+"), kl_penalty(lp, rp, "k2"))


@given(logits_pairs())
def test_full_matches_float64_sum_over_vocabulary(pair: tuple) -> None:
    logits, ref_logits = pair
    logprob = torch.zeros(logits.shape[:-1], dtype=torch.float64)
    out = kl_penalty(logprob, logprob, "full", logits=logits, ref_logits=ref_logits, chunk_size=3)
    expected = full_kl_oracle(logits, ref_logits)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert bool((out >= -1e-12).all())


@given(logits_pairs(scale_max=2.0))
def test_full_is_the_expectation_of_k1_and_k3_under_the_policy(pair: tuple) -> None:
    """KL(pi || pi_ref) = E_{y~pi}[k1(y)] = E_{y~pi}[k3(y)]: both sampled estimators are unbiased."""
    logits, ref_logits = pair
    vocab = logits.shape[-1]
    logp_all = torch.log_softmax(logits, -1)
    logq_all = torch.log_softmax(ref_logits, -1)
    full = kl_penalty(logp_all[..., 0], logq_all[..., 0], "full", logits=logits, ref_logits=ref_logits)
    p = logp_all.exp()
    k1, k3 = (
        torch.stack([kl_penalty(logp_all[..., v], logq_all[..., v], name) for v in range(vocab)], -1)
        for name in ("k1", "k3")
    )
    torch.testing.assert_close((p * k1).sum(-1), full, rtol=1e-9, atol=1e-12)
    # k3 is unbiased only where verl's clamp at 10 is inactive
    unclamped = (k3 < 10).all(-1)
    torch.testing.assert_close((p * k3).sum(-1)[unclamped], full[unclamped], rtol=1e-9, atol=1e-12)


@given(logits_pairs())
def test_full_gradients_match_naive_autograd(pair: tuple) -> None:
    logits = pair[0].clone().requires_grad_(True)
    ref_logits = pair[1].clone().requires_grad_(True)
    weights = torch.linspace(-1, 2, logits.shape[:-1].numel(), dtype=torch.float64).reshape(logits.shape[:-1])
    lp = torch.zeros(logits.shape[:-1], dtype=torch.float64)
    out = kl_penalty(lp, lp, "full", logits=logits, ref_logits=ref_logits, chunk_size=2)
    grads = torch.autograd.grad((out * weights).sum(), (logits, ref_logits))
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    naive = (logp.exp() * (logp - logq)).sum(-1)
    expected = torch.autograd.grad((naive * weights).sum(), (logits, ref_logits))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_full_with_masked_vocabulary() -> None:
    """Tokens the policy forbids contribute 0; mass on a token the reference forbids gives +inf."""
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    ref_logits = torch.tensor([[[0.0, float("-inf"), float("-inf")]]])
    lp = torch.zeros(1, 1)
    assert kl_penalty(lp, lp, "full", logits=logits, ref_logits=logits).item() == 0.0
    assert kl_penalty(lp, lp, "full", logits=ref_logits, ref_logits=logits).item() == pytest.approx(
        math.log(2)
    )
    assert kl_penalty(lp, lp, "full", logits=logits, ref_logits=ref_logits).item() == float("inf")


def test_full_half_precision_is_fp32_and_full_plus_has_k2_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen).to(torch.bfloat16)
    ref_logits = torch.randn(2, 3, 5, generator=gen).to(torch.bfloat16)
    lp = torch.log_softmax(logits.float(), -1)[..., 0].requires_grad_(True)
    rp = torch.log_softmax(ref_logits.float(), -1)[..., 0]
    out = kl_penalty(lp, rp, "full+", logits=logits, ref_logits=ref_logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.detach(), full_kl_oracle(logits, ref_logits).float())
    (grad,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(grad, (lp - rp).detach())


def test_errors_name_the_argument() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="k3") as err:
        kl_penalty(lp, lp, "kl3")
    assert "low_var_kl" in str(err.value) and "kl3" in str(err.value)
    with pytest.raises(ValueError, match="ref_logprob"):
        kl_penalty(lp, torch.zeros(2, 4), "kl")
    with pytest.raises(ValueError, match="logits"):
        kl_penalty(lp, lp, "full")
    with pytest.raises(ValueError, match="logits"):
        kl_penalty(lp, lp, "full", logits=torch.zeros(2, 4, 5), ref_logits=torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="ref_logits"):
        kl_penalty(lp, lp, "full", logits=torch.zeros(2, 3, 5), ref_logits=torch.zeros(2, 3, 6))
    with pytest.raises(ValueError, match="ref_logits"):
        bad = torch.full((2, 3, 5), float("-inf"))
        kl_penalty(lp, lp, "full", logits=torch.zeros(2, 3, 5), ref_logits=bad)
    with pytest.raises(TypeError, match="logprob"):
        kl_penalty(torch.zeros(2, 3, dtype=torch.long), lp, "kl")
    with pytest.raises(TypeError, match="estimator"):
        kl_penalty(lp, lp, None)


def test_kl_penalty_names_arguments_on_other_devices():
    """As the losses do: the two log-probs on different devices is an error naming both (torch's own message names
    neither)."""
    with pytest.raises(ValueError, match="ref_logprob is on meta but logprob is on cpu"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3, device="meta"), "k1")
