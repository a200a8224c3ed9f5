"""A layer's whole decode step after its projections in one Triton launch: rotary embedding, KV-cache write, attention.

Unfused, a decode step on CUDA runs :func:`~ppo_core.rollout.decode_rotary.rotate_and_write_triton` (rotate the new
query and key, write the key and value at the step's slot) and then
:func:`~ppo_core.rollout.decode_attention.decode_attention_triton` (attend over the filled slots): two launches per
layer, the second waiting on the first. Here one program per (row ``b``, key/value head ``g``):

1. rotates the group's ``H / G`` query heads and its new key by the row's ``cos``/``sin`` with the arithmetic of
   :mod:`ppo_core.rollout.decode_rotary` (the same Triton function, both ``model_rounding`` rules);
2. writes the rotated key and the value into the cache at ``slot`` (it is the only program of its ``(b, g)``, so
   each cache row is written once);
3. attends over the slots ``< min(kv_len, slot + 1)`` as :mod:`ppo_core.rollout.decode_attention`'s kernel does
   (same blocks, same online softmax), except that the new slot's key and value come from registers: the cache
   loads skip that slot, so no program depends on seeing its own store (threads of one program are not ordered
   between a store and a load without a barrier).

Every value entering the attention equals the unfused path's bit for bit (the rotated query is rounded to the model
dtype there by its store, here by the rotation itself), so the two paths give the same outputs and cache; the tests
check it under ``TRITON_INTERPRET=1`` and on CUDA.

Shapes: ``q [B, H, 1, d]``, ``k``/``v [B, G, 1, d]`` (any strides, last dimension contiguous), ``cos``/``sin
[B, d]``, cache ``keys``/``values [B, G, L, d]``, ``bias [B, 1, 1, kv_len]`` (additive, as for
:func:`~ppo_core.rollout.decode_attention.decode_attention`), ``slot []`` int64 on the device (the launch can be
captured in a CUDA graph); output ``[B, H, 1, d]``.
"""

from __future__ import annotations

import torch

from ppo_core.rollout.decode_rotary import rotate_and_write_triton_available
from ppo_core.rollout.pdl import pdl_enabled

try:
    import triton
    import triton.language as tl

    from ppo_core.rollout.decode_rotary import _rotary
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["rotate_write_attend_triton", "rotate_write_attend_triton_available"]


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
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # everything this program reads or writes comes after the previous kernel (its q/k/v)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(Cos + b * sc_b + d).to(tl.float32)
        sin = tl.load(Sin + b * sc_b + d).to(tl.float32)
        slot = tl.load(Slot).to(tl.int32)

        # the group's query heads, rotated and rounded to the model dtype as the unfused path stores them
        heads = g * REP + r
        q_ok = r[:, None] < REP
        q_rows = Q + b * sq_b + heads[:, None] * sq_h
        qt = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0)
        qp = tl.load(q_rows + partner[None, :], mask=q_ok, other=0.0)
        q = _rotary(qt, qp, sign[None, :], cos[None, :], sin[None, :], MODEL_ROUNDING)

        # the new key (rotated) and value of this (row, group): stored for later steps, kept for this one
        k_row = K + b * sk_b + g * sk_g
        # [D] each, in the cache's dtype as the unfused path's store converts them
        k_new = _rotary(tl.load(k_row + d), tl.load(k_row + partner), sign, cos, sin, MODEL_ROUNDING)
        k_new = k_new.to(KCache.dtype.element_ty)
        v_new = tl.load(V + b * sv_b + g * sv_g + d).to(VCache.dtype.element_ty)
        tl.store(KCache + b * skc_b + g * skc_g + slot.to(tl.int64) * skc_l + d, k_new)
        tl.store(VCache + b * svc_b + g * svc_g + slot.to(tl.int64) * svc_l + d, v_new)

        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        k_base = KCache + b * skc_b + g * skc_g
        v_base = VCache + b * svc_b + g * svc_g
        n = tl.minimum(kv_len, slot + 1)  # nothing past the new slot is filled: do not read it
        # The loop is decode_attention._decode_kernel's, line for line but for the new slot. It is not a shared
        # @triton.jit helper because inlining one changes that kernel's register allocation (checked on sm_90 SASS),
        # and the two-launch path must stay the code it was while the two are benchmarked against each other.
        for start in range(0, n, BLOCK_L):
            slots = start + tl.arange(0, BLOCK_L)
            inside = slots < n
            new = slots == slot
            cached = inside & (slots != slot)
            k = tl.load(
                k_base + slots[None, :] * skc_l + d[:, None], mask=cached[None, :], other=0.0
            )  # [D, L]
            k = tl.where(new[None, :], k_new[:, None], k)
            s = (tl.dot(q, k, input_precision=PRECISION) * scale).to(tl.float32)  # [REP_PAD, BLOCK_L]
            bias = tl.load(Bias + b * sb_b + slots * sb_l, mask=inside, other=float("-inf")).to(tl.float32)
            s = s + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + slots[:, None] * svc_l + d[None, :], mask=cached[:, None], other=0.0
            )  # [L, D]
            v = tl.where(new[:, None], v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + b * so_b + heads[:, None] * so_h + d[None, :], out.to(Out.dtype.element_ty), mask=q_ok)


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
    block_l: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v`` into the cache at ``slot`` and attend: in one launch
    what :func:`~ppo_core.rollout.decode_rotary.rotate_and_write_triton` followed by
    :func:`~ppo_core.rollout.decode_attention.decode_attention_triton` (with ``filled = slot + 1``) computes.

    Args:
        q: ``[B, H, 1, d]`` queries; k, v: ``[B, G, 1, d]`` keys and values of the step (not rotated; any strides
            with a contiguous last dimension); ``H`` a multiple of ``G``, ``d`` a power of two >= 16.
        cos, sin: ``[B, d]`` tables at each row's position, rows contiguous, one layout for both.
        keys, values: the layer's ``[B, G, L, d]`` cache buffers (written at ``slot``, read below it).
        slot: ``[]`` int64 device scalar, the slot of the step's token.
        bias: ``[B, 1, 1, kv_len]`` (or ``[1, 1, 1, kv_len]``) additive mask, fp32 or the model dtype; the slots
            attended are those below ``min(kv_len, slot + 1)``.
        scale: softmax scale (None: ``1 / sqrt(d)``).
        model_rounding: the rotation's rounding rule (see :mod:`ppo_core.rollout.decode_rotary`).
        block_l, num_warps, num_stages: the attention's tiling, as in ``decode_attention_triton``.

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
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    bias2 = bias.reshape(b, -1) if bias.shape[0] == b else bias.reshape(1, -1).expand(b, -1)
    rep = h // g
    pdl = pdl_enabled(q.device)
    _rotate_write_attend_kernel[(b, g)](
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
        REP=rep,
        REP_PAD=max(16, triton.next_power_of_2(rep)),
        D=d,
        BLOCK_L=block_l,
        MODEL_ROUNDING=model_rounding,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
