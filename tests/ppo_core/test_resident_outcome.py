"""The resident step's outcome advantages from ``[B]`` columns against the estimators on ``[B, T]``, bit for bit:
the per-row estimators (``outcome_advantages`` then the ranks' broadcast) and REINFORCE++-baseline
(``whitened_outcome_rows``: per-row values and the whitening moments without the broadcast rows)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.advantages import get_advantage_estimator
from ppo_core.advantages._common import broadcast_rows
from ppo_core.masked_moments import whiten_with
from ppo_core.trainer.config import AlgorithmConfig
from ppo_core.trainer.resident_step import outcome_advantages, whitened_outcome_rows


@st.composite
def outcome_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """float32 ``[B, T]`` rewards (random, on valid and masked positions), a mask with empty rows, groups of 2+."""
    groups = draw(st.integers(min_value=1, max_value=4))
    n = draw(st.integers(min_value=2, max_value=4))
    width = draw(st.integers(min_value=1, max_value=7))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    rows = groups * n
    rewards = torch.randn(rows, width, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    mask = torch.rand(rows, width, generator=gen) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    return rewards, mask, [i // n for i in range(rows)]


def _columns(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``shape_rewards`` sends: float64 row sums, row validity and lengths."""
    return rewards.to(torch.float64).sum(-1), mask.any(-1), mask.sum(-1)


@given(batch=outcome_batches(), name=st.sampled_from(["grpo", "grpo_passk", "rloo", "gpg"]))
def test_per_row_estimators_from_columns_are_the_estimators_bit_for_bit(batch, name: str) -> None:
    rewards, mask, uids = batch
    algorithm = AlgorithmConfig(adv_estimator=name)
    want, _ = get_advantage_estimator(name)(
        token_level_rewards=rewards, response_mask=mask, index=uids, norm_by_std=True, epsilon=1e-6
    )
    row_sum, valid, _ = _columns(rewards, mask)
    got = broadcast_rows(outcome_advantages(row_sum, valid, uids, algorithm), mask, rewards.dtype)
    assert torch.equal(got, want)


@given(batch=outcome_batches(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_reinforce_pp_baseline_from_columns_is_the_estimator_bit_for_bit(batch, dtype: torch.dtype) -> None:
    rewards, mask, uids = batch
    rewards = rewards.to(dtype)
    want, returns = get_advantage_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=uids
    )
    row_sum, valid, lengths = _columns(rewards, mask)
    per_row, moments = whitened_outcome_rows(row_sum, valid, lengths, uids, dtype)
    assert per_row.dtype == dtype and moments.count == int(mask.sum())
    got = whiten_with(broadcast_rows(per_row, mask, dtype), mask, moments)
    assert torch.equal(got, want) and torch.equal(returns, want)
