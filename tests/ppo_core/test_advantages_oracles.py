"""Every advantage estimator against its slow float64 oracle, plus hand-derived examples (verl's verified numbers)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.advantages import (
    advantage_estimator_names,
    compute_gae,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
)
from ppo_core.testing import PPOBatch, ppo_batches
from ppo_core.testing.advantage_oracles import ADVANTAGE_ORACLES, advantage_inputs_from_batch

NAMES = sorted(ADVANTAGE_ORACLES)
unit = st.floats(min_value=0.0, max_value=1.0)
options = st.fixed_dictionaries(
    {
        "gamma": unit,
        "lam": unit,
        "whiten": st.booleans(),
        "norm_by_std": st.booleans(),
        "epsilon": st.sampled_from([1e-6, 1e-3, 0.0]),
        "f_norm": st.sampled_from([1.0, 2.5]),
        "alpha": st.sampled_from([None, 0.5]),
    }
)


def regroup_in_pairs(batch: PPOBatch) -> list[int]:
    """Labels that put every row in a group of 2 or 3 (grpo_passk needs >= 2); requires ``B >= 2``."""
    b = batch.batch_size
    labels = [i // 2 for i in range(b)]
    if b % 2:
        labels[-1] = labels[-2]
    return labels


def _inputs(name: str, batch: PPOBatch, opts: dict) -> dict:
    kwargs = advantage_inputs_from_batch(batch, **opts)
    if name == "grpo_passk":
        kwargs["index"] = regroup_in_pairs(batch)
    return kwargs


def test_oracles_cover_every_builtin_name() -> None:
    assert set(NAMES) <= set(advantage_estimator_names())
    assert len(NAMES) == 9


def _whitening_is_ill_conditioned(name: str, kwargs: dict, atol: float) -> bool:
    """True when whitening amplifies input rounding beyond ``atol`` (raw values nearly constant on the mask).

    Whitening divides by the spread of the raw advantages: its output error is about
    ``eps(dtype) * T * max|raw| / std(raw)``. Such inputs are compared on returns and finiteness only. Equal raw
    values are not: both sides whiten them to exactly 0 (tested for equality, as ``std`` of equal floats can be
    rounding noise instead of 0).
    """
    if name == "gae" and kwargs["whiten"]:
        raw = ADVANTAGE_ORACLES[name](**{**kwargs, "whiten": False})[0]
    elif name == "reinforce_plus_plus":
        raw = ADVANTAGE_ORACLES[name](**kwargs)[1]
    elif name == "reinforce_plus_plus_baseline":
        raw = ADVANTAGE_ORACLES["grpo"](**{**kwargs, "norm_by_std": False})[0]
    else:
        return False
    rewards = kwargs["token_level_rewards"]
    valid = raw[kwargs["response_mask"].cpu().bool()]
    if valid.numel() < 2 or bool((valid == valid[0]).all()):
        return False
    amplification = float(valid.abs().max()) / float(valid.std())
    return amplification * torch.finfo(rewards.dtype).eps * 10 * max(rewards.shape[1], 1) > atol


def _check_every_estimator(batch: PPOBatch, opts: dict, dtype: torch.dtype, atol: float, rtol: float) -> None:
    for name in NAMES:
        kwargs = _inputs(name, batch, opts)
        adv, ret = get_advantage_estimator(name)(**kwargs)
        oracle_adv, oracle_ret = ADVANTAGE_ORACLES[name](**kwargs)
        assert adv.shape == ret.shape == batch.response_mask.shape, name
        assert adv.dtype == ret.dtype == dtype, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        pairs = [("returns", ret, oracle_ret)]
        if not _whitening_is_ill_conditioned(name, kwargs, atol):
            pairs.append(("advantages", adv, oracle_adv))
        for label, fast, slow in pairs:
            # torch.allclose is ~50x cheaper than assert_close; the latter only reports the failure
            if not torch.allclose(fast.double().cpu(), slow, atol=atol, rtol=rtol):
                torch.testing.assert_close(
                    fast.double().cpu(),
                    slow,
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, n=name, k=label: f"{n} {k}: {m}",
                )


@given(batch=ppo_batches(dtype=torch.float64, min_batch=2, max_batch=10, max_len=12), opts=options)
def test_fast_matches_oracle_float64(batch: PPOBatch, opts: dict) -> None:
    _check_every_estimator(batch, opts, torch.float64, atol=1e-9, rtol=0)


@given(
    batch=ppo_batches(dtype=torch.float32, min_batch=2, max_batch=10, max_len=12, dense_rewards=True),
    opts=options,
)
def test_fast_float32_matches_oracle(batch: PPOBatch, opts: dict) -> None:
    # epsilon 0 would make float32 rounding in near-tied groups unbounded
    _check_every_estimator(batch, {**opts, "epsilon": 1e-6}, torch.float32, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_valid", [3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_whitened_values_match_the_oracle_exactly(dtype: torch.dtype, n_valid: int) -> None:
    """What a property test found: REINFORCE++-baseline, a group of three rows of which only the first has valid
    tokens, so the values whitened are one score at every valid token. Zero spread is not ill-conditioned (the
    advantages are compared), and the fast path and the oracle both give exactly 0; so do GAE and REINFORCE++
    (``gamma = 0``: what they whiten is the rewards)."""
    rewards = torch.full((3, 7), 1 / 3, dtype=dtype)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, :n_valid] = True
    kwargs = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": ["g"] * 3,
        "values": torch.zeros_like(rewards),
        "gamma": 0.0,
        "lam": 0.5,
        "whiten": True,
    }
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert not _whitening_is_ill_conditioned(name, kwargs, atol=1e-4), name
        for adv in (get_advantage_estimator(name)(**kwargs)[0], ADVANTAGE_ORACLES[name](**kwargs)[0]):
            assert torch.equal(adv, torch.zeros_like(adv)), (name, adv)


# ---- hand-derived examples; each comment shows the derivation -------------------------------------------------


def test_gae_example_by_hand() -> None:
    # gamma = 0.5, lam = 0.5, V = (1, 2), r = (0, 4): delta_1 = 4 - 2 = 2, A_1 = 2;
    # delta_0 = 0 + 0.5 * 2 - 1 = 0, A_0 = 0 + 0.25 * 2 = 0.5; returns = A + V = (1.5, 4)
    adv, ret = compute_gae(
        torch.tensor([[0.0, 4.0]]),
        torch.tensor([[1.0, 2.0]]),
        torch.ones(1, 2),
        gamma=0.5,
        lam=0.5,
        whiten=False,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.5, 2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 4.0]]))
    whitened, _ = compute_gae(
        torch.tensor([[0.0, 4.0]]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), gamma=0.5, lam=0.5
    )
    # mean 1.25, unbiased var 1.125: (0.5 - 1.25) / sqrt(1.125) = -0.7071
    torch.testing.assert_close(whitened, torch.tensor([[-1.0, 1.0]]) * 0.75 / math.sqrt(1.125 + 1e-8))


def test_reinforce_pp_example_from_verl() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = compute_reinforce_pp_advantage(r, m, gamma=1.0)
    # G = (1,1,1 | 0,0): mean 0.6, unbiased var 0.3 -> (0.4 / sqrt(.3), -0.6 / sqrt(.3)) = (0.7303, -1.0954)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    s = math.sqrt(0.3 + 1e-8)
    expected = torch.tensor([[0.4 / s] * 3 + [0.0], [-0.6 / s] * 2 + [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_remax_example() -> None:
    # G = (3, 2) on the valid tokens (reward 1 then 2), b = 1 -> A = (2, 1); masked token -> 0
    adv, ret = compute_remax_advantage(
        torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[1, 1, 0]])
    )
    torch.testing.assert_close(ret, torch.tensor([[3.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 1.0, 0.0]]))


def test_grpo_and_rloo_examples() -> None:
    r = torch.tensor([[1.0], [0.0], [0.0], [3.0]])
    mask, index = torch.ones(4, 1), ["g", "g", "g", "h"]
    # group g: mean 1/3, unbiased std sqrt(1/3); singleton h keeps s/(1+eps)
    adv, _ = compute_grpo_advantage(r, mask, index, epsilon=0.0)
    sd = math.sqrt(1 / 3)
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([2 / 3 / sd, -1 / 3 / sd, -1 / 3 / sd, 3.0]))
    # RLOO: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; singleton keeps its raw score
    adv, _ = compute_rloo_advantage(r, mask, index)
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([1.0, -0.5, -0.5, 3.0]))


def test_opo_gpg_passk_examples_from_verl() -> None:
    # OPO: scores (1, 0), lengths (3, 1) -> b = 0.75 -> (0.25, -0.75)
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv, _ = compute_opo_advantage(r, torch.tensor([[1, 1, 1], [1, 0, 0]]), ["a", "a"])
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0]]))
    # GPG: s = (1, 0 | 0, 0) -> alpha = 4 / 1 -> (2, -2, 0, 0)
    adv, _ = compute_gpg_advantage(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1), [0, 0, 1, 1])
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([2.0, -2.0, 0.0, 0.0]))
    # pass@k: (1, 0, 0.5): margin 0.5, std 0.5 -> (1, 0, 0) normalised, (0.5, 0, 0) raw
    r = torch.tensor([[1.0], [0.0], [0.5]])
    adv, _ = compute_grpo_passk_advantage(r, torch.ones(3, 1), [0, 0, 0], epsilon=0.0)
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([1.0, 0.0, 0.0]))
    adv, _ = compute_grpo_passk_advantage(r, torch.ones(3, 1), [0, 0, 0], norm_by_std=False)
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([0.5, 0.0, 0.0]))
    # a tie for the maximum gives 0 to everyone
    adv, _ = compute_grpo_passk_advantage(torch.tensor([[1.0], [1.0], [0.0]]), torch.ones(3, 1), [0, 0, 0])
    assert torch.equal(adv, torch.zeros(3, 1))


def test_reinforce_pp_baseline_example() -> None:
    # centred scores (0.5, -0.5) on 2 + 1 tokens: mean 1/6, unbiased var over 3 tokens
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_reinforce_pp_baseline_advantage(r, m, [0, 0])
    vals = torch.tensor([0.5, 0.5, -0.5], dtype=torch.float64)
    w = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1]], [w[2], 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, adv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.float64, 1e-9)])
@settings(max_examples=25)
@given(data=st.data(), opts=options)
def test_fast_matches_oracle_on_cuda(
    dtype: torch.dtype, atol: float, data: st.DataObject, opts: dict
) -> None:
    batch = data.draw(ppo_batches(dtype=dtype, min_batch=2, max_batch=10, max_len=12, device="cuda"))
    for name in NAMES:
        adv, ret = get_advantage_estimator(name)(**_inputs(name, batch, opts))
        assert adv.device.type == ret.device.type == "cuda", name
    _check_every_estimator(batch, {**opts, "epsilon": 1e-6}, dtype, atol=atol, rtol=atol)
