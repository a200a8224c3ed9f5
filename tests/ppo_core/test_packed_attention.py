"""Causal attention over packed documents against a float64 reference with an explicit document-causal mask.

The reference builds the ``[T, T]`` mask ``same document and key <= query`` and computes ``softmax(q k^T * scale)
v`` in float64 with repeated key/value heads; every backend must match it, and no document may ever see another
(perturbing one document's keys and values leaves the other documents' outputs unchanged). The FlexAttention
backend has no backward on the CPU: its gradients are checked on a GPU (``test_packing_gpu.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.kernels.packed_attention import (
    PACKED_ATTENTION_BACKENDS,
    PackedDocuments,
    packed_causal_attention,
    varlen_available,
)

# at most 60 examples under the ci profile (the dev profile's 30 stay 30): each example is slow, and the suite
# must stay within its 10-minute budget on the 2-core CI machine
_CI_EXAMPLES = min(60, settings.default.max_examples)


def _reference(q, k, v, docs: PackedDocuments, scale: float | None) -> torch.Tensor:
    t, h, d = q.shape
    groups = h // k.shape[1]
    kk, vv = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    doc = docs.document_ids()
    idx = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * (scale if scale is not None else 1 / math.sqrt(d))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@st.composite
def packed_cases(draw: st.DrawFn) -> dict:
    seqlens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    groups = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 3)) * groups
    d = draw(st.sampled_from([2, 4, 8]))
    scale = draw(st.sampled_from([None, 0.3]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = sum(seqlens)
    return {
        "docs": PackedDocuments.from_seqlens(seqlens),
        "q": torch.randn(t, heads, d, generator=g),
        "k": torch.randn(t, heads // groups, d, generator=g),
        "v": torch.randn(t, heads // groups, d, generator=g),
        "scale": scale,
    }


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@settings(max_examples=_CI_EXAMPLES)
@given(case=packed_cases())
def test_backends_match_the_masked_reference(backend: str, case: dict) -> None:
    q, k, v, docs = case["q"], case["k"], case["v"], case["docs"]
    out = packed_causal_attention(q, k, v, docs, scale=case["scale"], backend=backend)
    ref = _reference(q, k, v, docs, case["scale"])
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@given(case=packed_cases())
def test_sdpa_backend_gradients_match_the_reference(case: dict) -> None:
    q, k, v = (case[n].double().requires_grad_() for n in "qkv")
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(
        (packed_causal_attention(q, k, v, case["docs"], scale=case["scale"], backend="sdpa") * weight).sum(),
        (q, k, v),
    )
    want = torch.autograd.grad((_reference(q, k, v, case["docs"], case["scale"]) * weight).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@settings(max_examples=_CI_EXAMPLES)
@given(case=packed_cases(), data=st.data())
def test_a_document_never_attends_to_another(backend: str, case: dict, data: st.DataObject) -> None:
    docs = case["docs"]
    victim = data.draw(st.integers(0, len(docs.seqlens) - 1))
    q, k, v = case["q"], case["k"], case["v"]
    other = docs.document_ids() != victim
    k2, v2 = k.clone(), v.clone()
    k2[other] += 5.0
    v2[other] -= 3.0
    a = packed_causal_attention(q, k, v, docs, backend=backend)
    b = packed_causal_attention(q, k2, v2, docs, backend=backend)
    mine = ~other
    torch.testing.assert_close(a[mine], b[mine], rtol=0, atol=1e-6)


def test_positions_restart_and_a_document_of_one_token_returns_its_value() -> None:
    docs = PackedDocuments.from_seqlens([1, 3, 1])
    assert docs.position_ids.tolist() == [0, 0, 1, 2, 0]
    q, k, v = torch.randn(5, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    out = packed_causal_attention(q, k, v, docs, backend="sdpa")
    for single in (0, 4):  # a lone token attends to itself only
        torch.testing.assert_close(out[single], v[single].expand(2, 4))


def test_half_precision_on_the_cpu_stays_close_to_fp32() -> None:
    docs = PackedDocuments.from_seqlens([4, 7])
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(11, 4, 8, generator=g),
        torch.randn(11, 2, 8, generator=g),
        torch.randn(11, 2, 8, generator=g),
    )
    full = packed_causal_attention(q, k, v, docs, backend="sdpa")
    half = packed_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), docs, backend="sdpa")
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=3e-2, atol=3e-2)


def test_arguments_are_checked() -> None:
    docs = PackedDocuments.from_seqlens([2, 2])
    q, kv = torch.randn(4, 4, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        packed_causal_attention(q, kv, kv, docs, backend="nope")
    with pytest.raises(ValueError, match="tokens"):
        packed_causal_attention(q[:3], kv[:3], kv[:3], docs)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        packed_causal_attention(torch.randn(4, 3, 8), kv, kv, docs)
    with pytest.raises(ValueError, match=r"\[T, heads, d\]"):
        packed_causal_attention(q[None], kv, kv, docs)
    assert set(PACKED_ATTENTION_BACKENDS) == {"auto", "varlen", "flex", "sdpa"}


def test_varlen_is_not_picked_on_the_cpu() -> None:
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    assert not varlen_available(q)
