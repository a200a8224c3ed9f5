"""Packing a padded micro-batch into one sequence and unpacking the response outputs, against per-row loops.

The oracle walks each row in Python: its valid tokens in order, their positions 0, 1, ... within the row, and for
each response column ``t`` the valid token at ``P + t - 1`` (if any) whose output predicts it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.kernels.packed_attention import PackedDocuments
from ppo_core.workers.packing import pack_micro_batch


@st.composite
def padded_micro_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``input_ids``, ``attention_mask [b, S]`` and ``R``: left-padded prompts, right-padded responses, and some
    rows with arbitrary masks (holes, all-masked rows)."""
    rows = draw(st.integers(1, 6))
    prompt = draw(st.integers(1, 5))
    response = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    seq = prompt + response
    ids = torch.randint(1, 50, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq, dtype=torch.long)
    for i in range(rows):
        kind = draw(st.sampled_from(["padded", "padded", "arbitrary", "empty"]))
        if kind == "padded":
            p = draw(st.integers(0, prompt))
            r = draw(st.integers(0, response))
            mask[i, prompt - p : prompt + r] = 1
        elif kind == "arbitrary":
            mask[i] = torch.randint(0, 2, (seq,), generator=g)
    return ids * mask, mask, response


def _oracle(ids: torch.Tensor, mask: torch.Tensor, r: int) -> dict:
    tokens, positions, seqlens, index, slots = [], [], [], [], []
    packed_at = {}
    for i in range(ids.shape[0]):
        n = 0
        for j in range(ids.shape[1]):
            if mask[i, j]:
                packed_at[i, j] = len(tokens)
                tokens.append(int(ids[i, j]))
                positions.append(n)
                n += 1
        seqlens.append(n)
    s = ids.shape[1]
    for i in range(ids.shape[0]):
        for t in range(r):
            if (i, s - r - 1 + t) in packed_at:
                index.append(packed_at[i, s - r - 1 + t])
                slots.append(i * r + t)
    return {"tokens": tokens, "positions": positions, "seqlens": seqlens, "index": index, "slots": slots}


@given(padded_micro_batches(), st.integers(1, 4), st.integers(1, 12))
def test_packing_matches_a_per_row_loop(case, multiple: int, min_tokens: int) -> None:
    ids, mask, r = case
    packed = pack_micro_batch(ids, mask, r, pad_to_multiple=multiple, min_tokens=min_tokens)
    ref = _oracle(ids, mask, r)
    n = len(ref["tokens"])
    total = packed.num_tokens
    assert total % multiple == 0 and total >= max(n, min_tokens) and total - max(n, min_tokens) < multiple
    assert packed.input_ids[:n].tolist() == ref["tokens"]
    assert packed.input_ids[n:].eq(0).all()
    docs = packed.documents
    pad = total - n
    assert list(docs.seqlens) == [k for k in ref["seqlens"] if k] + ([pad] if pad else [])
    assert docs.position_ids[:n].tolist() == ref["positions"]
    assert docs.position_ids[n:].tolist() == list(range(pad))
    assert docs.cu_seqlens.dtype == torch.int32 and docs.cu_seqlens[-1] == total
    assert packed.output_index.tolist() == ref["index"]
    assert packed.output_slots.tolist() == ref["slots"]


@given(padded_micro_batches())
def test_unpack_puts_each_output_at_its_response_token_and_zeros_elsewhere(case) -> None:
    ids, mask, r = case
    b = ids.shape[0]
    packed = pack_micro_batch(ids, mask, r)
    responses = ids[:, ids.shape[1] - r :]
    n = packed.output_index.shape[0]
    values = torch.arange(1, n + 1, dtype=torch.float64)
    grid = packed.unpack(values)
    assert grid.shape == (b, r)
    expected = torch.zeros(b * r, dtype=torch.float64)
    for k, slot in enumerate(packed.output_slots.tolist()):
        expected[slot] = k + 1
    assert torch.equal(grid.reshape(-1), expected)
    # the labels are the response tokens the outputs predict; trailing dimensions are kept
    assert packed.labels(responses).tolist() == [responses.reshape(-1)[s].item() for s in packed.output_slots]
    assert packed.unpack(torch.ones(n, 3)).shape == (b, r, 3)


def test_unpack_is_differentiable() -> None:
    ids = torch.tensor([[0, 3, 4, 5], [2, 3, 0, 0]])
    mask = (ids > 0).long()
    packed = pack_micro_batch(ids, mask, 2)
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (packed.unpack(values) * torch.tensor([[1.0, 10.0], [100.0, 1000.0]])).sum().backward()
    assert values.grad.tolist() == [1.0, 10.0, 100.0]


def test_a_micro_batch_without_valid_tokens_still_packs_one_token() -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    packed = pack_micro_batch(ids, torch.zeros_like(ids), 2)
    assert packed.num_tokens == 1 and packed.documents.seqlens == (1,)
    assert packed.output_index.numel() == 0
    assert torch.equal(packed.unpack(torch.zeros(0)), torch.zeros(2, 2))


def test_pack_micro_batch_rejects_bad_shapes_and_sizes() -> None:
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[b, S\]"):
        pack_micro_batch(ids, torch.ones(2, 3), 1)
    with pytest.raises(ValueError, match="response_len"):
        pack_micro_batch(ids, torch.ones_like(ids), 4)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        pack_micro_batch(ids, torch.ones_like(ids), 1, pad_to_multiple=0)
    packed = pack_micro_batch(ids, torch.ones_like(ids), 1)
    with pytest.raises(ValueError, match="one entry per output position"):
        packed.unpack(torch.zeros(5))


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8).filter(any))
def test_documents_from_seqlens(seqlens: list[int]) -> None:
    docs = PackedDocuments.from_seqlens(seqlens)
    kept = [n for n in seqlens if n]
    assert docs.seqlens == tuple(kept) and docs.total == sum(kept) and docs.max_seqlen == max(kept)
    assert docs.position_ids.tolist() == [j for n in kept for j in range(n)]
    assert docs.document_ids().tolist() == [i for i, n in enumerate(kept) for _ in range(n)]
    cu = docs.cu_seqlens.tolist()
    assert cu[0] == 0 and [cu[i + 1] - cu[i] for i in range(len(kept))] == kept and len(cu) == len(kept) + 1
    assert docs.document_ids() is docs.document_ids()  # cached


def test_documents_need_tokens_and_non_negative_lengths() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        PackedDocuments.from_seqlens([0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        PackedDocuments.from_seqlens([3, -1])
