"""A layer's whole decode step after its projections in one Triton launch: rotary embedding, KV-cache write, attention.

Unfused, a decode step on CUDA runs :func:`~ppo_core_decode.decode_rotary.rotate_and_write_triton` (rotate the new
query and key, write the key and value at the step's slot) and then
:func:`~ppo_core_decode.decode_attention.decode_attention_triton` (attend over the filled slots): two launches per
layer, the second waiting on the first. Here the programs of a (row ``b``, key/value head ``g``):

1. rotate the group's ``H / G`` query heads and its new key by the row's ``cos``/``sin`` with the arithmetic of
   :mod:`ppo_core_decode.decode_rotary` (the same Triton function, both ``model_rounding`` rules); where asked
   (``qk_norm``: Qwen3's ``q_norm`` and ``k_norm``), first normalise each of them over the head width in the model's
   roundings (the head times ``1 / sqrt(mean(t^2) + eps)`` in fp32, rounded to the model dtype, then times the
   weight, rounded), which saves the step a launch a layer between the q/k/v product and this one; the sum of
   squares is in this kernel's fp32 order, so a head may differ by one step of the model dtype from the compiled
   norm's, whose order is its own;
2. write the rotated key and the value into the cache at ``slot`` (one program of the ``(b, g)`` does, so each
   cache row is written once);
3. attend over the slots ``< n = min(kv_len, slot + 1)`` as :mod:`ppo_core_decode.decode_attention`'s kernel does
   (same blocks, same online softmax). Unsplit (``S = 1``, below), the program has written the new slot's key and
   value itself before a barrier, so its threads read them back from the cache like any other slot (a CTA's
   barrier orders its threads' global stores before their later loads); split, the program whose chunk holds the
   slot takes them from its registers instead (another program wrote the cache, and nothing orders that store
   before this program's loads), and its loads skip that slot.

**Split over the slots** (flash-decoding). With one program per ``(b, g)`` each program walks its blocks of slots one
after the other; with few rows over a long cache that leaves too few programs, so too few loads in flight, to read
the cache at the memory's bandwidth. So the ``n`` slots are split into
``S`` contiguous chunks of ``ceil(ceil(n / S) / BLOCK_L) * BLOCK_L`` slots, one program each (grid ``(B, G, S)``;
the chunks are computed in the kernel from ``n``, since ``slot`` is a device scalar and the grid of a launch
captured in a CUDA graph cannot depend on it; late chunks may be empty). Every program rotates the query itself
(cheap); the program of split 0 writes the cache, and the program whose chunk holds ``slot`` takes the new key and
value from its registers. Each program writes its partial online-softmax state to an fp32 workspace: running max
``m_s [REP]``, sum ``l_s [REP]`` and unnormalised output ``acc_s [REP, d]`` (``m_s = -inf``, ``l_s = 0``,
``acc_s = 0`` for an empty chunk). The partials are combined in the same launch: each program adds one to its
``(b, g)``'s arrival counter (:func:`~ppo_core_decode.split_launch.arrival_counters`), and the program that
arrives last computes ``M = max_s m_s`` and ``out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s``, summing
``s = 0, ..., S - 1`` in that order whichever program combines, so the result does not depend on the order of
arrival (two calls give the same bits), and resets the counter to zero for the next call (or graph replay).

**Prefetch before the wait** (with PDL): a program reads the slot before waiting for the previous kernel (the q/k/v
product) and fetches its first block of cached keys and values into the L2 (``prefetch.global.L2``, no registers
held for the data): the slot is written by the step's first kernels and the cached slots by earlier steps, all
finished before the previous kernel started, so the first block's memory latency overlaps that kernel's end.

**The loop's cost.** At a rollout's batch sizes the kernel is bound by its loop's arithmetic rather than its reads
(it keeps most of its time with the cache loads replaced by constants): per block of slots two 16-row MMAs for the
group's query heads, the softmax's reductions across the warps and the layout changes between them. A program
therefore walks the blocks wholly below the new slot with a body of its own: every slot in them is cached and
attended, so the loads take no masks and no slot is swapped for the new key or value (the values are the ones the
general body computes, so the bits are too); only the block holding the new slot, and a chunk's last block, run the
general body. Each block's additive bias is loaded one block ahead (the next block's bias while this one is
computed, carried in registers), in both loops: loaded in the block that adds it, as Triton's pipeliner leaves a load
that does not feed a product, every block paid an L2 round trip before its softmax (the bias loads sat between the
block's cache-tile wait and its scores). The values, so the bits, are the same. Unsplit, the block holding the new
slot reads it from the cache (step 3) rather than selecting the registers' key and value into the loaded tiles:
that select kept the tiles in registers and made the loop body longer and the kernel slower, for the same bits. The
pipeline is three stages deep (the default ``num_stages``): under the register cap (:data:`MAX_REGISTERS`) it is as
fast as two or faster at a rollout's sizes. The timings behind these choices are in ``docs/performance.md``.

With ``S = 1`` (the default where ``B G`` programs already fill the GPU) the kernel is the unsplit one: every value
entering the attention equals the unfused path's bit for bit (the rotated query is rounded to the model dtype there
by its store, here by the rotation itself), so the two paths give the same outputs and cache; the tests check it
under ``TRITON_INTERPRET=1`` and on CUDA. With ``S > 1`` the scores are the same but the softmax is rescaled per
chunk: the outputs differ from the unfused path's by the order of the fp32 sums and, in half precision, by the
rounding of the probabilities to the model dtype before their product with the values (taken relative to the
chunk's running maximum instead of the whole range's); the cache is the same. A row whose every attended slot is
masked gives NaN, as the unsplit kernel (and SDPA) does.

Shapes: ``q [B, H, 1, d]``, ``k``/``v [B, G, 1, d]`` (any strides, last dimension contiguous), ``cos``/``sin
[B, d]``, cache ``keys``/``values [B, G, L, d]``, ``bias [B, 1, 1, kv_len]`` (additive, as for
:func:`~ppo_core_decode.decode_attention.decode_attention`), ``slot []`` int64 on the device (the launch can be
captured in a CUDA graph); output ``[B, H, 1, d]``.
"""

from __future__ import annotations

import os

import torch

from ppo_core.kernels.launch_sizes import next_power_of_2
from ppo_core.kernels.triton_scan import _interpreting
from ppo_core_decode.decode_attention import default_block_l
from ppo_core_decode.decode_rotary import check_qk_norm, rotate_and_write_triton_available
from ppo_core_decode.pdl import pdl_enabled, prefetch_l2
from ppo_core_decode.split_launch import arrival_counters, sm_count

try:
    import triton
    import triton.language as tl

    from ppo_core_decode.decode_attention import _softmax_block
    from ppo_core_decode.decode_rotary import _head_norms, _rotary
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = [
    "default_split",
    "rotate_write_attend_triton",
    "rotate_write_attend_triton_available",
]


MAX_REGISTERS = 128
"""Registers a thread of a four-warp program may take: four programs fit an SM (the rule of :func:`default_split`
assumes it). Without the cap, prefetching the first block before waiting (PDL) takes the kernel past it; under it
the kernel compiles without spilling at the pipeline depths it uses."""


def rotate_write_attend_triton_available(q: torch.Tensor) -> bool:
    """Whether the fused kernel can run for ``q`` (CUDA, a power-of-two head width >= 16)."""
    return rotate_and_write_triton_available(q)


if triton is not None:

    @triton.jit(do_not_specialize=["kv_len"])
    def _rotate_write_attend_kernel(
        Q,
        K,
        V,
        Cos,
        Sin,
        KCache,
        VCache,
        Slot,
        Bias,
        Out,
        Parts,
        Counters,
        QNorm,
        KNorm,
        sq_b,
        sq_h,
        sk_b,
        sk_g,
        sv_b,
        sv_g,
        sc_b,
        skc_b,
        skc_g,
        skc_l,
        svc_b,
        svc_g,
        svc_l,
        sb_b,
        sb_l,
        so_b,
        so_h,
        kv_len,
        scale,
        norm_eps,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
        PRECISION: tl.constexpr,
        SPLIT: tl.constexpr,
        PDL: tl.constexpr,
        LINES: tl.constexpr,
        LINE_ELEMS: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        split = 0
        if SPLIT > 1:
            split = tl.program_id(2)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        k_base = KCache + b * skc_b + g * skc_g
        v_base = VCache + b * svc_b + g * svc_g
        slot = tl.load(Slot).to(tl.int32)
        n = tl.minimum(kv_len, slot + 1)  # nothing past the new slot is filled: do not read it
        lo = 0
        hi = n
        if SPLIT > 1:  # this program's chunk: whole blocks, so the blocks are those of the unsplit loop
            chunk = tl.cdiv(tl.cdiv(n, SPLIT), BLOCK_L) * BLOCK_L
            lo = split * chunk
            hi = tl.minimum(lo + chunk, n)
        if PDL:
            # The slot and the cached slots below it were written before the step's previous kernel (by the step's
            # first kernels and by earlier steps): the first block's keys and values are fetched into the L2 while
            # the q/k/v product finishes, then everything else waits for it.
            _prefetch_l2(k_base, v_base, lo, n, skc_l, svc_l, BLOCK_L, LINES, LINE_ELEMS)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(Cos + b * sc_b + d).to(tl.float32)
        sin = tl.load(Sin + b * sc_b + d).to(tl.float32)

        # the group's query heads, rotated and rounded to the model dtype as the unfused path stores them
        heads = g * REP + r
        q_ok = r[:, None] < REP
        q_rows = Q + b * sq_b + heads[:, None] * sq_h
        qt = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0)
        qp = tl.load(q_rows + partner[None, :], mask=q_ok, other=0.0)
        k_row = K + b * sk_b + g * sk_g
        kt = tl.load(k_row + d)
        kp = tl.load(k_row + partner)
        if QK_NORM:  # Qwen3's per-head norms of the queries and the key, before the rotation
            qt, qp = _head_norms(qt, qp, tl.load(QNorm + d), tl.load(QNorm + partner), norm_eps, D)
            # the key as a one-head group: [1, D] and back
            kt, kp = _head_norms(
                tl.reshape(kt, (1, D)),
                tl.reshape(kp, (1, D)),
                tl.load(KNorm + d),
                tl.load(KNorm + partner),
                norm_eps,
                D,
            )
            kt, kp = tl.reshape(kt, (D,)), tl.reshape(kp, (D,))
        q = _rotary(qt, qp, sign[None, :], cos[None, :], sin[None, :], MODEL_ROUNDING)

        # the new key (rotated) and value of this (row, group): stored for later steps, kept for this one
        # [D] each, in the cache's dtype as the unfused path's store converts them
        k_new = _rotary(kt, kp, sign, cos, sin, MODEL_ROUNDING)
        k_new = k_new.to(KCache.dtype.element_ty)
        v_new = tl.load(V + b * sv_b + g * sv_g + d).to(VCache.dtype.element_ty)
        # one program of the (row, group) writes them; with SPLIT = 1 the test is on a constant and compiles away
        if split == 0:
            tl.store(KCache + b * skc_b + g * skc_g + slot.to(tl.int64) * skc_l + d, k_new)
            tl.store(VCache + b * svc_b + g * svc_g + slot.to(tl.int64) * svc_l + d, v_new)
        if SPLIT == 1:
            # the program's own stores are visible to all its threads after a barrier: the block holding the new
            # slot then reads it from the cache like any other slot (no select of registers into the tile)
            tl.debug_barrier()

        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        # The blocks wholly below the new slot first: every slot in them is cached and inside the range, so they
        # load without masks and select no new key or value (the same values, so the same bits, as the general
        # body below gives them, in fewer instructions a block).
        plain_end = lo + (tl.maximum(tl.minimum(hi, slot) - lo, 0) // BLOCK_L) * BLOCK_L
        # A plain block's bias is loaded one block ahead (the next block's while this one is computed): loaded in
        # the block that adds it, its latency (an L2 round trip) was paid by every block.
        bias_row = Bias + b * sb_b
        ahead = lo + tl.arange(0, BLOCK_L)
        bias_next = tl.load(bias_row + ahead * sb_l, mask=ahead < plain_end, other=0.0)
        tail = plain_end + tl.arange(0, BLOCK_L)
        # the first block of the rest (the loop after this one), loaded before the plain blocks
        bias_tail = tl.load(bias_row + tail * sb_l, mask=tail < n, other=float("-inf"))
        for start in range(lo, plain_end, BLOCK_L):
            slots = start + tl.arange(0, BLOCK_L)
            bias = bias_next.to(tl.float32)
            ahead = slots + BLOCK_L
            bias_next = tl.load(bias_row + ahead * sb_l, mask=ahead < plain_end, other=0.0)
            k = tl.load(k_base + slots[None, :] * skc_l + d[:, None])  # [D, L]
            s = (tl.dot(q, k, input_precision=PRECISION) * scale).to(tl.float32)  # [REP_PAD, BLOCK_L]
            s = s + bias[None, :]
            m_new, alpha, p, l_i = _softmax_block(s, m_i, l_i)
            v = tl.load(v_base + slots[:, None] * svc_l + d[None, :])  # [L, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # The rest (the block holding the new slot, and the range's end) is decode_attention._decode_kernel's loop,
        # line for line but for the new slot and the chunk's bounds. The three loops share the online softmax's
        # step (_softmax_block: both kernels compile to the same code as with it written out); the whole loop is
        # not one shared helper because inlining that changed the two-launch kernel's register allocation, and
        # that path must stay the code it was while the two are benchmarked against each other.
        for start in range(plain_end, hi, BLOCK_L):
            slots = start + tl.arange(0, BLOCK_L)
            inside = slots < n
            # unsplit, the new slot is read from the cache too (written by this program before its barrier)
            cached = inside if SPLIT == 1 else inside & (slots != slot)
            k = tl.load(
                k_base + slots[None, :] * skc_l + d[:, None], mask=cached[None, :], other=0.0
            )  # [D, L]
            if SPLIT > 1:
                k = tl.where((slots == slot)[None, :], k_new[:, None], k)
            s = (tl.dot(q, k, input_precision=PRECISION) * scale).to(tl.float32)  # [REP_PAD, BLOCK_L]
            bias = bias_tail.to(tl.float32)  # loaded a block ahead too: masked as `inside`
            ahead = slots + BLOCK_L
            bias_tail = tl.load(bias_row + ahead * sb_l, mask=ahead < n, other=float("-inf"))
            s = s + bias[None, :]
            m_new, alpha, p, l_i = _softmax_block(s, m_i, l_i)
            v = tl.load(
                v_base + slots[:, None] * svc_l + d[None, :], mask=cached[:, None], other=0.0
            )  # [L, D]
            if SPLIT > 1:
                v = tl.where((slots == slot)[:, None], v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if SPLIT > 1:
            # publish this chunk's state; the last program of the (row, group) to arrive combines the SPLIT states
            group = b * tl.num_programs(1) + g
            row_ok = r < REP
            record = REP * (D + 2)  # acc [REP, D], then m [REP], then l [REP]
            part = Parts + (group * SPLIT + split) * record
            tl.store(part + r[:, None] * D + d[None, :], acc, mask=q_ok)
            tl.store(part + REP * D + r, m_i, mask=row_ok)
            tl.store(part + REP * D + REP + r, l_i, mask=row_ok)
            tl.debug_barrier()
            arrived = tl.atomic_add(Counters + group, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                first = Parts + group * SPLIT * record
                m_all = tl.full([REP_PAD], float("-inf"), tl.float32)
                for s in range(SPLIT):
                    m_s = tl.load(
                        first + s * record + REP * D + r,
                        mask=row_ok,
                        other=float("-inf"),
                        cache_modifier=".cg",
                    )
                    m_all = tl.maximum(m_all, m_s)
                m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)  # every slot masked: l stays 0, out NaN
                l_all = tl.zeros([REP_PAD], tl.float32)
                acc_all = tl.zeros([REP_PAD, D], tl.float32)
                for s in range(SPLIT):  # in split order, whichever program arrived last: deterministic
                    state = first + s * record
                    m_s = tl.load(state + REP * D + r, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(state + REP * D + REP + r, mask=row_ok, other=0.0, cache_modifier=".cg")
                    acc_s = tl.load(
                        state + r[:, None] * D + d[None, :], mask=q_ok, other=0.0, cache_modifier=".cg"
                    )
                    w = tl.exp(m_s - m_safe)  # 0 for an empty chunk or one with every slot masked
                    l_all += w * l_s
                    acc_all += w[:, None] * acc_s
                tl.store(Counters + group, 0)  # zero again for the next launch
                out = acc_all / l_all[:, None]
                tl.store(
                    Out + b * so_b + heads[:, None] * so_h + d[None, :],
                    out.to(Out.dtype.element_ty),
                    mask=q_ok,
                )
        else:
            out = acc / l_i[:, None]
            tl.store(
                Out + b * so_b + heads[:, None] * so_h + d[None, :], out.to(Out.dtype.element_ty), mask=q_ok
            )

    @triton.jit
    def _prefetch_l2(
        k_base,
        v_base,
        start,
        n,
        skc_l,
        svc_l,
        BLOCK_L: tl.constexpr,
        LINES: tl.constexpr,
        LINE_ELEMS: tl.constexpr,
    ):
        """Fetch the cached keys and values of slots ``start .. start + BLOCK_L`` below ``n`` into the L2 (one
        ``prefetch.global.L2`` per 128-byte line: ``LINES`` lines of ``LINE_ELEMS`` entries a row); no data comes
        back to the program, so it holds no registers for it."""
        slots = start + tl.arange(0, BLOCK_L)
        # past the filled slots: slot 0's row again (always in the buffer)
        slots = tl.where(slots < n, slots, 0)
        line = tl.arange(0, LINES) * LINE_ELEMS
        rows = slots[:, None].to(tl.int64)
        prefetch_l2(k_base + rows * skc_l + line[None, :])
        prefetch_l2(v_base + rows * svc_l + line[None, :])


def rotate_write_attend_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None = None,
    *,
    model_rounding: bool,
    block_l: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    split: int | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v`` into the cache at ``slot`` and attend: in one launch
    what :func:`~ppo_core_decode.decode_rotary.rotate_and_write_triton` followed by
    :func:`~ppo_core_decode.decode_attention.decode_attention_triton` (with ``filled = slot + 1``) computes.

    Args:
        q: ``[B, H, 1, d]`` queries; k, v: ``[B, G, 1, d]`` keys and values of the step (not rotated; any strides
            with a contiguous last dimension); ``H`` a multiple of ``G``, ``d`` a power of two >= 16.
        cos, sin: ``[B, d]`` tables at each row's position, rows contiguous, one layout for both.
        keys, values: the layer's ``[B, G, L, d]`` cache buffers (written at ``slot``, read below it).
        slot: ``[]`` int64 device scalar, the slot of the step's token.
        bias: ``[B, 1, 1, kv_len]`` (or ``[1, 1, 1, kv_len]``) additive mask, fp32 or the model dtype; the slots
            attended are those below ``min(kv_len, slot + 1)``.
        scale: softmax scale (None: ``1 / sqrt(d)``).
        model_rounding: the rotation's rounding rule (see :mod:`ppo_core_decode.decode_rotary`).
        block_l, num_warps, num_stages: the attention's tiling, as in ``decode_attention_triton`` (``block_l``
            None: :func:`~ppo_core_decode.decode_attention.default_block_l`, as there; three stages:
            see the module docstring).
        split: the programs ``S`` sharing a (row, key/value head)'s slots (see the module docstring); None: chosen
            from the shapes by :func:`default_split`. ``1`` gives the unfused path's bits.
        qk_norm: ``(q_weight [d], k_weight [d], eps)``: normalise each query head and the key (RMSNorm per head,
            Qwen3's ``q_norm`` and ``k_norm``) before rotating them, in the model's roundings (see the module
            docstring); weights in ``q``'s dtype.

    Returns:
        ``[B, H, 1, d]`` attention outputs in ``q``'s dtype.
    """
    if triton is None:
        raise RuntimeError("rotate_write_attend_triton needs Triton")
    b, h, _, d = q.shape
    g, length = keys.shape[1], keys.shape[2]
    kv_len = bias.shape[-1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the fused decode kernel needs a power-of-two head width >= 16, got {d}")
    if h % g or k.shape[1] != g or v.shape[1] != g:
        raise ValueError(
            f"q's {h} heads must be a multiple of the cache's {g}, which k {k.shape} and v {v.shape} match"
        )
    if kv_len > length:
        raise ValueError(f"bias covers {kv_len} slots, more than the cache's {length}")
    tensors = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "keys": keys, "values": values}
    strided = [name for name, t in tensors.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(
            f"rotate_write_attend_triton needs a contiguous last dimension; {', '.join(strided)} have none"
        )
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share one layout, got strides {cos.stride()} and {sin.stride()}")
    if slot.numel() != 1:
        raise ValueError(f"slot must be a device scalar, got shape {tuple(slot.shape)}")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
        raise ValueError(f"split must be a positive int or None, got {split!r}")
    if qk_norm is not None:
        check_qk_norm(qk_norm, q)
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    bias2 = bias.reshape(b, -1) if bias.shape[0] == b else bias.reshape(1, -1).expand(b, -1)
    rep = h // g
    block_l = block_l or default_block_l(d)
    if split is None:
        split = default_split(b * g, kv_len, block_l, q.device)
    if split > 1:
        parts = torch.empty(b, g, split, rep * (d + 2), dtype=torch.float32, device=q.device)
        counters = arrival_counters(q.device, b * g)
    else:
        parts = counters = out  # unused
    pdl = pdl_enabled(q.device)
    _rotate_write_attend_kernel[(b, g, split)](
        q,
        k,
        v,
        cos,
        sin,
        keys,
        values,
        slot,
        bias2,
        out,
        parts,
        counters,
        qk_norm[0] if qk_norm is not None else out,  # unused pointers without the norms
        qk_norm[1] if qk_norm is not None else out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        bias2.stride(0),
        bias2.stride(1),
        out.stride(0),
        out.stride(1),
        kv_len,
        float(scale if scale is not None else d**-0.5),
        float(qk_norm[2]) if qk_norm is not None else 0.0,
        REP=rep,
        REP_PAD=max(16, next_power_of_2(rep)),
        D=d,
        BLOCK_L=block_l,
        MODEL_ROUNDING=model_rounding,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=split,
        PDL=pdl,
        LINES=max(1, d * keys.element_size() // 128),
        LINE_ELEMS=max(1, 128 // keys.element_size()),
        QK_NORM=qk_norm is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
        **({"maxnreg": MAX_REGISTERS} if num_warps == 4 and not _interpreting() else {}),
    )
    return out


def default_split(programs: int, kv_len: int, block_l: int, device: torch.device) -> int:
    """The split :func:`rotate_write_attend_triton` uses by default for ``programs = B G`` (row, key/value head)
    pairs attending over up to ``kv_len`` slots: the smallest power of two ``S`` for which the ``programs * S``
    programs are at least two per SM (four fit at once: a four-warp program takes at most :data:`MAX_REGISTERS`
    registers a thread), but no more than the ``ceil(kv_len / block_l)`` blocks of slots (each program keeping at
    least one block of the longest range). 1 where the ``(b, g)`` pairs alone are that many: there the programs
    already fill the GPU and splitting only adds the combine (slower at a rollout's 64 rows of 8 heads; see
    ``docs/performance.md``), so the split is for few rows over long caches (8 rows of 8 heads over 4096 slots:
    ``S = 64``).
    ``PPO_CORE_DECODE_SPLIT=<S>`` sets ``S`` instead (for measurements).

    Example:
        >>> default_split(64 * 8, 384, 64, torch.device("cpu")), default_split(8, 4096, 64, torch.device("cpu"))
        (1, 64)
    """
    forced = os.environ.get("PPO_CORE_DECODE_SPLIT")
    if forced:  # a tuning knob: this many splits wherever the kernel runs
        return max(1, int(forced))
    want = 2 * sm_count(device)
    blocks = -(-kv_len // block_l)
    split = 1
    while programs * split < want and 2 * split <= blocks:
        split *= 2
    return split
