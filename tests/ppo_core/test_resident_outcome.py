"""The resident step's outcome advantages from ``[B]`` columns against the estimators on ``[B, T]``, bit for bit:
the per-row estimators (``outcome_advantages`` then the ranks' broadcast) and REINFORCE++-baseline
(``whitened_outcome_rows``: per-row values and the whitening moments without the broadcast rows)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.advantages import get_advantage_estimator
from ppo_core.advantages._common import broadcast_rows
from ppo_core.masked_moments import whiten_with
from ppo_core.trainer.config import AlgorithmConfig
from ppo_core.trainer.resident_step import opo_outcome_rows, outcome_advantages, whitened_outcome_rows


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


@given(batch=outcome_batches(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_opo_from_columns_is_the_estimator_bit_for_bit(batch, dtype: torch.dtype) -> None:
    """OPO's length-weighted group baseline from the ``[B]`` row sums, validity and lengths."""
    rewards, mask, uids = batch
    rewards = rewards.to(dtype)
    want, _ = get_advantage_estimator("opo")(token_level_rewards=rewards, response_mask=mask, index=uids)
    row_sum, valid, lengths = _columns(rewards, mask)
    got = broadcast_rows(opo_outcome_rows(row_sum, valid, lengths, uids), mask, dtype)
    assert torch.equal(got, want)


@given(batch=outcome_batches(), gamma=st.sampled_from([1.0, 0.9, 0.0]), data=st.data())
def test_reinforce_pp_from_row_blocks_is_the_estimator_bit_for_bit(batch, gamma: float, data) -> None:
    """REINFORCE++: each block of rows scans its reward-to-go and sends its row partials; whitened with the
    reduced moments, the blocks give the estimator's advantages on the whole batch (and its returns). The masks are
    prefixes, as a generation's are (a mask with holes makes the CPU scan compact the rows to another width on a
    block than on the whole batch: the same values up to rounding, docs/resident-batches.md)."""
    from tensordict import TensorDict

    from ppo_core.masked_moments import reduce_row_moments, row_moments
    from ppo_core.workers.resident_ops import reinforce_pp_rows

    rewards, mask, _ = batch
    mask = mask.cumprod(dim=-1).bool()  # valid tokens first
    want, want_returns = get_advantage_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, gamma=gamma
    )
    rows = rewards.shape[0]
    cuts = [0, *sorted(data.draw(st.lists(st.integers(0, rows), max_size=3))), rows]
    td = TensorDict({"token_level_rewards": rewards, "response_mask": mask}, batch_size=[rows])
    blocks = [reinforce_pp_rows(td[a:b], gamma) for a, b in itertools.pairwise(cuts)]
    spans = list(itertools.pairwise(cuts))
    moments = reduce_row_moments(
        [row_moments(b["advantages"], mask[lo:hi]) for b, (lo, hi) in zip(blocks, spans, strict=True)]
    )
    got = torch.cat(
        [
            whiten_with(b["advantages"], mask[lo:hi], moments)
            for b, (lo, hi) in zip(blocks, spans, strict=True)
        ]
    )
    assert torch.equal(got, want)
    assert torch.equal(torch.cat([b["returns"] for b in blocks]), want_returns)
    whole = reinforce_pp_rows(td, gamma, whiten=True)
    assert torch.equal(whole["advantages"], want) and torch.equal(whole["returns"], want_returns)
