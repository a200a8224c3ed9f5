"""Log-probs and entropy edge cases: ``-inf`` (masked) vocabulary entries count as 0 · log 0 = 0, never NaN;
rows that are all ``-inf``, or hold NaN/``+inf``, raise.

Expected values are derived in the test (a loop, float64 or a small closed form), never copied from a run;
where verl behaves differently, ``docs/semantics.md`` says how and why.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits

# --------------------------------------------------------------------------------------------------------------
# Entropy with masked (-inf) vocabulary entries: 0 · log 0 := 0, never NaN


@st.composite
def _masked_logits(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` float64 logits with some ``-inf`` entries (never a whole row) and the ``[N, V]`` finite mask."""
    rows = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    finite = torch.rand(rows, vocab, generator=gen) < 0.6
    finite[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = True  # one finite per row
    return logits.masked_fill(~finite, float("-inf")), finite


def _entropy_over_finite(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Loop reference: the entropy of the softmax restricted to the finite entries (float64)."""
    out = []
    for z, keep in zip(logits, finite, strict=True):
        p = torch.softmax(z[keep], dim=-1)
        out.append(-(p * p.log()).sum())
    return torch.stack(out)


@given(_masked_logits())
def test_masked_vocab_entries_count_as_zero_log_zero(
    case: tuple[torch.Tensor, torch.Tensor],
) -> None:
    logits, finite = case
    logits = logits.clone().requires_grad_(True)
    entropy = entropy_from_logits(logits)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, _entropy_over_finite(logits.detach(), finite))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~finite] == 0).all()  # masked entries get the limit gradient 0, not NaN


def test_logprob_of_a_masked_label_and_invalid_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    # two equal finite logits: p = 1/2 each, and the masked one has probability 0
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([0])), torch.tensor([math.log(0.5)]))
    assert logprobs_from_logits(logits, torch.tensor([2])).item() == float("-inf")
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0)]))
    inf, nan = float("inf"), float("nan")
    for row in (torch.tensor([[-inf, -inf]]), torch.tensor([[nan, 0.0]]), torch.tensor([[inf, 0.0]])):
        with pytest.raises(ValueError, match="logits"):
            entropy_from_logits(row)
        with pytest.raises(ValueError, match="logits"):
            logprobs_from_logits(row, torch.tensor([1]))
