"""Advantage estimator edge cases (singleton and constant groups, low variance, group labels, fully masked rows,
rewards on masked positions, whitening 0 or 1 tokens, multi-turn gaps, explicit gamma/alpha), each pinning the
behaviour we chose; where it differs from verl, ``docs/semantics.md`` says how and why."""

from __future__ import annotations

import math

import pytest
import torch
from _constant import constant_cases
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.advantages import (
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
from ppo_core.testing.advantage_oracles import ADVANTAGE_ORACLES, rloo_oracle

TOKEN_LEVEL = ("gae", "reinforce_plus_plus", "remax")
GROUP_FNS = {
    "grpo": compute_grpo_advantage,
    "rloo": compute_rloo_advantage,
    "opo": compute_opo_advantage,
    "gpg": compute_gpg_advantage,
    "grpo_passk": compute_grpo_passk_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantage,
}


def _col(*xs: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(xs, dtype=dtype).unsqueeze(-1)


def test_grpo_singleton_group_divides_its_score_by_one_plus_epsilon() -> None:
    adv, ret = compute_grpo_advantage(_col(5.0), torch.ones(1, 1), ["only"])
    assert float(adv) == pytest.approx(5.0 / (1 + 1e-6), abs=1e-12)  # 4.999995, as verl
    assert float(adv) == pytest.approx(4.999995, abs=1e-6)
    torch.testing.assert_close(ret, adv)
    dr, _ = compute_grpo_advantage(_col(5.0), torch.ones(1, 1), ["only"], norm_by_std=False)
    assert float(dr) == 5.0
    # a group whose other row has no valid token behaves as a singleton (that row leaves the group statistics)
    mixed, _ = compute_grpo_advantage(_col(5.0, 3.0), torch.tensor([[1], [0]]), ["g", "g"])
    assert float(mixed[0]) == pytest.approx(5.0 / (1 + 1e-6), abs=1e-12) and float(mixed[1]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_estimators_give_exactly_zero_for_identical_rewards(dtype: torch.dtype) -> None:
    rewards = _col(1.0, 1.0, 0.1, 0.1, 0.1, 0.7, 0.7, dtype=dtype)
    index = [0, 0, 1, 1, 1, 2, 2]
    for epsilon in (1e-6, 0.0):
        for name, fn in GROUP_FNS.items():
            kwargs = {"epsilon": epsilon} if name in ("grpo", "grpo_passk") else {}
            adv, _ = fn(rewards, torch.ones_like(rewards), index, **kwargs)
            assert torch.equal(adv, torch.zeros_like(adv)), name  # exactly 0, no NaN, no 1e-11


@given(st.floats(-1e6, 1e6, allow_nan=False), st.integers(2, 6))
def test_constant_groups_are_exactly_zero(score: float, size: int) -> None:
    rewards = _col(*([score] * size))
    for fn in (compute_grpo_advantage, compute_rloo_advantage, compute_opo_advantage, compute_gpg_advantage):
        adv, _ = fn(rewards, torch.ones_like(rewards), ["u"] * size)
        assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grpo_low_variance_groups_keep_their_precision(dtype: torch.dtype) -> None:
    rewards = _col(1.0, 1.00001, 2.0, 2.00001, dtype=dtype)
    gap = float(rewards[1] - rewards[0])  # the gap as stored in this dtype
    sign = torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    for epsilon in (0.0, 1e-6):
        adv, _ = compute_grpo_advantage(rewards, torch.ones_like(rewards), [0, 0, 1, 1], epsilon=epsilon)
        # two values d apart: (s - mean) / (std + eps) = (d / 2) / (d / sqrt(2) + eps)
        expected = (gap / 2) / (gap / math.sqrt(2) + epsilon)
        torch.testing.assert_close(adv.squeeze(-1).double(), sign * expected, atol=1e-4, rtol=0)
    # ±0.7071 without epsilon, ±0.62 with verl's 1e-6: far from the ±0.005 of an uncentred float32 variance
    assert abs((gap / 2) / (gap / math.sqrt(2)) - 0.7071) < 1e-3


def test_dr_grpo_flag_reaches_the_estimator() -> None:
    rewards = _col(1.0, 0.0, 0.0, 0.0, 3.0, 1.0)
    index = ["a", "a", "a", "a", "b", "b"]
    fn = get_advantage_estimator("grpo")
    dr, _ = fn(
        token_level_rewards=rewards, response_mask=torch.ones_like(rewards), index=index, norm_by_std=False
    )
    # s - mean: group a mean 0.25, group b mean 2
    torch.testing.assert_close(
        dr.squeeze(-1), torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0], dtype=torch.float64)
    )
    normed, _ = fn(token_level_rewards=rewards, response_mask=torch.ones_like(rewards), index=index)
    assert not torch.allclose(normed, dr)
    # a misspelt option is an error, never silently ignored
    with pytest.raises(TypeError, match="norm_adv_by_std_in_grpo"):
        fn(
            token_level_rewards=rewards,
            response_mask=torch.ones_like(rewards),
            index=index,
            norm_adv_by_std_in_grpo=False,
        )


def test_group_labels_are_compared_by_equality() -> None:
    rewards = _col(1.0, 1.0, 0.0, 0.0)
    mask = torch.ones_like(rewards)
    # each group is a constant pair -> all 0; merging "01" with "1" (verl's vectorized path) would give ±0.5
    adv, _ = compute_grpo_advantage(rewards, mask, ["01", "01", "1", "1"], norm_by_std=False)
    assert torch.equal(adv, torch.zeros_like(adv))
    merged, _ = compute_grpo_advantage(rewards, mask, ["1", "1", "1", "1"], norm_by_std=False)
    torch.testing.assert_close(merged.squeeze(-1), torch.tensor([0.5, 0.5, -0.5, -0.5], dtype=torch.float64))
    # huge and negative integer ids: one bucket per distinct label, no 10**9-sized allocation
    for index in (
        [10**9, 10**9, -(10**12), -(10**12)],
        torch.tensor([10**9, 10**9, -7, -7]),
        [2**70, 2**70, -1, -1],
    ):
        got, _ = compute_grpo_advantage(rewards, mask, index, norm_by_std=False)
        assert torch.equal(got, adv)


def test_rloo_singleton_keeps_its_raw_score() -> None:
    rewards = _col(-2.0, 2.0, 0.7)
    adv, _ = compute_rloo_advantage(rewards, torch.ones_like(rewards), [0, 0, 1])
    # pair: -2 - 2 = -4 and 2 - (-2) = 4; the singleton keeps its raw score (verl's loop version), not 0
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([-4.0, 4.0, 0.7], dtype=torch.float64))
    torch.testing.assert_close(adv, rloo_oracle(rewards, torch.ones_like(rewards), [0, 0, 1])[0])
    # rollout.n = 1: every group is a singleton and RLOO still trains
    alone, _ = compute_rloo_advantage(rewards, torch.ones_like(rewards), ["x", "y", "z"])
    torch.testing.assert_close(alone, rewards)


@given(
    batch=ppo_batches(dtype=torch.float64, min_batch=2, max_batch=8, max_len=6, allow_empty_rows=False),
    data=st.data(),
)
def test_fully_masked_rows_leave_the_group(batch: PPOBatch, data: st.DataObject) -> None:
    """Adding rejected rows (no valid token, any reward) to existing groups changes no other row and gives them 0."""
    labels = list(batch.index.tolist() if isinstance(batch.index, torch.Tensor) else batch.index)
    extra = data.draw(st.lists(st.sampled_from(labels), min_size=1, max_size=3))
    extra_rewards = torch.tensor(
        data.draw(st.lists(st.floats(-5, 5), min_size=len(extra), max_size=len(extra))), dtype=torch.float64
    )
    rewards = torch.cat(
        [batch.token_level_rewards, torch.zeros(len(extra), batch.seq_len, dtype=torch.float64)]
    )
    rewards[batch.batch_size :, -1] = extra_rewards
    mask = torch.cat([batch.response_mask, torch.zeros(len(extra), batch.seq_len, dtype=torch.bool)])
    index = labels + extra
    for name, fn in GROUP_FNS.items():
        if name == "grpo_passk":
            continue  # needs groups of >= 2 rows; covered below
        base, _ = fn(batch.token_level_rewards, batch.response_mask, labels)
        grown, _ = fn(rewards, mask, index)
        torch.testing.assert_close(
            grown[: batch.batch_size], base, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert torch.equal(grown[batch.batch_size :], torch.zeros_like(grown[batch.batch_size :])), name


def test_fully_masked_rows_leave_the_group_examples() -> None:
    rewards = _col(1.0, 0.0, 5.0)
    mask = torch.tensor([[1], [1], [0]])
    # the rejected row (reward 5) does not drag the group mean: Dr.GRPO gives ±0.5, not (1 - 2, 0 - 2)
    dr, _ = compute_grpo_advantage(rewards, mask, [0, 0, 0], norm_by_std=False)
    torch.testing.assert_close(dr.squeeze(-1), torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64))
    # OPO: a group of only empty rows gives 0 where verl computes 0/0 = NaN
    opo, _ = compute_opo_advantage(rewards, torch.zeros(3, 1), [0, 0, 0])
    assert torch.equal(opo, torch.zeros_like(opo))
    # GPG's alpha counts rows with a valid token only: 2 valid rows, 1 nonzero score -> alpha 2
    gpg, _ = compute_gpg_advantage(rewards, mask, [0, 0, 0])
    torch.testing.assert_close(gpg.squeeze(-1), torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))
    # pass@k: a group left with one valid row has no runner-up -> 0
    passk, _ = compute_grpo_passk_advantage(
        _col(1.0, 0.0, 2.0, 0.0), torch.tensor([[1], [0], [1], [1]]), [0, 0, 1, 1]
    )
    torch.testing.assert_close(
        passk.squeeze(-1), torch.tensor([0.0, 0.0, 2.0 / (math.sqrt(2.0) + 1e-6), 0.0], dtype=torch.float64)
    )


def test_reward_on_a_masked_position_counts_for_outcome_estimators_only() -> None:
    # the response ends with a tool observation (last column masked) that carries the outcome reward 1
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    values = torch.zeros_like(rewards)
    gae_adv, gae_ret = compute_gae(rewards, values, mask, whiten=False)
    rpp_adv, rpp_ret = compute_reinforce_pp_advantage(rewards, mask)
    remax_adv, remax_ret = compute_remax_advantage(rewards, torch.zeros(2, dtype=torch.float64), mask)
    for out in (gae_adv, gae_ret, rpp_adv, rpp_ret, remax_adv, remax_ret):
        assert torch.equal(out, torch.zeros_like(out))  # token-level estimators drop it, as verl does
    # outcome estimators count it: the first row outscores the second
    for name, fn in GROUP_FNS.items():
        adv, _ = fn(rewards, mask, [0, 0])
        assert float(adv[0, 0]) > 0 and float(adv[0, 0]) > float(adv[1, 0]), name
        assert float(adv[0, 2]) == 0.0, name


@pytest.mark.parametrize("n_valid", [0, 1])
def test_whitening_with_zero_or_one_valid_token_gives_zero(n_valid: int) -> None:
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 2] = n_valid == 1
    rewards = torch.full((3, 4), 2.0, dtype=torch.float64)
    values = torch.full((3, 4), -1.0, dtype=torch.float64)
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv, ret = get_advantage_estimator(name)(
            token_level_rewards=rewards, response_mask=mask, index=[0, 0, 1], values=values
        )
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert torch.equal(adv, torch.zeros_like(adv)), name  # verl raises ValueError here
    _, ret = compute_gae(rewards, values, mask)
    assert float(ret.sum()) == (2.0 if n_valid else 0.0)  # returns stay informative: r + 0 - V + V = 2


@given(case=constant_cases(), lam=st.floats(0.0, 1.0))
def test_whitening_constant_values_gives_exactly_zero(
    case: tuple[torch.Tensor, torch.Tensor], lam: float
) -> None:
    """What GAE, REINFORCE++ and REINFORCE++-baseline whiten is one value at every valid token: their advantages
    are exactly 0 (the float32 mean of equal values, a rounded sum over their count, is in general not that value,
    and whitening multiplied the difference by ``rsqrt(1e-8) = 1e4``)."""
    rewards, mask = case
    # gamma = 0: the raw GAE advantages (V = 0) and the returns are the rewards themselves
    gae, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma=0.0, lam=lam, whiten=True)
    rpp, _ = compute_reinforce_pp_advantage(rewards, mask, gamma=0.0)
    # every row its own group with the value as its score: baseline 0 (singletons), the centred score is the value
    scores = torch.zeros_like(rewards)
    scores[:, 0] = rewards[mask][0]
    baseline, _ = compute_reinforce_pp_baseline_advantage(scores, mask, list(range(rewards.shape[0])))
    outputs = {"gae": gae, "reinforce_plus_plus": rpp, "reinforce_plus_plus_baseline": baseline}
    for name, adv in outputs.items():
        assert adv.dtype == rewards.dtype, name
        assert torch.equal(adv, torch.zeros_like(adv)), (name, adv)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ORACLES))
def test_outputs_are_zero_on_masked_positions(name: str) -> None:
    mask = torch.tensor(
        [[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    gen = torch.Generator().manual_seed(0)
    rewards = torch.where(mask, torch.randn(4, 6, generator=gen, dtype=torch.float64), 0.0)
    values = torch.where(mask, torch.randn(4, 6, generator=gen, dtype=torch.float64), float("nan"))
    adv, ret = get_advantage_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        index=[0, 0, 1, 1],
        values=values,
        reward_baselines=torch.randn(4, generator=gen, dtype=torch.float64),
    )
    for out in (adv, ret):
        assert torch.equal(out[~mask], torch.zeros_like(out[~mask])), (
            name
        )  # verl: whitened padding, returns = V
        assert torch.isfinite(out).all(), name


def test_multi_turn_gae_ignores_values_in_observation_gaps() -> None:
    """verl's test: values differing only at masked positions give identical advantages and masked returns."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(1, 11, generator=gen)
    values_a = torch.randn(1, 11, generator=gen)
    values_b = torch.where(mask, values_a, torch.randn(1, 11, generator=gen) * 50)
    for gamma, lam in ((0.99, 0.95), (0.5, 1.0), (1.0, 0.0)):
        adv_a, ret_a = compute_gae(rewards, values_a, mask, gamma=gamma, lam=lam)
        adv_b, ret_b = compute_gae(rewards, values_b, mask, gamma=gamma, lam=lam)
        assert torch.equal(adv_a, adv_b) and torch.equal(ret_a, ret_b)


@pytest.mark.parametrize("gap", [1, 2, 5])
def test_one_gamma_step_across_a_gap(gap: int) -> None:
    # tokens: act, <gap observation tokens>, act(reward 1); V = 0, lam = 1 -> A_0 = gamma * 1 whatever the gap
    mask = torch.tensor([[True] + [False] * gap + [True]])
    rewards = torch.zeros(1, gap + 2, dtype=torch.float64)
    rewards[0, -1] = 1.0
    rewards[0, 1] = 7.0  # a reward inside the gap is dropped
    adv, ret = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma=0.5, lam=1.0, whiten=False)
    assert float(adv[0, 0]) == 0.5 and float(ret[0, 0]) == 0.5 and float(adv[0, -1]) == 1.0
    _, g = compute_reinforce_pp_advantage(rewards, mask, gamma=0.5)
    assert float(g[0, 0]) == 0.5


def test_explicit_gamma_and_alpha_are_honoured() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    fn = get_advantage_estimator("reinforce_plus_plus")
    _, ret = fn(token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    # G = (0.25, 0.5, 1): the gamma given to the call is the one used (verl reads config.gamma instead)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]], dtype=torch.float64))
    scores = _col(1.0, 0.0, 0.0, 0.0)
    gpg = get_advantage_estimator("gpg")
    fixed, _ = gpg(
        token_level_rewards=scores, response_mask=torch.ones_like(scores), index=[0, 0, 1, 1], alpha=1.0
    )
    adaptive, _ = gpg(token_level_rewards=scores, response_mask=torch.ones_like(scores), index=[0, 0, 1, 1])
    torch.testing.assert_close(fixed.squeeze(-1), torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(adaptive, 4.0 * fixed)  # alpha = B / #nonzero = 4
