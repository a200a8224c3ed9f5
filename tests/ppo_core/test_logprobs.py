"""Chunked log-probs and entropies against float64 loop oracles and naive autograd."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.testing.kl_oracles import entropy_oracle, logprobs_oracle

NEG_INF = float("-inf")


@st.composite
def logits_cases(draw: st.DrawFn, *, allow_neg_inf: bool = True, min_rows: int = 0) -> dict:
    """Logits ``[*lead, V]`` (float64), labels, chunk size; optional -inf entries (never a whole row)."""
    lead = draw(st.lists(st.integers(min_value=min_rows, max_value=4), min_size=1, max_size=3))
    vocab = draw(st.integers(min_value=1, max_value=9))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(min_value=0, max_value=2**31 - 1)))
    logits = scale * torch.randn(*lead, vocab, generator=gen, dtype=torch.float64)
    if allow_neg_inf and vocab > 1 and draw(st.booleans()):
        masked = torch.rand(*lead, vocab, generator=gen) < 0.4
        masked[..., 0] = False  # keep one finite entry per row
        logits = logits.masked_fill(masked, NEG_INF)
    labels = torch.randint(0, vocab, tuple(lead), generator=gen)
    chunk_size = draw(st.integers(min_value=1, max_value=7))
    return {"logits": logits, "labels": labels, "chunk_size": chunk_size}


def _naive_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


@given(logits_cases())
def test_logprobs_match_float64_oracle(case: dict) -> None:
    out = logprobs_from_logits(case["logits"], case["labels"], chunk_size=case["chunk_size"])
    expected = logprobs_oracle(case["logits"], case["labels"])
    assert out.dtype == torch.float64 and out.shape == case["labels"].shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@given(logits_cases())
def test_entropy_matches_float64_oracle_with_neg_inf(case: dict) -> None:
    out = entropy_from_logits(case["logits"], chunk_size=case["chunk_size"])
    expected = entropy_oracle(case["logits"])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    vocab = case["logits"].shape[-1]
    assert bool((out >= -1e-12).all()) and bool((out <= math.log(vocab) + 1e-9).all())


@given(logits_cases(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_low_precision_is_computed_in_fp32(case: dict, dtype: torch.dtype) -> None:
    logits = case["logits"].clamp(min=-1e4).to(dtype).masked_fill(case["logits"] == NEG_INF, NEG_INF)
    logp = logprobs_from_logits(logits, case["labels"], chunk_size=case["chunk_size"])
    ent = entropy_from_logits(logits, chunk_size=case["chunk_size"])
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # the fp32 path on the up-cast logits is the same computation, hence bit-identical
    up = logits.float()
    assert torch.equal(logp, logprobs_from_logits(up, case["labels"], chunk_size=case["chunk_size"]))
    assert torch.equal(ent, entropy_from_logits(up, chunk_size=case["chunk_size"]))
    # and it agrees with the float64 oracle on those exact inputs to fp32 accuracy
    torch.testing.assert_close(logp.double(), logprobs_oracle(up, case["labels"]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), entropy_oracle(up), rtol=1e-5, atol=1e-4)


@given(logits_cases(allow_neg_inf=False))
def test_gradients_match_naive_autograd(case: dict) -> None:
    logits = case["logits"].clone().requires_grad_(True)
    naive_in = case["logits"].clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(case["labels"].shape, generator=gen, dtype=torch.float64)

    out = logprobs_from_logits(logits, case["labels"], chunk_size=case["chunk_size"])
    ent = entropy_from_logits(logits, chunk_size=case["chunk_size"])
    (grad,) = torch.autograd.grad((out * weights).sum() + (ent * weights.flip(-1)).sum(), logits)
    naive = _naive_logprobs(naive_in, case["labels"])
    naive_ent = _naive_entropy(naive_in)
    (expected,) = torch.autograd.grad(
        (naive * weights).sum() + (naive_ent * weights.flip(-1)).sum(), naive_in
    )
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)


@given(logits_cases())
def test_neg_inf_gradients_are_the_limit(case: dict) -> None:
    """Gradients with -inf logits equal those with -1e4 in float64 (where exp underflows to exactly 0)."""
    logits = case["logits"].clone().requires_grad_(True)
    finite = case["logits"].clamp(min=-1e4).requires_grad_(True)
    weights = torch.linspace(-1.0, 1.0, case["labels"].numel(), dtype=torch.float64).reshape(
        case["labels"].shape
    )
    labels = case["labels"]
    loss = (logprobs_from_logits(logits, labels) * weights).sum() + (
        entropy_from_logits(logits) * weights
    ).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss = (_naive_logprobs(finite, labels) * weights).sum() + (_naive_entropy(finite) * weights).sum()
    (expected,) = torch.autograd.grad(ref_loss, finite)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)


@given(logits_cases(min_rows=1), st.integers(min_value=1, max_value=5))
def test_chunk_size_and_slicing_do_not_change_results(case: dict, other_chunk: int) -> None:
    logits, labels = case["logits"], case["labels"]
    base_lp = logprobs_from_logits(logits, labels, chunk_size=case["chunk_size"])
    base_h = entropy_from_logits(logits, chunk_size=case["chunk_size"])
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size=other_chunk), base_lp)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=other_chunk), base_h)
    # a non-viewable slice (as in logits[:, :-1]) is processed without a copy and gives the same values
    if logits.dim() >= 3 and logits.shape[1] > 1:
        sliced = logits[:, 1:]
        lp = logprobs_from_logits(sliced, labels[:, 1:], chunk_size=other_chunk)
        torch.testing.assert_close(lp, base_lp[:, 1:])
        torch.testing.assert_close(entropy_from_logits(sliced, chunk_size=other_chunk), base_h[:, 1:])


def test_backward_keeps_no_upcast_copy_of_the_logits() -> None:
    """The autograd graph saves the bf16 logits themselves and per-row vectors only, never an fp32 [N, V] copy."""
    logits = torch.randn(6, 5, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (6, 5))
    n_rows = 6 * 5
    for out in (
        logprobs_from_logits(logits, labels, chunk_size=4),
        entropy_from_logits(logits, chunk_size=4),
    ):
        node = out.grad_fn.next_functions[0][0]  # the chunked Function behind the final view
        saved = node.saved_tensors
        assert any(tensor.data_ptr() == logits.data_ptr() for tensor in saved)
        for tensor in saved:
            assert tensor.numel() <= n_rows or tensor.data_ptr() == logits.data_ptr()
        out.float().sum().backward()
        assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
        logits.grad = None


def test_documented_examples() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    torch.testing.assert_close(logprobs_from_logits(logits, torch.tensor([1])).exp(), torch.tensor([0.25]))
    # -inf logits are 0 * log 0 = 0 (never NaN), the entropy of a fair coin remains
    h = entropy_from_logits(torch.tensor([[0.0, 0.0, NEG_INF]]))
    torch.testing.assert_close(h, torch.tensor([math.log(2.0)]))


def test_label_on_a_neg_inf_logit_gives_neg_inf_with_finite_gradient() -> None:
    logits = torch.tensor([[0.0, NEG_INF, 1.0]], requires_grad=True)
    out = logprobs_from_logits(logits, torch.tensor([1]))
    assert out.item() == NEG_INF
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(
        logits.grad, -torch.softmax(logits.detach(), -1) + torch.tensor([[0.0, 1.0, 0.0]])
    )


def test_empty_batch() -> None:
    logits = torch.zeros(0, 3, 5, requires_grad=True)
    labels = torch.zeros(0, 3, dtype=torch.long)
    out = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    assert out.shape == (0, 3) and ent.shape == (0, 3)
    (out.sum() + ent.sum()).backward()
    assert logits.grad.shape == logits.shape


@pytest.mark.parametrize("bad", [NEG_INF, float("nan"), float("inf")])
def test_row_without_a_distribution_raises(bad: float) -> None:
    logits = torch.zeros(2, 4)
    logits[1] = NEG_INF
    logits[1, 0] = bad
    with pytest.raises(ValueError, match="logits"):
        logprobs_from_logits(logits, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(logits)


def test_bad_arguments_name_the_argument() -> None:
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.full((2, 3), 4))
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.full((2, 3), -1))
    with pytest.raises(TypeError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="logits"):
        logprobs_from_logits(torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
    with pytest.raises(TypeError, match="logits"):
        entropy_from_logits([[0.0, 1.0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_cuda_memory_is_bounded_by_the_chunk(which: str) -> None:
    """bf16 [8192, 32000] logits: no fp32 copy is made or kept; extra memory is a few fp32 chunks."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(8, 1024, 32000, generator=gen, device=device).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 32000, (8, 1024), generator=gen, device=device)
    fp32_copy = logits.numel() * 4
    chunk_size = 256

    def run(x: torch.Tensor) -> torch.Tensor:
        if which == "logprobs":
            return logprobs_from_logits(x, labels, chunk_size=chunk_size)
        return entropy_from_logits(x, chunk_size=chunk_size)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run(logits)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < fp32_copy / 4
    assert torch.cuda.memory_allocated() - base < 1 << 20  # the graph holds per-row vectors only
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    torch.cuda.synchronize()
    grad_bytes = logits.numel() * logits.element_size()
    assert torch.cuda.max_memory_allocated() - base < grad_bytes + fp32_copy / 4

    # values and gradients agree with the naive fp32 computation on the same rows
    rows = logits.detach()[:2, :64].float().requires_grad_(True)
    if which == "logprobs":
        naive = torch.log_softmax(rows, -1).gather(-1, labels[:2, :64].unsqueeze(-1)).squeeze(-1)
    else:
        naive = -(torch.softmax(rows, -1) * torch.log_softmax(rows, -1)).sum(-1)
    naive.sum().backward()
    torch.testing.assert_close(out.detach()[:2, :64], naive.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits.grad[:2, :64].float(), rows.grad, rtol=2e-2, atol=1e-4)
