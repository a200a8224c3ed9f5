"""Policy-loss edge cases and their gradients: dual clip, log-ratio clamp, which losses honour ``loss_agg_mode``,
clip-bound defaults, dppo truncation, kl_cov metrics and clip_cov randomness. Where the behaviour differs from
verl, ``docs/semantics.md`` says how and why."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import (
    LOG_RATIO_CLAMP,
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_tv_policy_loss,
    geo_mean_policy_loss,
    get_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)
from ppo_core.testing.loss_oracles import policy_loss_inputs


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


def test_dual_clip_reference_example():
    ratio = [0.5, 1.0, 1.5, 5.0, 0.5, 5.0]
    adv = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    eps, c = 0.2, 3.0
    # Derivation token by token: L1 = -A r, L2 = -A clip(r, 0.8, 1.2), Lc = max, dual clip min(Lc, -A c) if A < 0.
    expected, clipped, lower, active = [], [], [], []
    for r, a in zip(ratio, adv, strict=True):
        l1, l2 = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
        lc = max(l1, l2)
        value = min(lc, -a * c) if a < 0 else lc
        expected.append(value)
        clipped.append(l2 > l1)
        lower.append(a < 0 and lc > -a * c)
        active.append(value == l1)  # the loss still depends on r
    assert expected == pytest.approx([-0.5, -1.0, -1.2, -1.2, 0.8, 3.0])
    assert sum(clipped) / 6 == 0.5 and sum(lower) / 6 == pytest.approx(1 / 6)

    old = torch.zeros(1, 6, dtype=torch.float64)
    new = torch.log(torch.tensor([ratio], dtype=torch.float64)).requires_grad_(True)
    loss, metrics = vanilla_policy_loss(
        old, new, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 6), loss_agg_mode="token-sum"
    )
    assert loss.item() == pytest.approx(sum(expected)) and loss.item() == pytest.approx(-0.1)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    # d(-A r)/d log_prob = -A r on the active tokens (the first two), exactly 0 elsewhere
    expected_grad = [-a * r if act else 0.0 for r, a, act in zip(ratio, adv, active, strict=True)]
    assert _grad(loss, new).tolist()[0] == pytest.approx(expected_grad)
    assert expected_grad[2:] == [0.0] * 4


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5, -3.0])
def test_clip_ratio_c_must_exceed_one(clip_ratio_c):
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=clip_ratio_c)


@settings(max_examples=50)
@given(
    inputs=policy_loss_inputs(), eps=st.sampled_from([0.1, 0.2, 0.3]), mode=st.sampled_from(LOSS_AGG_MODES)
)
def test_dual_clip_off_is_the_plain_clipped_surrogate(inputs, eps, mode):
    """``clip_ratio_c=None``: ``max(−A·r, −A·clip(r))`` on every token, negative advantages included (value and
    gradient), and no token counts as dual-clipped."""
    config = PolicyLossConfig(clip_ratio=eps, clip_ratio_c=None)
    new = inputs.log_prob.clone().requires_grad_(True)
    agg = {"loss_agg_mode": mode, "loss_scale_factor": 7.0}
    loss, metrics = vanilla_policy_loss(
        inputs.old_log_prob, new, inputs.advantages, inputs.response_mask, config=config,
        rollout_is_weights=inputs.rollout_is_weights, **agg,
    )  # fmt: skip
    ref = inputs.log_prob.clone().requires_grad_(True)
    r = torch.exp((ref - inputs.old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a = inputs.advantages
    surrogate = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps))
    if inputs.rollout_is_weights is not None:
        surrogate = surrogate * inputs.rollout_is_weights
    expected = agg_loss(surrogate, inputs.response_mask, mode, loss_scale_factor=7.0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_grad(loss, new), _grad(expected, ref), rtol=1e-12, atol=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_dual_clip_off_leaves_large_ratios_of_negative_advantages_unbounded():
    """r = 5, A = −1: the default dual clip caps the loss at c = 3; with None it is 5 (gradient 5, not 0)."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(5.0), dtype=torch.float64, requires_grad=True)
    adv = -torch.ones(1, 1, dtype=torch.float64)
    capped, _ = vanilla_policy_loss(old, new, adv, torch.ones(1, 1))
    off, metrics = vanilla_policy_loss(old, new, adv, torch.ones(1, 1), config={"clip_ratio_c": None})
    assert (capped.item(), off.item()) == (pytest.approx(3.0), pytest.approx(5.0))
    assert (_grad(capped, new).item(), _grad(off, new).item()) == (0.0, pytest.approx(5.0))
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_dppo_without_clip_ratio_c_does_not_truncate():
    old = torch.log(torch.tensor([[0.05]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.3]], dtype=torch.float64)).requires_grad_(True)
    loss, metrics = dppo_tv_policy_loss(
        old, new, -torch.ones(1, 1), torch.ones(1, 1), config={"clip_ratio_c": None}
    )
    assert loss.item() == pytest.approx(6.0 * math.log(0.3))
    assert metrics["pg_clipfrac_lower"].item() == 0.0


@settings(max_examples=50)
@given(inputs=policy_loss_inputs(with_is_weights=False), eps=st.sampled_from([0.1, 0.2, 0.3]))
def test_vanilla_gradient_is_exactly_zero_on_clipped_tokens(inputs, eps):
    config = PolicyLossConfig(clip_ratio=eps)
    new = inputs.log_prob.clone().requires_grad_(True)
    loss, _ = vanilla_policy_loss(
        inputs.old_log_prob,
        new,
        inputs.advantages,
        inputs.response_mask,
        config=config,
        loss_agg_mode="token-sum",
    )
    r = torch.exp(inputs.log_prob - inputs.old_log_prob)
    a = inputs.advantages
    l1, l2 = -a * r, -a * r.clamp(1 - eps, 1 + eps)
    unclipped = (l1 >= l2) & ~((a < 0) & (l1 > -a * config.clip_ratio_c))
    expected = torch.where(unclipped & inputs.response_mask, -a * r, torch.zeros_like(r))
    assert torch.allclose(_grad(loss, new), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name", ["vanilla", "cispo", "sapo", "dppo_tv", "dppo_kl", "gspo", "kl_cov", "clip_cov"]
)
def test_log_ratio_is_clamped_at_20(name):
    """Δ = 100 gives exactly the loss of Δ = 20 (the clamp), and a finite gradient."""
    fn = get_policy_loss(name)
    old = torch.full((1, 2), -120.0, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    kwargs = {"config": PolicyLossConfig(clip_cov_lb=-100.0), "generator": torch.Generator().manual_seed(0)}
    at_clamp, _ = fn(old, old + LOG_RATIO_CLAMP, adv, torch.ones(1, 2), **kwargs)
    kwargs["generator"] = torch.Generator().manual_seed(0)
    new = (old + 100.0).requires_grad_(True)
    huge, _ = fn(old, new, adv, torch.ones(1, 2), **kwargs)
    if name in ("dppo_tv", "dppo_kl", "cispo", "gspo"):
        # the loss value also depends on log_prob itself, not only on the ratio
        assert torch.isfinite(huge)
    else:
        assert huge.item() == pytest.approx(at_clamp.item())
    assert torch.isfinite(_grad(huge, new)).all()
    if name == "kl_cov":  # −A·r is unclipped here: the clamp is what keeps it at e^20 instead of e^100 = inf
        assert at_clamp.item() == pytest.approx((math.exp(20) + 0.5 * math.exp(20)) / 2 + 0.1 * 20 / 2)


def _rows_of_different_lengths():
    old = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.5, 0.4, 0.1, 0.1]], dtype=torch.float64))
    new = old + torch.tensor([[0.05, -0.02, 0.01, 0.03], [0.02, 0.04, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    return old, new, adv, mask


@pytest.mark.parametrize("fn", [gspo_policy_loss, sapo_policy_loss])
def test_gspo_and_sapo_honour_loss_agg_mode(fn):
    old, new, adv, mask = _rows_of_different_lengths()
    config = PolicyLossConfig(clip_ratio=0.5)
    token_mean, _ = fn(old, new, adv, mask, config=config, loss_agg_mode="token-mean")
    seq_mean, _ = fn(old, new, adv, mask, config=config, loss_agg_mode="seq-mean-token-mean")
    token_sum, _ = fn(old, new, adv, mask, config=config, loss_agg_mode="token-sum")
    # both rows unclipped here: the per-token loss is −A·s (gspo) or −A·gate (sapo); token-sum / 6 = token-mean
    assert token_mean.item() == pytest.approx(token_sum.item() / 6)
    assert seq_mean.item() != pytest.approx(token_mean.item())
    per_token_sum = token_sum.item()
    assert abs(per_token_sum) > 0
    # the default mode comes from the config
    via_config, _ = fn(
        old, new, adv, mask, config=PolicyLossConfig(clip_ratio=0.5, loss_agg_mode="token-sum")
    )
    assert via_config.item() == pytest.approx(per_token_sum)


def test_geo_mean_ignores_loss_agg_mode_and_token_count():
    old, new, adv, mask = _rows_of_different_lengths()
    losses = []
    for mode in LOSS_AGG_MODES:
        loss, _ = geo_mean_policy_loss(old, new, adv, mask, loss_agg_mode=mode, loss_scale_factor=3.0,
                                       batch_num_tokens=99)  # fmt: skip
        losses.append(loss.item())
    assert losses == pytest.approx([losses[0]] * len(losses))
    # but it honours the sequence denominators: two rows locally, G = 4 rows with dp_size = 2 when given
    global_loss, _ = geo_mean_policy_loss(old, new, adv, mask, dp_size=2, global_batch_size=4)
    assert global_loss.item() == pytest.approx(losses[0] * 2 / 4 * 2)


@pytest.mark.parametrize(
    ("kwargs", "low", "high"),
    [
        ({}, 0.2, 0.2),
        ({"clip_ratio": 0.3}, 0.3, 0.3),  # verl: still [0.8, 1.2]
        ({"clip_ratio": 0.3, "clip_ratio_high": 0.28}, 0.3, 0.28),
        ({"clip_ratio_low": 0.1, "clip_ratio_high": 0.4}, 0.1, 0.4),
    ],
)
def test_clip_ratio_is_the_default_for_low_and_high(kwargs, low, high):
    config = PolicyLossConfig(**kwargs)
    assert (config.eps_low, config.eps_high) == (low, high)
    # ratios just inside and just outside each bound: clipfrac counts exactly the two outside ones
    ratios = torch.tensor(
        [[1 + high - 0.01, 1 + high + 0.01, 1 - low + 0.01, 1 - low - 0.01]], dtype=torch.float64
    )
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    _, metrics = vanilla_policy_loss(
        torch.zeros(1, 4), torch.log(ratios), adv, torch.ones(1, 4), config=config
    )
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize(("clip_ratio_c", "truncation"), [(None, 3.0), (20.0, 6.0), (1.5, 1.5)])
def test_dppo_truncates_the_ratio_at_clip_ratio_c(clip_ratio_c, truncation):
    """p: 0.05 -> 0.3 (ratio 6), A = −1: inside the TV region (p − p_old = 0.25 ≥ −0.2); weight min(6, c)."""
    config = PolicyLossConfig() if clip_ratio_c is None else PolicyLossConfig(clip_ratio_c=clip_ratio_c)
    old = torch.log(torch.tensor([[0.05]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.3]], dtype=torch.float64)).requires_grad_(True)
    loss, metrics = dppo_tv_policy_loss(old, new, -torch.ones(1, 1), torch.ones(1, 1), config=config)
    assert loss.item() == pytest.approx(truncation * math.log(0.3))
    assert _grad(loss, new).item() == pytest.approx(truncation)
    assert metrics["pg_clipfrac"].item() == 0.0
    assert metrics["pg_clipfrac_lower"].item() == (1.0 if truncation < 6.0 else 0.0)


def test_kl_cov_metrics_and_default_coefficient():
    old = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    delta = torch.tensor([[-0.5, 0.25]], dtype=torch.float64)
    new = (old + delta).requires_grad_(True)
    adv = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    loss, metrics = kl_cov_policy_loss(old, new, adv, torch.ones(1, 2), loss_agg_mode="token-sum")
    # cov = (A − mean A)(log p − mean log p): (0.5)(−0.375) < (−0.5)(0.375)? equal; tie -> the earlier token
    a_c = [0.5, -0.5]
    lp_c = [delta[0, 0].item() - delta.mean().item(), delta[0, 1].item() - delta.mean().item()]
    assert a_c[0] * lp_c[0] == pytest.approx(a_c[1] * lp_c[1])
    r = [math.exp(-0.5), math.exp(0.25)]
    expected = -1.0 * r[0] + 0.1 * 0.5 + 0.0
    assert loss.item() == pytest.approx(expected)
    assert metrics["ppo_kl"].item() == pytest.approx((0.5 - 0.25) / 2)  # signed mean(old − new)
    assert metrics["ppo_kl_abs"].item() == pytest.approx((0.5 + 0.25) / 2)  # verl's ppo_kl for this loss
    # gradient: −A·r + coef·sign(Δ) on the penalised token, −A·r = 0 on the other
    assert _grad(loss, new).tolist()[0] == pytest.approx([-r[0] - 0.1, 0.0])


def test_kl_cov_penalises_the_largest_covariances():
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[-0.1, -0.2, -0.3, -0.4]], dtype=torch.float64)
    adv = torch.tensor([[-2.0, -1.0, 1.0, 2.0]], dtype=torch.float64)
    # centred: A (−2, −1, 1, 2), log p (0.15, 0.05, −0.05, −0.15): cov (−0.3, −0.05, −0.05, −0.3); top 2 of 4 (ratio
    # 0.5): the two −0.05 tokens, 1 and 2
    config = PolicyLossConfig(kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    loss, _ = kl_cov_policy_loss(old, new, adv, torch.ones(1, 4), config=config, loss_agg_mode="token-sum")
    base = sum(
        -a * math.exp(d) for a, d in zip([-2.0, -1.0, 1.0, 2.0], [-0.1, -0.2, -0.3, -0.4], strict=True)
    )
    assert loss.item() == pytest.approx(base + 0.2 + 0.3)


def _clip_cov_inputs():
    gen = torch.Generator().manual_seed(3)
    old = torch.log_softmax(torch.randn(8, 16, 4, generator=gen, dtype=torch.float64), -1)[..., 0]
    adv = 3 * torch.randn(8, 16, generator=gen, dtype=torch.float64)
    return old, old.clone(), adv, torch.ones(8, 16)


def test_clip_cov_needs_a_generator_and_leaves_the_global_rng_alone():
    old, new, adv, mask = _clip_cov_inputs()
    config = PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=100.0)
    with pytest.raises(TypeError, match="generator"):
        clip_cov_policy_loss(old, new, adv, mask, config=config)
    state = torch.get_rng_state()
    results = {}
    for seed in range(6):
        loss, metrics = clip_cov_policy_loss(old, new, adv, mask, config=config,
                                             generator=torch.Generator().manual_seed(seed))  # fmt: skip
        again, _ = clip_cov_policy_loss(old, new, adv, mask, config=config,
                                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
        assert torch.equal(loss, again)
        # k = int(0.05 · 128) = 6 detached tokens out of the candidates
        assert metrics["pg_clipfrac"].item() == pytest.approx(6 / 128)
        results[seed] = loss.item()
    assert len(set(results.values())) > 1  # the selection is random across seeds
    assert torch.equal(torch.get_rng_state(), state)


def test_clip_cov_detached_tokens_have_zero_gradient():
    old, new, adv, mask = _clip_cov_inputs()
    new.requires_grad_(True)
    config = PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=100.0)
    loss, _ = clip_cov_policy_loss(old, new, adv, mask, config=config, loss_agg_mode="token-sum",
                                   generator=torch.Generator().manual_seed(0))  # fmt: skip
    grad = _grad(loss, new)
    # on-policy (r = 1): every kept token has gradient −A ≠ 0, the 6 detached ones exactly 0
    assert int((grad == 0).sum()) == 6
    kept = grad != 0
    assert torch.allclose(grad[kept], -adv[kept])


@settings(max_examples=50)
@given(inputs=policy_loss_inputs(with_is_weights=False))
def test_gspo_cispo_dppo_gradients_follow_their_stop_gradient_definitions(inputs):
    old, lp, adv, mask = inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask
    cfg = PolicyLossConfig()
    r = torch.exp(lp - old)
    # GSPO (token-sum): −A·s_i on tokens of unclipped rows, 0 on clipped ones
    new = lp.clone().requires_grad_(True)
    loss, _ = gspo_policy_loss(old, new, adv, mask, loss_agg_mode="token-sum")
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1, keepdim=True) / n).expand_as(lp)
    unclipped = -adv * s >= -adv * s.clamp(0.8, 1.2)
    assert torch.allclose(
        _grad(loss, new), torch.where(mask & unclipped, -adv * s, 0.0), rtol=1e-9, atol=1e-12
    )
    # CISPO: every valid token keeps the gradient −clip(r)·A
    new = lp.clone().requires_grad_(True)
    loss, _ = cispo_policy_loss(old, new, adv, mask, loss_agg_mode="token-sum")
    assert torch.allclose(_grad(loss, new), torch.where(mask, -r.clamp(0.8, 1.2) * adv, 0.0), rtol=1e-9)
    # DPPO-TV: −A·min(r, c) inside the region, 0 outside
    new = lp.clone().requires_grad_(True)
    loss, _ = dppo_tv_policy_loss(old, new, adv, mask, loss_agg_mode="token-sum")
    diff = lp.exp() - old.exp()
    valid = torch.where(adv > 0, diff <= 0.2, diff >= -0.2)
    expected = torch.where(mask & valid, -adv * r.clamp(max=cfg.clip_ratio_c), 0.0)
    assert torch.allclose(_grad(loss, new), expected, rtol=1e-9, atol=1e-12)


def test_gspo_fully_clipped_row_has_zero_gradient():
    """ε = (3e-4, 4e-4), sequence log-ratio +0.005 (also verl's behaviour): the whole row is clipped."""
    old = torch.log(torch.tensor([[0.5, 0.25, 0.125]], dtype=torch.float64))
    new = (old + 0.005).requires_grad_(True)
    config = PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    loss, metrics = gspo_policy_loss(old, new, torch.ones(1, 3), torch.ones(1, 3), config=config)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert metrics["pg_clipfrac"].item() == 1.0
    assert torch.equal(_grad(loss, new), torch.zeros(1, 3, dtype=torch.float64))


def test_sapo_gate_value_and_slope_at_ratio_one():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = sapo_policy_loss(old, new, adv, torch.ones(1, 2), loss_agg_mode="token-sum")
    # f(1) = σ(0)·4/τ = 2/τ; f'(1) = 1, so dL/dlog_prob = −A·f'(r)·r = −A
    assert loss.item() == pytest.approx(-2 / 1.0 + 2 / 1.05)
    assert _grad(loss, new).tolist()[0] == pytest.approx([-1.0, 1.0])


def test_is_weights_multiply_the_per_token_loss_and_are_not_differentiated():
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.ones(2, 3, dtype=torch.float64)
    weights = torch.tensor([[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    new = old.clone().requires_grad_(True)
    loss, _ = vanilla_policy_loss(old, new, adv, torch.ones(2, 3), rollout_is_weights=weights)
    assert loss.item() == pytest.approx(agg_loss(-weights.detach(), torch.ones(2, 3)).item())
    grad_new, grad_weights = torch.autograd.grad(loss, (new, weights), allow_unused=True)
    assert grad_weights is None
    assert torch.allclose(grad_new, -weights.detach() / 6)


@settings(max_examples=60, deadline=None)
@given(
    value=st.floats(-50.0, 50.0, allow_nan=False, width=32),
    n=st.integers(2, 40),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    masked=st.integers(0, 3),
)
def test_a_constant_advantage_has_exactly_zero_covariance(
    value: float, n: int, seed: int, dtype: torch.dtype, masked: int
):
    # In exact arithmetic every token's covariance is 0, so with clip_cov_lb = 0 (a strict bound) no token is a
    # candidate and kl_cov's top-k is the first k valid tokens. Means taken in float32 leave rounding noise of
    # either sign (150 of 266 (value, n) pairs tried), which decided both; so do float64 means of float64 values
    # (7 copies of -0.03667438052116943 average to a different number). The first ``masked`` tokens are padding.
    gen = torch.Generator().manual_seed(seed)
    value = torch.tensor(value, dtype=dtype).item() if dtype == torch.float32 else value + value / 3
    log_prob = (-torch.rand(1, n + masked, generator=gen) * 3).to(dtype)
    old = log_prob + 0.01 * torch.randn(1, n + masked, generator=gen).to(dtype)
    adv = torch.full((1, n + masked), value, dtype=dtype)
    adv[0, :masked] = 7.0  # padding: a different value, which must not enter the covariance
    mask = torch.ones(1, n + masked, dtype=torch.bool)
    mask[0, :masked] = False
    config = PolicyLossConfig(
        loss_mode="clip_cov", clip_cov_lb=0.0, clip_cov_ratio=1.0, clip_ratio_low=0.999, clip_ratio_high=10.0
    )
    _, metrics = clip_cov_policy_loss(old, log_prob, adv, mask, config=config, generator=torch.Generator())
    assert float(metrics["pg_clipfrac"]) == 0.0
    # kl_cov: all covariances tie at 0, so the earliest valid k = 1 token is penalised (a loss that differs from
    # the unpenalised one only through that token)
    config = PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=1e-9, ppo_kl_coef=1.0)
    loss, _ = kl_cov_policy_loss(old, log_prob, adv, mask, config=config, loss_agg_mode="token-mean")
    delta = (log_prob - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    valid = mask[0]
    expected = (-adv[0, valid] * delta[0, valid].exp()).mean() + delta[0, masked].abs() / n
    torch.testing.assert_close(loss, expected)
