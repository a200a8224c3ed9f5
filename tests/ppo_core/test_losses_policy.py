"""Every registered policy loss against its float64 loop oracle, plus invariants shared by all of them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.losses import LOSS_AGG_MODES, PolicyLossConfig, get_policy_loss, policy_loss_names
from ppo_core.testing import loss_oracles as oracles
from ppo_core.testing.loss_oracles import PolicyLossInputs, policy_loss_inputs

# loss name -> (oracle, PolicyLossConfig attributes it takes: (oracle keyword, config attribute))
_CLIP = (("clip_ratio_low", "eps_low"), ("clip_ratio_high", "eps_high"))
ORACLES = {
    "vanilla": (oracles.vanilla_policy_loss_oracle, (*_CLIP, ("clip_ratio_c", "clip_ratio_c"))),
    "gpg": (oracles.gpg_policy_loss_oracle, ()),
    "sapo": (oracles.sapo_policy_loss_oracle, (("tau_pos", "tau_pos"), ("tau_neg", "tau_neg"))),
    "cispo": (oracles.cispo_policy_loss_oracle, _CLIP),
    "dppo_tv": (oracles.dppo_tv_policy_loss_oracle, (*_CLIP, ("clip_ratio_c", "clip_ratio_c"))),
    "dppo_kl": (oracles.dppo_kl_policy_loss_oracle, (*_CLIP, ("clip_ratio_c", "clip_ratio_c"))),
    "gspo": (oracles.gspo_policy_loss_oracle, _CLIP),
    "geo_mean": (oracles.geo_mean_policy_loss_oracle, _CLIP),
    "clip_cov": (
        oracles.clip_cov_policy_loss_oracle,
        (*_CLIP, *((k, k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))),
    ),
    "kl_cov": (
        oracles.kl_cov_policy_loss_oracle,
        (("kl_cov_ratio", "kl_cov_ratio"), ("ppo_kl_coef", "ppo_kl_coef")),
    ),
    "dro": (oracles.dro_policy_loss_oracle, (("dro_beta", "dro_beta"),)),
}
# Losses whose per-token terms depend only on their own row: micro-batching cannot change them.
ROW_LOCAL = sorted(set(ORACLES) - {"clip_cov", "kl_cov"})
SEED = 1234


def test_every_verl_loss_is_registered_and_has_an_oracle():
    assert set(policy_loss_names()) >= set(ORACLES)
    assert set(ORACLES) == {
        "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro",
    }  # fmt: skip


@st.composite
def configs(draw: st.DrawFn) -> PolicyLossConfig:
    maybe = st.one_of(st.none(), st.sampled_from([0.05, 0.2, 0.28, 0.5]))
    return PolicyLossConfig(
        clip_ratio=draw(st.sampled_from([0.1, 0.2, 0.3])),
        clip_ratio_low=draw(maybe),
        clip_ratio_high=draw(maybe),
        clip_ratio_c=draw(st.sampled_from([1.1, 3.0, 10.0, None])),
        tau_pos=draw(st.sampled_from([0.5, 1.0])),
        tau_neg=draw(st.sampled_from([1.05, 2.0])),
        clip_cov_ratio=draw(st.sampled_from([2e-4, 0.2, 1.0])),
        clip_cov_lb=draw(st.sampled_from([-1.0, 0.0, 1.0])),
        clip_cov_ub=draw(st.sampled_from([1.5, 5.0])),
        kl_cov_ratio=draw(st.sampled_from([0.0, 2e-4, 0.3])),
        ppo_kl_coef=draw(st.sampled_from([0.1, 1.0])),
        dro_beta=draw(st.sampled_from([0.01, 0.3, 5.0])),
    )


@st.composite
def agg_kwargs(draw: st.DrawFn, inputs: PolicyLossInputs) -> dict:
    mode = draw(st.sampled_from(LOSS_AGG_MODES))
    mask = inputs.response_mask
    kwargs: dict = {"loss_agg_mode": mode}
    if mode == "seq-mean-token-sum-norm":
        kwargs["loss_scale_factor"] = float(draw(st.integers(1, 20)))
    if draw(st.booleans()):
        kwargs |= {
            "dp_size": draw(st.integers(1, 3)),
            "batch_num_tokens": int(mask.sum()) + draw(st.integers(0, 5)),
            "global_batch_size": mask.shape[0] + draw(st.integers(0, 3)),
        }
    return kwargs


def _with_beta(config: PolicyLossConfig) -> PolicyLossConfig:
    """dro needs its β (the default config has none); the other losses ignore it."""
    return config if config.dro_beta is not None else dataclasses.replace(config, dro_beta=0.3)


def _call(name, inputs: PolicyLossInputs, config: PolicyLossConfig, **kwargs):
    config = _with_beta(config)
    return get_policy_loss(name)(
        inputs.old_log_prob,
        inputs.log_prob,
        inputs.advantages,
        inputs.response_mask,
        config=config,
        rollout_is_weights=inputs.rollout_is_weights,
        generator=torch.Generator().manual_seed(SEED),
        **kwargs,
    )


def _oracle(name, inputs: PolicyLossInputs, config: PolicyLossConfig, **kwargs):
    fn, keys = ORACLES[name]
    extra = {kw: getattr(_with_beta(config), attr) for kw, attr in keys}
    if name == "clip_cov":
        extra["generator"] = torch.Generator().manual_seed(SEED)
    return fn(
        inputs.old_log_prob,
        inputs.log_prob,
        inputs.advantages,
        inputs.response_mask,
        rollout_is_weights=inputs.rollout_is_weights,
        **extra,
        **kwargs,
    )


@pytest.mark.parametrize("name", sorted(ORACLES))
@settings(max_examples=50)
@given(data=st.data())
def test_policy_loss_matches_oracle(name, data):
    inputs = data.draw(policy_loss_inputs())
    config = data.draw(configs())
    kwargs = data.draw(agg_kwargs(inputs))
    loss, metrics = _call(name, inputs, config, **kwargs)
    expected_loss, expected_metrics = _oracle(name, inputs, config, **kwargs)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert math.isclose(float(loss), expected_loss, rel_tol=1e-9, abs_tol=1e-10), (float(loss), expected_loss)
    assert set(expected_metrics) <= set(metrics)
    for key, value in expected_metrics.items():
        assert metrics[key].dim() == 0 and not metrics[key].requires_grad
        assert math.isclose(float(metrics[key]), value, rel_tol=1e-9, abs_tol=1e-10), key


METRIC_KEYS = {
    "vanilla": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "gpg": {"ppo_kl"},
    "sapo": {"ppo_kl"},
    "cispo": {"pg_clipfrac", "ppo_kl"},
    "dppo_tv": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "dppo_kl": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "gspo": {"pg_clipfrac", "ppo_kl"},
    "geo_mean": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "clip_cov": {"pg_clipfrac", "ppo_kl"},
    "kl_cov": {"ppo_kl", "ppo_kl_abs"},
    "dro": {"ppo_kl"},
}


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_metric_names(name):
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    _, metrics = _call(
        name, PolicyLossInputs(lp, lp - 0.1, torch.ones(1, 3), torch.ones(1, 3)), PolicyLossConfig()
    )
    assert set(metrics) == METRIC_KEYS[name]


def _poison(t: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -7.0], dtype=t.dtype)
    picks = junk[torch.randint(0, len(junk), t.shape, generator=gen)]
    return torch.where(mask, t, picks)


@pytest.mark.parametrize("name", sorted(ORACLES))
@settings(max_examples=25)
@given(inputs=policy_loss_inputs(), seed=st.integers(0, 2**31 - 1))
def test_padding_values_never_change_loss_metrics_or_gradient(name, inputs, seed):
    mask = inputs.response_mask
    clean_new = inputs.log_prob.clone().requires_grad_(True)
    loss, metrics = _call(
        name, PolicyLossInputs(**{**vars(inputs), "log_prob": clean_new}), PolicyLossConfig()
    )
    (grad,) = torch.autograd.grad(loss, clean_new)

    gen = torch.Generator().manual_seed(seed)
    weights = inputs.rollout_is_weights
    dirty = PolicyLossInputs(
        old_log_prob=_poison(inputs.old_log_prob, mask, gen),
        log_prob=_poison(inputs.log_prob, mask, gen).requires_grad_(True),
        advantages=_poison(inputs.advantages, mask, gen),
        response_mask=mask,
        rollout_is_weights=None if weights is None else _poison(weights, mask, gen),
    )
    dirty_loss, dirty_metrics = _call(name, dirty, PolicyLossConfig())
    (dirty_grad,) = torch.autograd.grad(dirty_loss, dirty.log_prob)
    assert torch.equal(dirty_loss, loss)
    assert torch.equal(dirty_grad, grad)
    assert torch.all(dirty_grad[~mask] == 0)
    for key in metrics:
        assert torch.equal(dirty_metrics[key], metrics[key]), key


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_all_masked_batch_gives_zero_loss_and_finite_gradient(name):
    new = torch.full((3, 4), -1.0, requires_grad=True)
    inputs = PolicyLossInputs(torch.full((3, 4), float("nan")), new, torch.ones(3, 4), torch.zeros(3, 4))
    for mode in LOSS_AGG_MODES:
        factor = 4.0 if mode == "seq-mean-token-sum-norm" else None
        loss, metrics = _call(name, inputs, PolicyLossConfig(), loss_agg_mode=mode, loss_scale_factor=factor)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.equal(grad, torch.zeros(3, 4))
        assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("name", ROW_LOCAL)
@settings(max_examples=25)
@given(data=st.data())
def test_micro_batch_losses_sum_to_the_mini_batch_loss(name, data):
    inputs = data.draw(policy_loss_inputs(max_batch=10))
    mode = data.draw(st.sampled_from(LOSS_AGG_MODES))
    n_rows = inputs.response_mask.shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(n_rows - 1, 1)), max_size=3))) - {n_rows})
    glob = {
        "loss_agg_mode": mode,
        "loss_scale_factor": 16.0 if mode == "seq-mean-token-sum-norm" else None,
        "batch_num_tokens": int(inputs.response_mask.sum()),
        "global_batch_size": n_rows,
    }
    full, _ = _call(name, inputs, PolicyLossConfig(), **glob)
    total = 0.0
    for start, stop in zip([0, *cuts], [*cuts, n_rows], strict=True):
        part = PolicyLossInputs(**{k: None if v is None else v[start:stop] for k, v in vars(inputs).items()})
        total = total + _call(name, part, PolicyLossConfig(), **glob)[0]
    assert torch.allclose(torch.as_tensor(total, dtype=full.dtype), full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ORACLES))
@pytest.mark.parametrize("delta", [100.0, -100.0])
def test_huge_log_ratio_gives_finite_loss_and_gradient(name, delta):
    old = torch.full((2, 3), -50.0, dtype=torch.float32) if delta > 0 else torch.full((2, 3), -0.01)
    new = (old + delta).clamp(max=0.0) if delta > 0 else old + delta
    new = new.detach().requires_grad_(True)
    for adv in (1.0, -1.0):
        loss, metrics = _call(name, PolicyLossInputs(old, new, torch.full((2, 3), adv), torch.ones(2, 3)),
                              PolicyLossConfig(clip_cov_lb=-10.0))  # fmt: skip
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


# kl_cov is left out: its top-k selection ties for two valid tokens (their covariances are equal), so a finite
# difference can move the penalty between tokens; its gradient is pinned in test_losses_policy_edge_cases.py.
@pytest.mark.parametrize("name", ["vanilla", "gpg", "sapo", "geo_mean", "clip_cov", "dro"])
@settings(max_examples=10)
@given(inputs=policy_loss_inputs(max_batch=4, max_len=5), mode=st.sampled_from(LOSS_AGG_MODES))
def test_gradient_matches_finite_differences(name, inputs, mode):
    """For losses whose gradient is the derivative of their value (no stop-gradient tricks)."""
    config = PolicyLossConfig(clip_cov_lb=-10.0, clip_cov_ratio=0.3, kl_cov_ratio=0.3)

    def fn(new: torch.Tensor) -> torch.Tensor:
        args = PolicyLossInputs(**{**vars(inputs), "log_prob": new})
        return _call(name, args, config, loss_agg_mode=mode, loss_scale_factor=7.0)[0]

    assert torch.autograd.gradcheck(fn, (inputs.log_prob.clone().requires_grad_(True),), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_float32_agrees_with_float64(name):
    gen = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(6, 9, 5, generator=gen, dtype=torch.float64), -1)[..., 0]
    new = old + 0.05 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    new = new.clamp(max=0.0)
    adv = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=gen) < 0.8
    ref, _ = _call(name, PolicyLossInputs(old, new, adv, mask), PolicyLossConfig())
    low, _ = _call(name, PolicyLossInputs(old.float(), new.float(), adv.float(), mask), PolicyLossConfig())
    assert low.dtype == torch.float32
    assert math.isclose(float(low), float(ref), rel_tol=1e-4, abs_tol=1e-5)
