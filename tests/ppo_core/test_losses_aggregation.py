"""agg_loss: against the loop oracle, micro-batch/DP invariance, all-masked input gives exactly 0, bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.losses import LOSS_AGG_MODES, agg_loss
from ppo_core.testing import response_masks
from ppo_core.testing.loss_oracles import agg_loss_oracle


@st.composite
def loss_and_mask(draw: st.DrawFn, max_batch: int = 10, max_len: int = 12):
    mask = draw(response_masks(max_batch=max_batch, max_len=max_len))
    seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
    loss = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return loss, mask


def _scale_factor(mode: str, mask: torch.Tensor) -> float | None:
    return float(mask.shape[-1] + 3) if mode == "seq-mean-token-sum-norm" else None


@given(
    loss_and_mask(), st.sampled_from(LOSS_AGG_MODES), st.integers(1, 4), st.integers(0, 5), st.integers(0, 3)
)
def test_agg_loss_matches_oracle(data, mode, dp_size, extra_tokens, extra_rows):
    loss, mask = data
    kwargs = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum()) + extra_tokens,
        "global_batch_size": mask.shape[0] + extra_rows,
        "loss_scale_factor": _scale_factor(mode, mask),
    }
    got = agg_loss(loss, mask, mode, **kwargs)
    assert got.dtype == loss.dtype and got.dim() == 0
    assert math.isclose(float(got), agg_loss_oracle(loss, mask, mode, **kwargs), rel_tol=1e-12, abs_tol=1e-12)
    local = agg_loss(loss, mask, mode, loss_scale_factor=_scale_factor(mode, mask))
    expected = agg_loss_oracle(loss, mask, mode, loss_scale_factor=_scale_factor(mode, mask))
    assert math.isclose(float(local), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_agg_loss_reference_example():
    # Section 4 example: rows (1,2,3,4),(5,6,·,·),(·,·,·,·) with 6 valid tokens and 2 non-empty rows.
    loss = torch.tensor([[1.0, 2, 3, 4], [5, 6, 0, 0], [9, 9, 9, 9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    total = 1 + 2 + 3 + 4 + 5 + 6
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(total / 6)
    assert float(agg_loss(loss, mask, "token-sum")) == pytest.approx(total)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(total / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=4)) == pytest.approx(
        total / 8
    )
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((10 / 4 + 11 / 2) / 2)
    glob = {"dp_size": 2, "batch_num_tokens": 10, "global_batch_size": 4}
    assert float(agg_loss(loss, mask, "token-mean", **glob)) == pytest.approx(total / 10 * 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean", **glob)) == pytest.approx(
        (10 / 4 + 11 / 2) / 4 * 2
    )


def _split_rows(n_rows: int, cuts: list[int]) -> list[slice]:
    bounds = sorted({0, n_rows, *(c % (n_rows + 1) for c in cuts)})
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


@given(
    loss_and_mask(max_batch=12),
    st.sampled_from(LOSS_AGG_MODES),
    st.integers(1, 3),
    st.lists(st.integers(0, 12), max_size=4),
    st.booleans(),
)
def test_micro_batches_and_dp_ranks_sum_to_the_mini_batch_loss(data, mode, dp_size, cuts, trim):
    """Rows dealt to ``dp_size`` ranks, each split into micro-batches (optionally re-padded to their own width):
    with the global denominators, the DP average of the per-rank sums of micro-batch losses is the full loss."""
    loss, mask = data
    loss.requires_grad_(True)
    factor = _scale_factor(mode, mask)
    full = agg_loss(loss, mask, mode, loss_scale_factor=factor)
    glob = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": int((mask.sum(-1) > 0).sum()),
        "loss_scale_factor": factor,
    }
    ranks = [torch.tensor(list(range(r, mask.shape[0], dp_size)), dtype=torch.long) for r in range(dp_size)]
    per_rank = []
    for rows in ranks:
        rank_total = loss.new_zeros(())
        for part in _split_rows(len(rows), cuts):
            idx = rows[part]
            mb_loss, mb_mask = loss[idx], mask[idx]
            if trim and mb_mask.any():
                width = int(mb_mask.nonzero()[:, 1].max()) + 1
                mb_loss, mb_mask = mb_loss[:, :width], mb_mask[:, :width]
            rank_total = rank_total + agg_loss(mb_loss, mb_mask, mode, **glob)
        per_rank.append(rank_total)
    dp_average = torch.stack(per_rank).mean()
    assert torch.allclose(dp_average, full, rtol=1e-12, atol=1e-12)
    (grad_full,) = torch.autograd.grad(full, loss)
    (grad_split,) = torch.autograd.grad(dp_average, loss)
    assert torch.allclose(grad_full, grad_split, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("global_info", [False, True])
def test_all_masked_gives_zero_and_zero_gradient(mode, global_info):
    loss = torch.full((3, 4), float("nan"), requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    kwargs = {"loss_scale_factor": 4.0} if mode == "seq-mean-token-sum-norm" else {}
    if global_info:
        kwargs |= {"dp_size": 2, "batch_num_tokens": 7, "global_batch_size": 5}
    out = agg_loss(loss, mask, mode, **kwargs)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 4))


@given(loss_and_mask(max_batch=6, max_len=10), st.sampled_from(LOSS_AGG_MODES))
def test_padding_values_and_nan_never_leak(data, mode):
    values, mask = data
    loss = values.clone().requires_grad_(True)
    factor = _scale_factor(mode, mask)
    clean = agg_loss(loss, mask, mode, loss_scale_factor=factor)
    (grad_clean,) = torch.autograd.grad(clean, loss)
    poisoned = torch.where(mask, loss, torch.tensor(float("nan"))).detach()
    poisoned[~mask & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) < 0.5)] = float(
        "inf"
    )
    poisoned.requires_grad_(True)
    out = agg_loss(poisoned, mask, mode, loss_scale_factor=factor)
    assert torch.equal(out, clean)
    (grad,) = torch.autograd.grad(out, poisoned)
    assert torch.equal(grad, grad_clean)
    assert torch.all(grad[~mask] == 0)


def test_appending_padding_changes_nothing():
    loss = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    wide_loss = torch.cat([loss, torch.randn(3, 4, generator=torch.Generator().manual_seed(1))], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], dim=1)
    for mode in LOSS_AGG_MODES:
        factor = 7.0 if mode == "seq-mean-token-sum-norm" else None
        a = agg_loss(loss, mask, mode, loss_scale_factor=factor)
        b = agg_loss(wide_loss, wide_mask, mode, loss_scale_factor=factor)
        assert torch.allclose(a, b), mode


def test_empty_batch_gives_zero():
    for mode in LOSS_AGG_MODES:
        factor = 1.0 if mode == "seq-mean-token-sum-norm" else None
        assert agg_loss(torch.zeros(0, 4), torch.zeros(0, 4), mode, loss_scale_factor=factor).item() == 0.0


def test_seq_mean_token_sum_norm_requires_loss_scale_factor():
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm")


def test_float_mask_with_non_binary_values_is_rejected():
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(torch.zeros(2, 3), torch.full((2, 3), 0.5))


def test_unknown_mode_lists_the_valid_modes():
    with pytest.raises(ValueError, match="loss_agg_mode") as info:
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean")
    for mode in LOSS_AGG_MODES:
        assert mode in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"loss_mat": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "loss_mat"),
        ({"loss_mat": [[0.0]]}, TypeError, "loss_mat"),
        ({"loss_mat": torch.zeros(6)}, ValueError, "loss_mat"),
        ({"loss_mask": torch.ones(2, 4)}, ValueError, "loss_mask"),
        ({"dp_size": 0}, ValueError, "dp_size"),
        ({"dp_size": 2}, ValueError, "batch_num_tokens"),
        ({"dp_size": 2, "loss_agg_mode": "seq-mean-token-mean"}, ValueError, "global_batch_size"),
        ({"batch_num_tokens": -1}, ValueError, "batch_num_tokens"),
        ({"global_batch_size": "8"}, TypeError, "global_batch_size"),
        (
            {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 0.0},
            ValueError,
            "loss_scale_factor",
        ),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, exc, name):
    args = {"loss_mat": torch.zeros(2, 3), "loss_mask": torch.ones(2, 3)} | kwargs
    with pytest.raises(exc, match=name):
        agg_loss(**args)


def test_global_denominator_as_tensor():
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    out = agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=torch.tensor(12))
    assert out.item() == pytest.approx(6 / 12 * 2)
