"""compute_entropy_loss with the mini-batch's global denominators: micro-batch losses sum to the mini-batch loss,
in every aggregation mode (verl's ``compute_entropy_loss`` takes no global-denominator keywords)."""

from __future__ import annotations

import pytest
import torch

from ppo_core.losses import LOSS_AGG_MODES, compute_entropy_loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cuts", [[1], [2, 3], [1, 2, 4]])
def test_micro_batch_entropy_losses_sum_to_the_mini_batch_loss(mode: str, cuts: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(cuts))
    logits = 2 * torch.randn(5, 4, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 4, generator=gen) < 0.7
    mask[2] = False  # a row without a valid token still counts in global_batch_size
    glob = {
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": mask.shape[0],
        "loss_scale_factor": 4.0 if mode == "seq-mean-token-sum-norm" else None,
    }
    full = compute_entropy_loss(logits, mask, mode, **glob)
    parts = [
        compute_entropy_loss(logits[a:b], mask[a:b], mode, **glob)
        for a, b in zip([0, *cuts], [*cuts, 5], strict=True)
    ]
    torch.testing.assert_close(torch.stack(parts).sum(), full, rtol=1e-12, atol=1e-12)
    # without the global denominators each part is normalised on its own, and the sum is another number
    local = sum(compute_entropy_loss(logits[a:b], mask[a:b], mode, loss_scale_factor=glob["loss_scale_factor"])
                for a, b in zip([0, *cuts], [*cuts, 5], strict=True))  # fmt: skip
    if mode not in ("token-sum",):
        assert not torch.isclose(local, full, rtol=1e-9, atol=0)
