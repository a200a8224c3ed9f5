"""The one-launch decode step (rotation + KV-cache write + attention) equals the two launches it replaces bit for bit:
outputs and the written cache (``TRITON_INTERPRET=1`` on CPU where Triton is installed, and on CUDA under the
``gpu`` marker, captured in a CUDA graph too). Split over the slots (``split > 1``), it writes the same cache and
gives the same outputs up to the order of the fp32 sums, the same bits at every call, and leaves its arrival
counters zero."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rollout_decode_rotary import _prompt as prompt_step
from test_rollout_decode_rotary import _step as rotary_step
from test_rollout_decode_rotary import _tolerance as rotary_tolerance

from ppo_core.kernels.fused import apply_rotary
from ppo_core_decode import decode_attention, decode_rotary_attention, kv_cache
from ppo_core_decode.decode_attention import decode_attention_sdpa, decode_attention_triton, default_block_l
from ppo_core_decode.decode_rotary import rotate_and_write, rotate_and_write_triton
from ppo_core_decode.decode_rotary_attention import default_split, rotate_write_attend_triton
from ppo_core_decode.eager_rounding import rotary_as_model
from ppo_core_decode.kv_cache import KVCache
from ppo_core_decode.split_launch import arrival_counters

INTERPRET = decode_rotary_attention.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and decode_rotary_attention.triton is not None
DEVICES = (["cpu"] if INTERPRET else []) + ([pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the split's outputs differ from the unsplit kernel's by the order of fp32 sums and, in half precision, by the
# rounding of the probabilities before their product with the values: a few steps of the output dtype at most
SPLIT_TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4 * 2.0**-10, "rtol": 4 * 2.0**-10},
    torch.bfloat16: {"atol": 4 * 2.0**-7, "rtol": 4 * 2.0**-7},
}
# the interpreter's bf16 products are wrong (both kernels equally, so the bit-for-bit tests above still hold, but
# not the tolerance of a split against the unsplit kernel): bf16 there only on CUDA
SPLIT_DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if CUDA else []
)
kernel = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA, or TRITON_INTERPRET=1 with Triton")


def _step(b: int, h: int, g: int, d: int, length: int, kv_len: int, slot: int, dtype, device, seed: int):
    """A decode step: q/k/v as strided views of one fused projection ``[B, 1, (H + 2G) d]`` (as the engines give
    them), per-row tables (in the model dtype, as the HF engine holds them, for ``model_rounding``), a cache whose
    slots at and past ``slot`` hold NaN (written by this step or never: no kernel may read them from memory), and an
    additive ``[B, 1, 1, kv_len]`` mask: row 0 left-padded, row 1 sees only the new slot, the others a random
    subset of the filled slots and the new one."""
    q, k, v, cos, sin, cache = rotary_step(b, h, g, d, length, dtype, device, seed)
    cache[:, :, :, slot:] = float("nan")
    gen = torch.Generator().manual_seed(seed + 1)
    visible = torch.rand(b, kv_len, generator=gen) > 0.3
    visible[0, : slot // 2] = False  # left padding
    if b > 1:
        visible[1] = False  # a prompt of no real token (or every one after it masked): the new slot alone
    visible[:, slot] = True
    bias = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    return q, k, v, cos, sin, cache, bias.to(device)


def _two_launches(q, k, v, cos, sin, cache, slot, bias, scale, model_rounding, block_l):
    """Today's path: the rotation and cache write, then the attention up to the filled slots."""
    kv_len = bias.shape[-1]
    q = rotate_and_write_triton(q, k, v, cos, sin, *cache, slot, model_rounding=model_rounding)
    keys, values = cache[0][:, :, :kv_len], cache[1][:, :, :kv_len]
    return decode_attention_triton(q, keys, values, bias, scale, filled=slot + 1, block_l=block_l)


def _check_equal(
    b, h, g, d, length, kv_len, slot, dtype, device, model_rounding, block_l, seed, num_stages=None
) -> None:
    q, k, v, cos, sin, cache, bias = _step(b, h, g, d, length, kv_len, slot, dtype, device, seed)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    index = torch.tensor(slot, device=device)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = _two_launches(q, k, v, cos, sin, want_cache, index, bias, 0.3, model_rounding, block_l)
    got = rotate_write_attend_triton(
        q,
        k,
        v,
        cos,
        sin,
        *got_cache,
        index,
        bias,
        0.3,
        model_rounding=model_rounding,
        block_l=block_l,
        split=1,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    assert got.isfinite().all()
    assert torch.equal(got, want)
    # the cache equal, NaN included: nothing written past the slot
    assert torch.equal(got_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))
    assert not got_cache[:, :, :, slot].isnan().any()


# (b, h, g, d, cache length, kv_len, slot, block_l): REP 1, 2, 4 (and 3); the new slot first in the cache, at the
# end of a block, the first of a block, inside one; kv_len past the slot (a bucket) or ending on it
CASES = [
    (1, 4, 4, 16, 8, 8, 0, 64),
    (2, 8, 4, 32, 70, 64, 63, 64),
    (3, 8, 2, 64, 100, 96, 64, 64),
    (4, 16, 4, 64, 40, 40, 37, 16),
    (5, 12, 4, 32, 50, 48, 47, 16),
    (3, 4, 1, 16, 20, 20, 5, 16),
    # both kernels' default blocks (default_block_l: 32 slots of 128-wide heads), the slot inside the third block
    (2, 4, 2, 128, 70, 70, 66, None),
]


@given(log_d=st.integers(0, 12))
def test_default_block_l_keeps_a_block_at_4096_entries_within_16_to_64_slots(log_d: int) -> None:
    d = 2**log_d
    block = default_block_l(d)
    assert 16 <= block <= 64 and block & (block - 1) == 0
    assert block == min(64, max(16, 4096 // d))
    # a block's key tile is 4096 entries wherever the clamp does not bind
    assert block * d == 4096 or block in (16, 64)


def test_both_decode_kernels_default_to_the_same_blocks() -> None:
    """The one-launch kernel gives the two launches' bits only over the same blocks: neither may fix its own."""
    import inspect

    for fn in (decode_attention_triton, rotate_write_attend_triton):
        assert inspect.signature(fn).parameters["block_l"].default is None


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_rounding", [False, True])
@pytest.mark.parametrize(("b", "h", "g", "d", "length", "kv_len", "slot", "block_l"), CASES)
def test_one_launch_equals_the_two(
    device, dtype, model_rounding, b, h, g, d, length, kv_len, slot, block_l
) -> None:
    _check_equal(b, h, g, d, length, kv_len, slot, dtype, device, model_rounding, block_l, seed=b * h + slot)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "g", "d", "length", "kv_len", "slot", "block_l"), CASES)
def test_one_launch_equals_the_two_at_every_pipeline_depth(
    num_stages, dtype, b, h, g, d, length, kv_len, slot, block_l
) -> None:
    """The compiled kernel's software pipeline (with the L2 prefetch before the PDL wait, the register cap and the
    plain body for the blocks below the new slot) gives the same bits at any depth, not only the default three."""
    _check_equal(
        b,
        h,
        g,
        d,
        length,
        kv_len,
        slot,
        dtype,
        "cuda",
        True,
        block_l,
        seed=b * h + slot,
        num_stages=num_stages,
    )


@pytest.mark.skipif(not INTERPRET, reason="random shapes under TRITON_INTERPRET=1 (the CPU)")
@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 5),
    g=st.integers(1, 3),
    rep=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([16, 32, 64]),
    kv_len=st.integers(1, 80),
    slot_from_end=st.integers(0, 20),
    dtype=st.sampled_from(DTYPES),
    model_rounding=st.booleans(),
    block_l=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
)
def test_one_launch_equals_the_two_for_random_shapes(
    b, g, rep, d, kv_len, slot_from_end, dtype, model_rounding, block_l, seed
) -> None:
    slot = max(kv_len - 1 - slot_from_end, 0)
    _check_equal(b, g * rep, g, d, kv_len + 3, kv_len, slot, dtype, "cpu", model_rounding, block_l, seed)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_a_shared_fp32_mask_row_is_read_as_the_two_launches_read_it(device) -> None:
    q, k, v, cos, sin, cache, bias = _step(3, 8, 2, 32, 30, 30, 20, torch.bfloat16, device, seed=5)
    bias = bias[:1].float()  # [1, 1, 1, kv_len] for every row
    index = torch.tensor(20, device=device)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = _two_launches(q, k, v, cos, sin, want_cache, index, bias, None, False, 64)
    got = rotate_write_attend_triton(
        q, k, v, cos, sin, *got_cache, index, bias, model_rounding=False, split=1
    )
    assert torch.equal(got, want)
    assert torch.equal(got_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_are_named(device) -> None:
    q, k, v, cos, sin, cache, bias = _step(2, 4, 2, 16, 8, 8, 3, torch.float32, device, seed=2)
    slot = torch.tensor(3, device=device)
    with pytest.raises(ValueError, match="k have none"):
        rotate_write_attend_triton(
            q, k.transpose(-1, -2), v, cos, sin, *cache, slot, bias, model_rounding=False
        )
    with pytest.raises(ValueError, match="cos and sin"):
        rotate_write_attend_triton(
            q, k, v, cos, sin[:1].expand_as(cos), *cache, slot, bias, model_rounding=False
        )
    with pytest.raises(ValueError, match="slot"):
        rotate_write_attend_triton(
            q, k, v, cos, sin, *cache, slot.view(1).expand(2), bias, model_rounding=False
        )
    with pytest.raises(ValueError, match="more than the cache"):
        wide = torch.zeros(2, 1, 1, 9, device=device)
        rotate_write_attend_triton(q, k, v, cos, sin, *cache, slot, wide, model_rounding=False)
    with pytest.raises(ValueError, match="multiple"):
        rotate_write_attend_triton(q[:, :3], k, v, cos, sin, *cache, slot, bias, model_rounding=False)


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_rounding", [False, True])
def test_attend_rotated_gives_the_same_bits_fused_or_not(device, model_rounding, monkeypatch) -> None:
    """``KVCache.attend_rotated`` in a decode step, one launch (the default) or two (``FUSED_DECODE = False``):
    same outputs, same cache (at a shape the one launch does not split)."""
    if device == "cpu":  # the interpreter runs the kernels that the cache offers on CUDA only
        monkeypatch.setattr(kv_cache, "rotate_and_write_triton_available", lambda q: True)
        monkeypatch.setattr(decode_attention, "triton_available", lambda device: True)
    monkeypatch.delenv("PPO_CORE_DECODE_ATTENTION", raising=False)
    b, h, g, d, length, slot, kv_len = 3, 8, 2, 32, 24, 10, 16
    assert default_split(b * g, kv_len, 64, torch.device(device)) == 1
    dtype = torch.bfloat16
    q, k, v, cos, sin, _, _ = _step(b, h, g, d, length, kv_len, slot, dtype, device, seed=9)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)

    def tables() -> tuple[torch.Tensor, torch.Tensor]:
        return cos[:, None], sin[:, None]  # [B, S = 1, d]

    outs, caches = [], []
    for fused in (True, False):
        monkeypatch.setattr(kv_cache, "FUSED_DECODE", fused)
        cache = KVCache.allocate(
            layers=1, batch=b, kv_heads=g, head_dim=d, length=length, dtype=dtype, device=device
        )
        cache.keys[0].normal_(generator=torch.Generator(device).manual_seed(1))
        cache.values[0].normal_(generator=torch.Generator(device).manual_seed(2))
        cache.key_valid[:, : slot + 1] = True
        cache.key_valid[0, :4] = False  # left padding
        cache.begin_decode(torch.tensor(slot, device=device), kv_len)

        def unused(q, k):
            raise AssertionError("a decode step on the kernels does not rotate in PyTorch")

        outs.append(cache.attend_rotated(0, q, k, v, unused, tables, 0.2, model_rounding=model_rounding))
        caches.append((cache.keys[0], cache.values[0]))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model_rounding", [False, True])
def test_graph_replay_equals_the_two_launches(dtype, model_rounding) -> None:
    """Captured once in a CUDA graph (static buffers, the slot a device scalar), replayed at other slots and inputs:
    each replay gives the two eager launches' outputs and cache (Llama-3.2-1B's heads, a bucket of 384 slots)."""
    b, h, g, d, length, kv_len = 6, 32, 8, 64, 400, 384
    q, k, v, cos, sin, cache, bias = _step(b, h, g, d, length, kv_len, 100, dtype, "cuda", seed=0)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    slot = torch.tensor(100, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        rotate_write_attend_triton(
            q, k, v, cos, sin, *cache, slot, bias, model_rounding=model_rounding, split=1
        )
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotate_write_attend_triton(
            q, k, v, cos, sin, *cache, slot, bias, model_rounding=model_rounding, split=1
        )
    for step, at in enumerate([0, 63, 64, 200, 383]):
        q2, k2, v2, cos2, sin2, cache2, bias2 = _step(
            b, h, g, d, length, kv_len, at, dtype, "cuda", seed=step + 1
        )
        if model_rounding:
            cos2, sin2 = cos2.to(dtype), sin2.to(dtype)
        for static, new in zip(
            (q, k, v, cos, sin, cache, bias), (q2, k2, v2, cos2, sin2, cache2, bias2), strict=True
        ):
            static.copy_(new)
        slot.fill_(at)
        graph.replay()
        index = torch.tensor(at, device="cuda")
        want = _two_launches(q2, k2, v2, cos2, sin2, cache2, index, bias2, None, model_rounding, 64)
        assert torch.equal(out, want), f"slot {at}"
        assert torch.equal(cache.nan_to_num(7.0), cache2.nan_to_num(7.0)), f"slot {at}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaN equal to itself)."""
    return t.contiguous().view(torch.uint8)


def _check_split(
    b, h, g, d, length, kv_len, slot, dtype, device, split, block_l, seed, masked_rows=(), scale=0.3
) -> None:
    """``split`` programs per (row, group) against the two launches (the unsplit kernel's bits): the same cache, the
    outputs within :data:`SPLIT_TOLERANCE` (equal with ``split = 1``), NaN exactly on the rows whose every slot is
    masked, the same bits on a second call, and the arrival counters zero after it."""
    q, k, v, cos, sin, cache, bias = _step(b, h, g, d, length, kv_len, slot, dtype, device, seed)
    for row in masked_rows:
        bias[row] = float("-inf")
    index = torch.tensor(slot, device=device)
    want_cache, got_cache, again_cache = cache.clone(), cache.clone(), cache.clone()
    want = _two_launches(q, k, v, cos, sin, want_cache, index, bias, scale, False, block_l)
    args = (q, k, v, cos, sin)
    got = rotate_write_attend_triton(
        *args, *got_cache, index, bias, scale, model_rounding=False, block_l=block_l, split=split
    )
    again = rotate_write_attend_triton(
        *args, *again_cache, index, bias, scale, model_rounding=False, block_l=block_l, split=split
    )
    nan_rows = torch.zeros(b, dtype=torch.bool, device=device)
    nan_rows[list(masked_rows)] = True
    assert torch.equal(got.isnan().any(-1).any(-1).any(-1), nan_rows)
    assert torch.equal(want.isnan(), got.isnan())
    if split == 1:
        assert torch.equal(_bits(got), _bits(want))
    else:
        torch.testing.assert_close(got, want, equal_nan=True, **SPLIT_TOLERANCE[dtype])
    assert torch.equal(_bits(got), _bits(again))
    assert torch.equal(got_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))
    assert not arrival_counters(torch.device(device), 1).any()


# (b, h, g, d, cache length, kv_len, slot, block_l, split): two and more chunks, the slot in the last chunk or in
# the first (every later chunk empty), more splits than blocks, a split that does not divide the blocks
SPLIT_CASES = [
    (3, 8, 2, 64, 100, 96, 80, 16, 2),
    (2, 4, 1, 32, 200, 200, 190, 16, 4),
    (2, 8, 2, 32, 200, 160, 159, 16, 3),
    (4, 16, 4, 64, 70, 64, 10, 16, 4),
    (3, 12, 4, 16, 50, 48, 40, 16, 16),
    (2, 4, 2, 16, 300, 256, 255, 64, 8),
]


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
@pytest.mark.parametrize(("b", "h", "g", "d", "length", "kv_len", "slot", "block_l", "split"), SPLIT_CASES)
def test_split_equals_the_unsplit_kernel_up_to_summation_order(
    device, dtype, b, h, g, d, length, kv_len, slot, block_l, split
) -> None:
    _check_split(b, h, g, d, length, kv_len, slot, dtype, device, split, block_l, seed=b + slot)


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [1, 2, 5])
def test_a_row_with_every_slot_masked_gives_nan_split_or_not(device, split) -> None:
    """As SDPA and the unsplit kernel do: no slot to attend, no output (and the other rows unaffected)."""
    _check_split(4, 8, 2, 32, 80, 80, 70, torch.float32, device, split, 16, seed=3, masked_rows=(0, 2))


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("slot", "split"), [(20, 4), (150, 3), (159, 8)])
def test_split_combines_scores_past_exp_range(device, slot, split) -> None:
    """Scores of several hundred (``exp`` overflows fp32 past 88): each chunk's state is relative to its own
    maximum and the combine rescales to the largest of them, empty chunks (``m = -inf``) included."""
    _check_split(3, 8, 2, 32, 170, 160, slot, torch.float32, device, split, 16, seed=6, scale=60.0)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_split_equals_sdpa_over_the_written_cache(device) -> None:
    """The split kernel against the reference attention (fp32, which the interpreter multiplies exactly): SDPA over
    the cache written by the PyTorch contract of the rotation, the slots past the new one masked."""
    b, h, g, d, length, kv_len, slot = 3, 8, 2, 32, 130, 128, 100
    q, k, v, cos, sin, cache, bias = _step(b, h, g, d, length, kv_len, slot, torch.float32, device, seed=4)
    index = torch.tensor(slot, device=device)
    got = rotate_write_attend_triton(
        q, k, v, cos, sin, *cache.clone(), index, bias, model_rounding=False, block_l=16, split=4
    )
    want_cache = cache.clone()
    q_rot = rotate_and_write(q, k, v, cos, sin, *want_cache, index, model_rounding=False)
    filled = torch.arange(kv_len, device=device) <= slot
    keys, values = (t[:, :, :kv_len].nan_to_num(0.0) for t in want_cache)
    want = decode_attention_sdpa(q_rot, keys, values, bias.masked_fill(~filled, float("-inf")))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="random shapes under TRITON_INTERPRET=1 (the CPU)")
@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    g=st.integers(1, 3),
    rep=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([16, 32]),
    kv_len=st.integers(1, 150),
    slot_from_end=st.integers(0, 150),
    split=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    block_l=st.sampled_from([16, 32]),
    masked_first_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_split_equals_the_unsplit_kernel_for_random_shapes(
    b, g, rep, d, kv_len, slot_from_end, split, dtype, block_l, masked_first_row, seed
) -> None:
    """Any split (1: the same bits; more splits than blocks: empty chunks), the slot anywhere in the filled range
    (so in the first chunk, the last or one between), a fully masked row or not."""
    slot = max(kv_len - 1 - slot_from_end, 0)
    masked_rows = (0,) if masked_first_row else ()
    _check_split(b, g * rep, g, d, kv_len + 3, kv_len, slot, dtype, "cpu", split, block_l, seed, masked_rows)


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_split_is_named(device) -> None:
    q, k, v, cos, sin, cache, bias = _step(2, 4, 2, 16, 8, 8, 3, torch.float32, device, seed=2)
    slot = torch.tensor(3, device=device)
    for split in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="split must be a positive int"):
            rotate_write_attend_triton(
                q, k, v, cos, sin, *cache, slot, bias, model_rounding=False, split=split
            )


def test_default_split_fills_the_gpu_with_whole_blocks() -> None:
    """Powers of two until ``B G S`` programs are two per SM (132 off CUDA), never more than the blocks of
    ``kv_len``; 1 where the (row, group) pairs already are that many."""
    cpu = torch.device("cpu")
    assert default_split(64 * 8, 384, 64, cpu) == 1  # Llama-3.2-1B at B = 64: 512 programs
    assert default_split(256 * 8, 384, 64, cpu) == 1
    assert default_split(16 * 8, 384, 64, cpu) == 4  # 128 pairs: 512 programs
    assert default_split(8, 384, 64, cpu) == 4  # capped by the 6 blocks
    assert default_split(8, 4096, 64, cpu) == 64
    assert default_split(1, 64, 64, cpu) == 1
    assert default_split(1, 65, 64, cpu) == 2
    for programs in (1, 3, 48, 100, 263, 264, 4000):
        for kv_len in (1, 63, 64, 200, 1000):
            split = default_split(programs, kv_len, 64, cpu)
            assert split & (split - 1) == 0 and split <= max(1, -(-kv_len // 64))
            assert programs * split >= 2 * 132 or 2 * split > -(-kv_len // 64)
            assert split == 1 or programs * split // 2 < 2 * 132  # the smallest such power


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_graph_replay_equals_the_unsplit_kernel(dtype) -> None:
    """With few rows over a long cache (8 rows of Llama-3.2-1B's heads, a bucket of 2048 slots) the default split is
    > 1; captured in a CUDA graph and replayed at other slots and inputs, it writes the unsplit kernel's cache and gives
    its outputs within :data:`SPLIT_TOLERANCE`, the same bits on a second replay, its counters zero after each; and
    every explicit split gives the same outputs eagerly."""
    b, h, g, d, length, kv_len = 8, 32, 8, 64, 2100, 2048
    assert default_split(b * g, kv_len, 64, torch.device("cuda")) > 1
    q, k, v, cos, sin, cache, bias = _step(b, h, g, d, length, kv_len, 100, dtype, "cuda", seed=0)
    slot = torch.tensor(100, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        rotate_write_attend_triton(q, k, v, cos, sin, *cache, slot, bias, model_rounding=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotate_write_attend_triton(q, k, v, cos, sin, *cache, slot, bias, model_rounding=False)
    for step, at in enumerate([0, 63, 64, 200, 1000, 2047]):
        q2, k2, v2, cos2, sin2, cache2, bias2 = _step(
            b, h, g, d, length, kv_len, at, dtype, "cuda", seed=step + 1
        )
        for static, new in zip(
            (q, k, v, cos, sin, cache, bias), (q2, k2, v2, cos2, sin2, cache2, bias2), strict=True
        ):
            static.copy_(new)
        slot.fill_(at)
        graph.replay()
        first = out.clone()
        cache.copy_(cache2)
        graph.replay()
        assert torch.equal(_bits(out), _bits(first)), f"slot {at}"
        assert not arrival_counters(out.device, 1).any()
        index = torch.tensor(at, device="cuda")
        unsplit_cache = cache2.clone()
        want = rotate_write_attend_triton(
            q2, k2, v2, cos2, sin2, *unsplit_cache, index, bias2, model_rounding=False, split=1
        )
        torch.testing.assert_close(
            out, want, **SPLIT_TOLERANCE[dtype], msg=lambda m, at=at: f"slot {at}: {m}"
        )
        assert torch.equal(cache.nan_to_num(7.0), unsplit_cache.nan_to_num(7.0)), f"slot {at}"
        for split in (2, 4, 8, 16):
            eager = rotate_write_attend_triton(
                q2, k2, v2, cos2, sin2, *cache2.clone(), index, bias2, model_rounding=False, split=split
            )
            torch.testing.assert_close(eager, want, **SPLIT_TOLERANCE[dtype])


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_rounding", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("last_query_only", [False, True])
def test_attend_rotated_prefill_is_the_same_on_the_kernel_or_not(
    device, model_rounding, padded, last_query_only, monkeypatch
) -> None:
    """``KVCache.attend_rotated`` in a prefill: the one-launch rotation and cache write, then attention over the
    cache's slots, gives the caller's rotation followed by :meth:`KVCache.attend`: the same cache and outputs
    (bit for bit where the kernel and the caller's rotation round alike: see ``_tolerance``)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter truncates to bf16
    b, h, g, s, d, length = 3, 8, 2, 6, 32, 10
    q, k, v, cos, sin, _ = prompt_step(b, h, g, s, d, length, dtype, device, seed=5)
    if model_rounding:
        cos, sin = cos.to(dtype), sin.to(dtype)
    prompt_mask = torch.ones(b, s, dtype=torch.bool, device=device)
    if padded:
        prompt_mask[0, :2] = False
        prompt_mask[2, :5] = False

    def rotate(q, k):
        rule = rotary_as_model if model_rounding else apply_rotary
        return rule(q, k, cos[:, None], sin[:, None])

    outs, caches = [], []
    for offered in (True, False):
        if device == "cpu" or not offered:
            monkeypatch.setattr(kv_cache, "rotate_and_write_triton_available", lambda q, on=offered: on)
        cache = KVCache.allocate(
            layers=1, batch=b, kv_heads=g, head_dim=d, length=length, dtype=dtype, device=device
        )
        cache.begin_prefill(prompt_mask)
        cache.last_query_only = last_query_only
        if offered:
            out = cache.attend_rotated(
                0, q, k, v, _unused_rotation, lambda: (cos, sin), 0.2, model_rounding=model_rounding
            )
        else:
            out = cache.attend_rotated(0, q, k, v, rotate, _unused_tables, 0.2, model_rounding=model_rounding)
        outs.append(out)
        caches.append(torch.stack((cache.keys[0], cache.values[0])))
    assert outs[0].shape == (b, h, 1 if last_query_only else s, d)
    tol = rotary_tolerance(device, dtype, model_rounding)
    torch.testing.assert_close(caches[0], caches[1], **tol)
    assert torch.equal(caches[0][:, :, :, s:], torch.zeros_like(caches[0][:, :, :, s:]))
    if tol["atol"] == 0:
        assert torch.equal(outs[0], outs[1])
    else:  # the scores move with the keys' last bits: the outputs by a few steps of bf16 at most
        torch.testing.assert_close(outs[0], outs[1], atol=8 * 2.0**-7, rtol=0)


def _unused_rotation(q, k):
    raise AssertionError("the kernel rotates a prefill on CUDA")


def _unused_tables():
    raise AssertionError("the caller's rotation needs no tables")


@kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
@pytest.mark.parametrize(("rep", "split"), [(2, 1), (2, 2), (1, 1), (4, 3)])
def test_qk_norm_in_the_launch_is_the_models_norms_before_it(device, dtype, rep, split) -> None:
    """Qwen3's per-head query and key norms inside the launch (``qk_norm``) against the model's norm
    (``rms_norm_as_model``: eager on the CPU, compiled on CUDA) of the same views before the launch without them:
    the same outputs and cache up to the order of the fp32 sum of squares (one step of the dtype at most)."""
    from ppo_core_decode.eager_rounding import rms_norm_as_model

    g, d, length, kv_len, slot = 2, 32, 40, 40, 37
    q, k, v, cos, sin, cache, bias = _step(
        3, g * rep, g, d, length, kv_len, slot, dtype, device, seed=5 + rep
    )
    gen = torch.Generator().manual_seed(6)
    q_w = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype).to(device)
    k_w = torch.randn(d, generator=gen).to(dtype).to(device)  # signs too, unlike q's
    eps = 1e-6
    index = torch.tensor(slot, device=device)
    want_cache, got_cache = cache.clone(), cache.clone()
    tiling = {"model_rounding": True, "block_l": 16, "split": split}
    want = rotate_write_attend_triton(
        rms_norm_as_model(q, q_w, eps),
        rms_norm_as_model(k, k_w, eps),
        v,
        cos.to(dtype),
        sin.to(dtype),
        *want_cache,
        index,
        bias,
        0.3,
        **tiling,
    )
    got = rotate_write_attend_triton(
        q, k, v, cos.to(dtype), sin.to(dtype), *got_cache, index, bias, 0.3, qk_norm=(q_w, k_w, eps), **tiling
    )
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, **SPLIT_TOLERANCE[dtype])
    written = (slice(None), slice(None), slice(None), slice(0, slot + 1))
    torch.testing.assert_close(got_cache[written], want_cache[written], **SPLIT_TOLERANCE[dtype])
    assert got_cache[:, :, :, slot + 1 :].isnan().all()  # nothing written past the slot


@kernel
@pytest.mark.parametrize("device", DEVICES)
def test_qk_norm_weights_are_checked(device) -> None:
    q, k, v, cos, sin, cache, bias = _step(2, 4, 2, 16, 8, 8, 3, torch.float32, device, seed=1)
    index = torch.tensor(3, device=device)
    w = torch.ones(16, device=device)
    for bad, match in (
        ((w[:8], w, 1e-6), r"q_weight must be \[16\]"),
        ((w, w.half(), 1e-6), "k_weight must be"),
        ((w, w), r"\(q_weight, k_weight, eps\)"),
        ((w, torch.ones(16, 2, device=device)[:, 0], 1e-6), "contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            rotate_write_attend_triton(
                q, k, v, cos, sin, *cache, index, bias, model_rounding=False, qk_norm=bad
            )


def test_qk_norm_is_refused_off_the_rotation_kernels() -> None:
    """The norms go into a rotation kernel only: asked of another path (here the CPU's), the caller must
    normalise."""
    cache = KVCache.allocate(
        layers=1, batch=1, kv_heads=1, head_dim=4, length=4, dtype=torch.float32, device="cpu"
    )
    q = k = v = torch.zeros(1, 1, 1, 4)
    assert not cache.rotates_in_kernel(q, k, v)
    with pytest.raises(ValueError, match="rotation kernels only"):
        cache.attend_rotated(
            0,
            q,
            k,
            v,
            lambda q, k: (q, k),
            lambda: (q, q),
            model_rounding=False,
            qk_norm=(q[0, 0, 0],) * 2 + (1e-6,),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 5, 40, 100])
def test_the_decode_kernel_takes_a_sliding_windows_mask(device, window):
    """The generic path's sliding window (``KVCache.attend(..., window=W)``) reaches the Triton decode kernel as
    ``-inf`` bias on the slots ``W`` or more behind the step's: whole leading blocks masked, then a partly masked
    block. The kernel gives SDPA's attention over the same bias."""
    g = torch.Generator().manual_seed(window)
    b, h, groups, d, length, slot = 3, 4, 2, 16, 150, 140
    q = torch.randn(b, h, 1, d, generator=g).to(device)
    k = torch.randn(b, groups, length, d, generator=g).to(device)
    v = torch.randn(b, groups, length, d, generator=g).to(device)
    valid = torch.rand(b, length, generator=g) > 0.2
    valid[:, slot] = True
    valid[:, slot + 1 :] = False
    slots = torch.arange(length)
    bias = torch.zeros(b, 1, 1, length).masked_fill(~valid[:, None, None, :], float("-inf"))
    bias = bias.masked_fill(slots <= slot - window, float("-inf")).to(device)
    out = decode_attention_triton(q, k, v, bias, filled=torch.tensor(slot + 1, device=device))
    torch.testing.assert_close(out, decode_attention_sdpa(q, k, v, bias), atol=2e-6, rtol=2e-6)
