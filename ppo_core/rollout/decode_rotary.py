"""The rotary embedding of a decode step fused with the KV-cache write: one Triton kernel instead of three or more.

A decode step of a layer rotates its new query and key by their positions and writes the key and value into the
cache slot of the step. Unfused that is a rotation kernel (or several) and two ``index_copy_`` launches per layer;
here one program per row reads ``q [H, d]``, ``k [G, d]``, ``v [G, d]`` and the row's ``cos``/``sin [d]`` once,
writes the rotated query to a fresh ``[B, H, 1, d]`` tensor and the rotated key and the value to the cache at the
slot held in a device scalar (so the launch is captured in the step's CUDA graph).

Two roundings of ``t cos + rotate_half(t) sin`` (``rotate_half([t1, t2]) = [-t2, t1]``):

- ``model_rounding=False``: in fp32, rounded once to the model dtype (:func:`ppo_core.kernels.fused.apply_rotary`,
  megatron's rule);
- ``model_rounding=True``: each product and the sum rounded to the model dtype, as a model's eager forward does
  with tables in its dtype (:func:`ppo_core.rollout.eager_rounding.rotary_as_model`, the Hugging Face engine's).

:func:`rotate_and_write` is the kernel's contract in PyTorch (any device, the reference of the tests);
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch

from ppo_core.kernels.fused import apply_rotary
from ppo_core.rollout.eager_rounding import rotary_as_model

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["rotate_and_write", "rotate_and_write_triton", "rotate_and_write_triton_available"]


def rotate_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    *,
    model_rounding: bool,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v`` into the cache at ``slot``; return the rotated ``q``.

    Args:
        q: ``[B, H, 1, d]`` queries; k, v: ``[B, G, 1, d]`` keys and values of the step (any strides).
        cos, sin: ``[B, d]`` tables at each row's position (model dtype with ``model_rounding``, else any).
        keys, values: the layer's ``[B, G, L, d]`` cache buffers (written at ``slot``).
        slot: ``[]`` int64 device scalar.
        model_rounding: round as a model's eager forward does (see the module docstring).

    Returns:
        ``[B, H, 1, d]`` rotated queries.

    Example:
        >>> q, k, v = torch.ones(1, 2, 1, 4), torch.ones(1, 1, 1, 4), torch.full((1, 1, 1, 4), 3.0)
        >>> cache_k, cache_v = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
        >>> cos, sin = torch.ones(1, 4), torch.zeros(1, 4)  # position 0: no rotation
        >>> out = rotate_and_write(q, k, v, cos, sin, cache_k, cache_v, torch.tensor(1), model_rounding=False)
        >>> cache_v[0, 0, 1].tolist(), bool(torch.equal(out, q))
        ([3.0, 3.0, 3.0, 3.0], True)
    """
    rotate = rotary_as_model if model_rounding else apply_rotary
    q, k = rotate(q, k, cos[:, None, None, :], sin[:, None, None, :])
    keys.index_copy_(2, slot.view(1), k)
    values.index_copy_(2, slot.view(1), v)
    return q


def rotate_and_write_triton_available(q: torch.Tensor) -> bool:
    """Whether the Triton kernel can run for ``q`` (CUDA, a power-of-two head width >= 16)."""
    d = q.shape[-1]
    return triton is not None and q.is_cuda and d >= 16 and not d & (d - 1)


if triton is not None:

    @triton.jit
    def _rotary(t, tp, sign, cos, sin, MODEL_ROUNDING: tl.constexpr):
        # ``t cos + rotate_half(t) sin`` elementwise in t's dtype by the rule of MODEL_ROUNDING: t and its partner tp
        # (the element half a row away) in the model dtype, sign/cos/sin fp32, all broadcastable to t. One body for
        # this module's kernel and decode_rotary_attention's, so that both round alike.
        dtype = t.dtype
        half = tp.to(tl.float32) * sign  # exact: a negation
        if MODEL_ROUNDING:
            a = (t.to(tl.float32) * cos).to(dtype).to(tl.float32)
            c = (half * sin).to(dtype).to(tl.float32)
            return (a + c).to(dtype)
        return (t.to(tl.float32) * cos + half * sin).to(dtype)

    @triton.jit
    def _rotate_rows(
        ptr,
        stride_b,
        stride_h,
        b,
        heads,
        n_heads,
        d,
        partner,
        sign,
        cos,
        sin,
        MODEL_ROUNDING: tl.constexpr,
    ):
        ok = heads[:, None] < n_heads
        t = tl.load(ptr + b * stride_b + heads[:, None] * stride_h + d[None, :], mask=ok, other=0.0)
        tp = tl.load(ptr + b * stride_b + heads[:, None] * stride_h + partner[None, :], mask=ok, other=0.0)
        return _rotary(t, tp, sign[None, :], cos[None, :], sin[None, :], MODEL_ROUNDING), ok

    @triton.jit
    def _rotate_write_kernel(
        Q,
        K,
        V,
        Cos,
        Sin,
        QOut,
        KCache,
        VCache,
        Slot,
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
        so_b,
        so_h,
        H: tl.constexpr,
        G: tl.constexpr,
        HP: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(Cos + b * sc_b + d).to(tl.float32)
        sin = tl.load(Sin + b * sc_b + d).to(tl.float32)
        slot = tl.load(Slot).to(tl.int64)
        qh = tl.arange(0, HP)
        q, q_ok = _rotate_rows(Q, sq_b, sq_h, b, qh, H, d, partner, sign, cos, sin, MODEL_ROUNDING)
        tl.store(QOut + b * so_b + qh[:, None] * so_h + d[None, :], q, mask=q_ok)
        gh = tl.arange(0, GP)
        k, k_ok = _rotate_rows(K, sk_b, sk_g, b, gh, G, d, partner, sign, cos, sin, MODEL_ROUNDING)
        tl.store(KCache + b * skc_b + gh[:, None] * skc_g + slot * skc_l + d[None, :], k, mask=k_ok)
        v = tl.load(V + b * sv_b + gh[:, None] * sv_g + d[None, :], mask=k_ok, other=0.0)
        tl.store(VCache + b * svc_b + gh[:, None] * svc_g + slot * svc_l + d[None, :], v, mask=k_ok)


def rotate_and_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    *,
    model_rounding: bool,
) -> torch.Tensor:
    """:func:`rotate_and_write` in one Triton launch (shapes and meaning as there; the last dimension of every
    tensor contiguous, ``cos``/``sin`` rows contiguous, a power-of-two head width >= 16)."""
    if triton is None:
        raise RuntimeError("rotate_and_write_triton needs Triton")
    b, h, _, d = q.shape
    g = k.shape[1]
    tensors = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "keys": keys, "values": values}
    strided = [name for name, t in tensors.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(
            f"rotate_and_write_triton needs a contiguous last dimension; {', '.join(strided)} have none"
        )
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share one layout, got strides {cos.stride()} and {sin.stride()}")
    if slot.numel() != 1:
        raise ValueError(f"slot must be a device scalar, got shape {tuple(slot.shape)}")
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    _rotate_write_kernel[(b,)](
        q,
        k,
        v,
        cos,
        sin,
        out,
        keys,
        values,
        slot,
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
        out.stride(0),
        out.stride(1),
        H=h,
        G=g,
        HP=triton.next_power_of_2(h),
        GP=triton.next_power_of_2(g),
        D=d,
        MODEL_ROUNDING=model_rounding,
        num_warps=4,
    )
    return out
