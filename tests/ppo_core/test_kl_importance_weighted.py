"""``importance_weighted_kl`` and the actor's ``kl_loss_importance_weighted``: values and gradients against a
float64 reference, the unbiasedness that motivates it (exact, by enumerating a small vocabulary), and the actor
objective with the option on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.keys import KEYS
from ppo_core.kl import importance_weighted_kl, kl_penalty
from ppo_core.losses import agg_loss, compute_policy_loss
from ppo_core.workers.config import PPOActorConfig
from ppo_core.workers.engine import LOG_PROBS
from ppo_core.workers.objectives import actor_loss


def _reference(logprob: float, old: float, ref: float) -> tuple[float, float]:
    """``r · k3`` and its derivative in ``logprob``; k3 is capped at 10 (ppo-core's k3), with zero slope there
    (the log-ratios of the test stay far inside the ±20 clamps)."""
    r = math.exp(logprob - old)
    x = ref - logprob
    k3 = math.exp(x) - x - 1
    dk3 = -math.exp(x) + 1  # d/dlogprob of exp(ref − lp) − (ref − lp) − 1
    if k3 > 10:
        k3, dk3 = 10.0, 0.0
    return r * k3, r * k3 + r * dk3


@st.composite
def triples(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.0, 0.1, 1.0, 3.0]))
    logprob = -3 * torch.rand(rows, cols, generator=gen, dtype=torch.float64)
    old = logprob + spread * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    ref = logprob + spread * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return logprob, old, ref


@given(triples())
def test_value_and_gradient_match_the_float64_reference(inputs) -> None:
    logprob, old, ref = inputs
    lp = logprob.clone().requires_grad_(True)
    out = importance_weighted_kl(kl_penalty(lp, ref, "k3"), lp, old)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    want = [
        [_reference(a, b, c) for a, b, c in zip(*rows, strict=True)]
        for rows in zip(logprob.tolist(), old.tolist(), ref.tolist(), strict=True)
    ]
    torch.testing.assert_close(
        out.detach(), torch.tensor([[v for v, _ in r] for r in want], dtype=torch.float64)
    )
    torch.testing.assert_close(grad, torch.tensor([[g for _, g in r] for r in want], dtype=torch.float64))


def test_on_policy_it_is_the_plain_estimate() -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    kl = kl_penalty(lp, lp - 0.3, "k3")
    assert torch.equal(importance_weighted_kl(kl, lp, lp), kl)


def test_it_is_unbiased_for_samples_of_the_old_policy() -> None:
    """Over every token y of a small vocabulary, weighted by pi_old(y): the weighted k3 sums to KL(pi || pi_ref)
    and so does its gradient; the unweighted k3 does not."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    old = torch.log_softmax(logits.detach() + 0.5 * torch.randn(7, generator=gen, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    logp = torch.log_softmax(logits, -1)
    k3 = kl_penalty(logp, ref, "k3")
    weighted = (old.exp() * importance_weighted_kl(k3, logp, old)).sum()
    exact = (logp.exp() * (logp - ref)).sum()
    torch.testing.assert_close(weighted, exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(weighted, logits, retain_graph=True)[0],
        torch.autograd.grad(exact, logits)[0],
        rtol=1e-10,
        atol=1e-12,
    )
    assert abs(float((old.exp() * k3).sum()) - float(exact)) > 1e-3  # without the weight: biased


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="old_logprob"):
        importance_weighted_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2))


@pytest.mark.parametrize("weighted", [False, True])
def test_actor_loss_with_the_option(weighted: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    shape = (3, 4)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, 2:] = 0
    old = -torch.rand(shape, generator=gen, dtype=torch.float64)
    micro = TensorDict(
        {
            KEYS.old_log_probs: old,
            KEYS.ref_log_probs: old + 0.2 * torch.randn(shape, generator=gen, dtype=torch.float64),
            KEYS.advantages: torch.randn(shape, generator=gen, dtype=torch.float64),
            KEYS.response_mask: mask,
        },
        batch_size=[3],
    )
    log_probs = (old + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    config = PPOActorConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_importance_weighted=weighted)
    loss, metrics = actor_loss(micro, {LOG_PROBS: log_probs}, config=config, agg={})
    pg, _ = compute_policy_loss(old, log_probs, micro[KEYS.advantages], mask, config=config.policy_loss)
    kl = kl_penalty(log_probs, micro[KEYS.ref_log_probs], "low_var_kl")
    if weighted:
        kl = torch.exp(log_probs - old) * kl
    want = pg + 0.5 * agg_loss(kl, mask, "token-mean")
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(loss, log_probs)[0],
        torch.autograd.grad(want, log_probs)[0],
        rtol=1e-12,
        atol=1e-12,
    )
    assert metrics["actor/kl_loss"] == pytest.approx(float(agg_loss(kl.detach(), mask, "token-mean")))
