"""TinyGPT: shapes, deterministic init without global RNG, causality, left-padding and KV-cache equivalence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core.models import TinyGPT, TinyGPTConfig

CFG = TinyGPTConfig(vocab_size=11, max_seq_len=16, d_model=16, n_layers=2, n_heads=2)
MODEL = TinyGPT(CFG, seed=3)


def _ids(seed: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_logits_and_values() -> None:
    ids = _ids(0, 3, 5)
    assert MODEL(ids).shape == (3, 5, CFG.vocab_size)
    assert MODEL(ids[:0]).shape == (0, 5, CFG.vocab_size)  # empty batches flow through
    critic = TinyGPT(TinyGPTConfig(**{**CFG.to_dict(), "value_head": True}), seed=0)
    values = critic(ids)
    assert values.shape == (3, 5)
    # a fresh value head predicts exactly 0 (zero-initialised), so a new critic starts unbiased
    assert torch.equal(values, torch.zeros(3, 5))


def test_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b, c = TinyGPT(CFG, seed=7), TinyGPT(CFG, seed=7), TinyGPT(CFG, seed=8)
    assert torch.equal(state, torch.random.get_rng_state())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(TinyGPT(CFG, generator=g).tok_emb.weight, a.tok_emb.weight)


def test_config_round_trip_and_validation() -> None:
    assert TinyGPTConfig.from_dict(CFG.to_dict()) == CFG
    with pytest.raises(ValueError, match="n_heads"):
        TinyGPTConfig(vocab_size=4, d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        TinyGPTConfig(vocab_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        MODEL(_ids(0, 1, CFG.max_seq_len + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        MODEL(_ids(0, 2, 4), attention_mask=torch.ones(2, 3))


@settings(max_examples=20)
@given(seed=st.integers(0, 10_000), length=st.integers(2, 10), cut=st.integers(1, 9))
def test_causal(seed: int, length: int, cut: int) -> None:
    cut = min(cut, length - 1)
    ids = _ids(seed, 2, length)
    changed = ids.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % CFG.vocab_size
    with torch.no_grad():
        assert torch.allclose(MODEL(ids)[:, :cut], MODEL(changed)[:, :cut], atol=1e-5)


@settings(max_examples=20)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 8), pad=st.integers(1, 6))
def test_left_padding_changes_nothing(seed: int, length: int, pad: int) -> None:
    """A left-padded row gets the same logits at its real positions as the unpadded row (positions from the mask)."""
    ids = _ids(seed, 1, length)
    padded = torch.cat([torch.full((1, pad), 5), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, length, dtype=torch.long)], dim=1)
    with torch.no_grad():
        ref = MODEL(ids)
        out = MODEL(padded, attention_mask=mask)
    assert torch.isfinite(out).all()  # padding queries attend to themselves: no NaN rows
    assert torch.allclose(out[:, pad:], ref, atol=1e-5)


@settings(max_examples=20)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    prefix=st.integers(1, 4),  # with four steps of 3: the model's max_seq_len of 16
    steps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_kv_cache_matches_full_forward(seed: int, batch: int, prefix: int, steps: list[int]) -> None:
    total = prefix + sum(steps)
    ids = _ids(seed, batch, total)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, total, dtype=torch.long)
    # random left padding inside the prefix, at least one real token per row
    for row in range(batch):
        mask[row, : int(torch.randint(0, prefix, (1,), generator=gen))] = 0
    with torch.no_grad():
        full = MODEL(ids, attention_mask=mask)
        cache = MODEL.new_cache()
        pieces = [MODEL(ids[:, :prefix], attention_mask=mask[:, :prefix], cache=cache)]
        start = prefix
        for n in steps:
            pieces.append(MODEL(ids[:, start : start + n], attention_mask=mask[:, : start + n], cache=cache))
            start += n
    assert cache.seq_len == total
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


def test_gradients_reach_every_parameter() -> None:
    """DDP without find_unused_parameters needs every parameter to get a gradient."""
    model = TinyGPT(CFG, seed=0)
    model(_ids(1, 2, 6)).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
