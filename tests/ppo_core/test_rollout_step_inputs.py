"""A decode step's inputs in one launch (``ppo_core_decode.step_inputs``): the kernel writes what its PyTorch
contract writes, and the contract is the rule (slot ``P + t - 1``, positions ``prompt_len + t - 1``, the fed token
recorded at the slot, the mask of the valid slots). The kernel runs under ``TRITON_INTERPRET=1`` on CPU where Triton
is installed, and on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode import step_inputs
from ppo_core_decode.kv_cache import KVCache
from ppo_core_decode.step_inputs import decode_step_inputs, decode_step_inputs_reference

INTERPRET = step_inputs.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and step_inputs.triton is not None
KERNEL_DEVICES = (["cpu"] if INTERPRET else []) + (
    [pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA else []
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(data, rows: int, length: int):
    width = data.draw(st.integers(1, length - 1))
    t = data.draw(st.integers(1, length - width))  # the slot inside the cache, as the decoder's steps are
    prompt_len = torch.tensor(
        data.draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows)), dtype=torch.long
    )
    valid = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=rows * length, max_size=rows * length)), dtype=torch.bool
    )
    fed = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), dtype=torch.bool)
    return torch.tensor(t), prompt_len, width, valid.view(rows, length), fed


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 5), length=st.integers(2, 40), record=st.booleans(), data=st.data())
def test_contract_is_the_rule(rows, length, record, data) -> None:
    t, prompt_len, width, valid, fed = _case(data, rows, length)
    dtype = data.draw(st.sampled_from(DTYPES))
    key_valid = valid.clone()
    out = decode_step_inputs_reference(t, prompt_len, width, key_valid, fed if record else None, dtype)
    slot = int(t) + width - 1
    expected = valid.clone()
    if record:
        expected[:, slot] = fed
    assert int(out.slot) == slot and int(out.filled) == slot + 1
    assert torch.equal(out.positions, (prompt_len + int(t) - 1)[:, None])
    assert torch.equal(key_valid, expected)
    assert out.mask.dtype == dtype and out.mask.shape == (rows, length)
    assert torch.equal(out.mask == 0, expected) and bool(torch.isneginf(out.mask[~expected]).all())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 4), length=st.integers(2, 2100), record=st.booleans(), data=st.data())
def test_kernel_equals_the_contract(device, rows, length, record, data) -> None:
    """Caches shorter than, as long as and longer than a block of slots (1024, a partial last block included),
    with and without a fed token to record, no rows (the contract), every mask dtype."""
    t, prompt_len, width, valid, fed = _case(data, rows, length)
    dtype = data.draw(st.sampled_from(DTYPES))
    got_valid, want_valid = valid.to(device), valid.clone()
    got = decode_step_inputs(
        t.to(device), prompt_len.to(device), width, got_valid, fed.to(device) if record else None, dtype
    )
    want = decode_step_inputs_reference(t, prompt_len, width, want_valid, fed if record else None, dtype)
    assert torch.equal(got_valid.cpu(), want_valid)
    for name in ("slot", "positions", "filled", "mask"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("device", ["cpu", *KERNEL_DEVICES])
def test_cache_begins_a_decode_step_as_begin_decode_does(device) -> None:
    """``KVCache.begin_decode_step`` (the decoder's) leaves the cache as ``begin_decode`` at slot ``P + t - 1``
    does, and sets and returns the positions."""
    g = torch.Generator().manual_seed(0)
    caches = [
        KVCache.allocate(
            layers=1, batch=3, kv_heads=1, head_dim=2, length=12, dtype=torch.bfloat16, device=device
        )
        for _ in range(2)
    ]
    valid = (torch.rand(3, 12, generator=g) > 0.4).to(device)
    fed = torch.tensor([True, False, True], device=device)
    prompt_len = torch.tensor([5, 2, 6], device=device)
    for cache in caches:
        cache.key_valid.copy_(valid)
    positions = caches[0].begin_decode_step(torch.tensor(3, device=device), prompt_len, 6, 10, fed_valid=fed)
    caches[1].begin_decode(torch.tensor(8, device=device), 10, fed_valid=fed)
    assert torch.equal(positions, (prompt_len + 2)[:, None]) and caches[0].positions is positions
    assert torch.equal(caches[0].key_valid, caches[1].key_valid)
    assert int(caches[0].slot) == 8 and caches[0].kv_len == 10 and caches[0].mode == "decode"
    assert (
        torch.equal(caches[0]._decode_mask, caches[1]._decode_mask) and caches[0]._decode_mask.shape[-1] == 10
    )
    assert int(caches[0]._filled) == int(caches[1]._filled) == 9
