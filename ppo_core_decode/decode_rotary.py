"""The rotary embedding fused with the KV-cache write: one Triton kernel instead of three or more.

A decode step of a layer rotates its new query and key by their positions and writes the key and value into the
cache slot of the step. Unfused that is a rotation kernel (or several) and two ``index_copy_`` launches per layer;
here one program per row reads ``q [H, d]``, ``k [G, d]``, ``v [G, d]`` and the row's ``cos``/``sin [d]`` once,
writes the rotated query to a fresh ``[B, H, 1, d]`` tensor and the rotated key and the value to the cache at the
slot held in a device scalar (so the launch is captured in the step's CUDA graph). A prefill does the same for its
``S`` tokens in one launch of one program per (token, row), token ``s`` going to slot ``s``
(:func:`rotate_and_write_prompt_triton`); the attention then reads the keys and values from the cache.

Qwen3's per-head RMSNorms of the queries and keys (``qk_norm``) run in the same launch, before the rotation, in the
model's roundings (their sum of squares in the kernel's order): a prefill then reads and writes its queries and keys
once a layer instead of twice.

Two roundings of ``t cos + rotate_half(t) sin`` (``rotate_half([t1, t2]) = [-t2, t1]``):

- ``model_rounding=False``: in fp32, rounded once to the model dtype (:func:`ppo_core.kernels.fused.apply_rotary`,
  megatron's rule);
- ``model_rounding=True``: each product and the sum rounded to the model dtype, as a model's eager forward does
  with tables in its dtype (:func:`ppo_core_decode.eager_rounding.rotary_as_model`, the Hugging Face engine's).
  Compiled, the kernels form each product with an explicit ``mul.rn.f32``: LLVM would otherwise narrow the rounded
  products and their sum to the model dtype and, with Triton's default FP contraction, fuse one product into the
  sum, leaving it unrounded (which changes bf16 results by one step); ``rotary_as_model`` is compiled without
  contraction (inductor's ``emulate_precision_casts``).

:func:`rotate_and_write` and :func:`rotate_and_write_prompt` are the kernel's contracts in PyTorch (any device, the
references of the tests); ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors.
"""

from __future__ import annotations

import torch

from ppo_core.kernels.fused import apply_rotary
from ppo_core.kernels.launch_sizes import next_power_of_2
from ppo_core.kernels.triton_launch import DirectLauncher
from ppo_core.kernels.triton_scan import _interpreting
from ppo_core_decode.eager_rounding import rms_norm_as_model, rotary_as_model

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = [
    "rotate_and_write",
    "rotate_and_write_prompt",
    "rotate_and_write_prompt_triton",
    "rotate_and_write_triton",
    "rotate_and_write_triton_available",
]


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
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v`` into the cache at ``slot``; return the rotated ``q``.

    Args:
        q: ``[B, H, 1, d]`` queries; k, v: ``[B, G, 1, d]`` keys and values of the step (any strides).
        cos, sin: ``[B, d]`` tables at each row's position (model dtype with ``model_rounding``, else any).
        keys, values: the layer's ``[B, G, L, d]`` cache buffers (written at ``slot``).
        slot: ``[]`` int64 device scalar.
        model_rounding: round as a model's eager forward does (see the module docstring).
        qk_norm: ``(q_weight [d], k_weight [d], eps)``: first normalise each query head and key head (RMSNorm per
            head in the model's roundings, Qwen3's ``q_norm`` and ``k_norm``); weights in ``q``'s dtype.

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
    q, k = _head_norms_first(q, k, qk_norm)
    rotate = rotary_as_model if model_rounding else apply_rotary
    q, k = rotate(q, k, cos[:, None, None, :], sin[:, None, None, :])
    keys.index_copy_(2, slot.view(1), k)
    values.index_copy_(2, slot.view(1), v)
    return q


def _head_norms_first(
    q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` with each head normalised by ``qk_norm`` (the model's RMSNorm); as they are without."""
    if qk_norm is None:
        return q, k
    check_qk_norm(qk_norm, q)
    q_weight, k_weight, eps = qk_norm
    return rms_norm_as_model(q, q_weight, eps), rms_norm_as_model(k, k_weight, eps)


def rotate_and_write_triton_available(q: torch.Tensor) -> bool:
    """Whether the Triton kernel can run for ``q`` (CUDA, a power-of-two head width >= 16)."""
    d = q.shape[-1]
    return triton is not None and q.is_cuda and d >= 16 and not d & (d - 1)


if triton is not None:
    # Compiled (not interpreted) kernels form the model-rounding products with an explicit ``mul.rn.f32``: see
    # _rounded_product. The interpreter has no inline assembly, and its numpy arithmetic never contracts.
    _EXPLICIT_PRODUCTS = tl.constexpr(not _interpreting())

    @triton.jit
    def _rounded_product(x, y):
        # ``x * y`` in fp32, rounded to nearest by itself. LLVM narrows ``round(x * y)`` and the sum after it to the
        # model dtype and, with Triton's default FP contraction, fuses one product into that sum (an fma), so one
        # product is never rounded; an inline ``mul.rn`` is opaque to both (PTX never fuses an explicitly rounded
        # multiply).
        if _EXPLICIT_PRODUCTS:
            return tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return x * y

    @triton.jit
    def _rotary(t, tp, sign, cos, sin, MODEL_ROUNDING: tl.constexpr):
        # ``t cos + rotate_half(t) sin`` elementwise in t's dtype by the rule of MODEL_ROUNDING: t and its partner tp
        # (the element half a row away) in the model dtype, sign/cos/sin fp32, all broadcastable to t. One body for
        # this module's kernel and decode_rotary_attention's, so that both round alike.
        dtype = t.dtype
        half = tp.to(tl.float32) * sign  # exact: a negation
        if MODEL_ROUNDING:
            # three roundings, as the model's eager forward: each product, then the sum of the rounded products
            a = _rounded_product(t.to(tl.float32), cos).to(dtype).to(tl.float32)
            c = _rounded_product(half, sin).to(dtype).to(tl.float32)
            return (a + c).to(dtype)
        return (t.to(tl.float32) * cos + half * sin).to(dtype)

    @triton.jit
    def _head_norms(t, tp, w, wp, eps, D: tl.constexpr):
        """The RMSNorm of each row of ``t [R, D]`` (a head) with weight ``w [D]``, in the model's roundings: the row
        times ``1 / sqrt(mean(t^2) + eps)`` in fp32 rounded to the model dtype, then times the weight rounded again;
        ``tp`` and ``wp`` are the same rows and weight at the partner entries (half a row away), which the rotation
        reads, normalised by the same row statistic."""
        dtype = t.dtype
        tf = t.to(tl.float32)
        inv = tl.rsqrt(tl.sum(tf * tf, axis=1) / D + eps)[:, None]
        a = (tf * inv).to(dtype).to(tl.float32)
        ap = (tp.to(tl.float32) * inv).to(dtype).to(tl.float32)
        return (w.to(tl.float32)[None, :] * a).to(dtype), (wp.to(tl.float32)[None, :] * ap).to(dtype)

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
        Norm,
        norm_eps,
        D: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
        NORM: tl.constexpr,
    ):
        ok = heads[:, None] < n_heads
        t = tl.load(ptr + b * stride_b + heads[:, None] * stride_h + d[None, :], mask=ok, other=0.0)
        tp = tl.load(ptr + b * stride_b + heads[:, None] * stride_h + partner[None, :], mask=ok, other=0.0)
        if NORM:  # each head's RMSNorm before the rotation (Qwen3's q_norm / k_norm)
            t, tp = _head_norms(t, tp, tl.load(Norm + d), tl.load(Norm + partner), norm_eps, D)
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
        QNorm,
        KNorm,
        norm_eps,
        sq_b,
        sq_h,
        sq_s,
        sk_b,
        sk_g,
        sk_s,
        sv_b,
        sv_g,
        sv_s,
        sc_b,
        sc_s,
        skc_b,
        skc_g,
        skc_l,
        svc_b,
        svc_g,
        svc_l,
        so_b,
        so_h,
        so_s,
        H: tl.constexpr,
        G: tl.constexpr,
        HP: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
        PROMPT: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        # one program per (row, token): a decode step's row b = program_id(0), its token to the slot held in Slot;
        # a prompt's token s = program_id(0) (the grid's long axis: any prompt length) of row b = program_id(1), to
        # slot s
        if PROMPT:
            s = tl.program_id(0).to(tl.int64)
            b = tl.program_id(1).to(tl.int64)
            slot = s
        else:
            s = 0
            b = tl.program_id(0).to(tl.int64)
            slot = tl.load(Slot).to(tl.int64)
        d = tl.arange(0, D)
        partner = tl.where(d < D // 2, d + D // 2, d - D // 2)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(Cos + b * sc_b + s * sc_s + d).to(tl.float32)
        sin = tl.load(Sin + b * sc_b + s * sc_s + d).to(tl.float32)
        qh = tl.arange(0, HP)
        q, q_ok = _rotate_rows(
            Q + s * sq_s,
            sq_b,
            sq_h,
            b,
            qh,
            H,
            d,
            partner,
            sign,
            cos,
            sin,
            QNorm,
            norm_eps,
            D,
            MODEL_ROUNDING,
            QK_NORM,
        )
        tl.store(QOut + b * so_b + s * so_s + qh[:, None] * so_h + d[None, :], q, mask=q_ok)
        gh = tl.arange(0, GP)
        k, k_ok = _rotate_rows(
            K + s * sk_s,
            sk_b,
            sk_g,
            b,
            gh,
            G,
            d,
            partner,
            sign,
            cos,
            sin,
            KNorm,
            norm_eps,
            D,
            MODEL_ROUNDING,
            QK_NORM,
        )
        tl.store(KCache + b * skc_b + gh[:, None] * skc_g + slot * skc_l + d[None, :], k, mask=k_ok)
        v = tl.load(V + b * sv_b + s * sv_s + gh[:, None] * sv_g + d[None, :], mask=k_ok, other=0.0)
        tl.store(VCache + b * svc_b + gh[:, None] * svc_g + slot * svc_l + d[None, :], v, mask=k_ok)


_MAX_GRID_Y = 65535
"""CUDA's limit on a launch grid's second dimension."""


def check_qk_norm(qk_norm: tuple[torch.Tensor, torch.Tensor, float], q: torch.Tensor) -> None:
    """``qk_norm`` is ``(q_weight, k_weight, eps)`` with ``[d]`` contiguous weights of ``q``'s dtype and device."""
    if not isinstance(qk_norm, tuple) or len(qk_norm) != 3:
        raise ValueError(f"qk_norm must be (q_weight, k_weight, eps), got {type(qk_norm).__name__}")
    d = q.shape[-1]
    for name, w in zip(("q_weight", "k_weight"), qk_norm[:2], strict=True):
        if (
            not isinstance(w, torch.Tensor)
            or tuple(w.shape) != (d,)
            or w.dtype != q.dtype
            or w.device != q.device
        ):
            got = (
                f"{tuple(w.shape)} {w.dtype} on {w.device}"
                if isinstance(w, torch.Tensor)
                else type(w).__name__
            )
            raise ValueError(f"qk_norm's {name} must be [{d}] {q.dtype} on {q.device}, got {got}")
        if not w.is_contiguous():
            raise ValueError(f"qk_norm's {name} must be contiguous")


def _check_layouts(caller: str, **tensors: torch.Tensor) -> None:
    """The kernel's layout rules for ``caller``'s tensors (by name): a contiguous last dimension for each, one
    layout for ``cos`` and ``sin``."""
    strided = [name for name, t in tensors.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(f"{caller} needs a contiguous last dimension; {', '.join(strided)} have none")
    cos, sin = tensors["cos"], tensors["sin"]
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share one layout, got strides {cos.stride()} and {sin.stride()}")


def _launch(
    grid: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    table_strides: tuple[int, int],
    out_strides: tuple[int, int, int],
    *,
    model_rounding: bool,
    prompt: bool,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
) -> None:
    """``_rotate_write_kernel`` over ``grid``; q/k/v ``[B, heads, S, d]``, ``table_strides`` (row, position) of
    cos/sin, ``out_strides`` (row, head, position) of the rotated queries."""
    h, d, g = q.shape[1], q.shape[3], k.shape[1]
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    _rotate_write_launch(
        grid,
        q,
        k,
        v,
        cos,
        sin,
        out,
        keys,
        values,
        slot,
        q_norm,
        k_norm,
        float(eps),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *table_strides,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        *out_strides,
        H=h,
        G=g,
        HP=next_power_of_2(h),
        GP=next_power_of_2(g),
        D=d,
        MODEL_ROUNDING=model_rounding,
        PROMPT=prompt,
        QK_NORM=qk_norm is not None,
        num_warps=4,
    )


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
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """:func:`rotate_and_write` in one Triton launch (shapes and meaning as there; the last dimension of every
    tensor contiguous, ``cos``/``sin`` rows contiguous, a power-of-two head width >= 16). With ``qk_norm`` the
    heads' norms run in the same launch (the sum of squares in another order than the model's: outputs within one
    step of the dtype)."""
    if triton is None:
        raise RuntimeError("rotate_and_write_triton needs Triton")
    _check_layouts("rotate_and_write_triton", q=q, k=k, v=v, cos=cos, sin=sin, keys=keys, values=values)
    if slot.numel() != 1:
        raise ValueError(f"slot must be a device scalar, got shape {tuple(slot.shape)}")
    if qk_norm is not None:
        check_qk_norm(qk_norm, q)
    b, h, _, d = q.shape
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    _launch(
        (b,),
        q,
        k,
        v,
        cos,
        sin,
        out,
        keys,
        values,
        slot,
        (cos.stride(0), 0),
        (out.stride(0), out.stride(1), 0),
        model_rounding=model_rounding,
        prompt=False,
        qk_norm=qk_norm,
    )
    return out


def rotate_and_write_prompt(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    model_rounding: bool,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """A prefill's :func:`rotate_and_write`: rotate the ``S`` prompt tokens' ``q`` and ``k`` by their own tables
    (each head normalised first with ``qk_norm``), write the rotated ``k`` and ``v`` into cache slots ``[0, S)``;
    return the rotated ``q``.

    Args:
        q: ``[B, H, S, d]``; k, v: ``[B, G, S, d]`` (any strides).
        cos, sin: ``[B, S, d]`` tables at each token's position.
        keys, values: the layer's ``[B, G, L, d]`` cache buffers, ``L >= S``.
        model_rounding, qk_norm: as in :func:`rotate_and_write`.

    Returns:
        ``[B, H, S, d]`` rotated queries.

    Example:
        >>> q, k, v = torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4), torch.full((1, 1, 2, 4), 3.0)
        >>> cache_k, cache_v = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
        >>> cos, sin = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)  # position 0 twice: no rotation
        >>> out = rotate_and_write_prompt(q, k, v, cos, sin, cache_k, cache_v, model_rounding=False)
        >>> cache_v[0, 0, :, 0].tolist(), bool(torch.equal(out, q))
        ([3.0, 3.0, 0.0], True)
    """
    q, k = _head_norms_first(q, k, qk_norm)
    rotate = rotary_as_model if model_rounding else apply_rotary
    q, k = rotate(q, k, cos[:, None], sin[:, None])
    s = q.shape[2]
    keys[:, :, :s] = k
    values[:, :, :s] = v
    return q


def rotate_and_write_prompt_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    model_rounding: bool,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """:func:`rotate_and_write_prompt` in one Triton launch of one program per (token, row) (the same kernel and
    rounding as a decode step's :func:`rotate_and_write_triton`, ``qk_norm`` too; layouts as there). The rotated queries are
    returned as a ``[B, H, S, d]`` view of a ``[B, S, H, d]`` tensor: each token's heads side by side, as the
    projection gave them, which the attention kernels read as they read the projection's views."""
    if triton is None:
        raise RuntimeError("rotate_and_write_prompt_triton needs Triton")
    _check_layouts(
        "rotate_and_write_prompt_triton", q=q, k=k, v=v, cos=cos, sin=sin, keys=keys, values=values
    )
    b, h, s, d = q.shape
    if s > keys.shape[2]:
        raise ValueError(
            f"a prompt of {s} tokens (q, k, v) does not fit a cache of {keys.shape[2]} slots (keys, values)"
        )
    if tuple(cos.shape) != (b, s, d):
        raise ValueError(f"cos and sin must be [B, S, d] = {[b, s, d]}, got {list(cos.shape)}")
    if qk_norm is not None:
        check_qk_norm(qk_norm, q)
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    if b == 0 or s == 0:
        return out
    # tokens on the grid's first axis (no limit that a prompt reaches), rows on its second (at most 65,535 a launch)
    for r in range(0, b, _MAX_GRID_Y):
        rows = slice(r, r + _MAX_GRID_Y)
        _launch(
            (s, min(b - r, _MAX_GRID_Y)),
            q[rows],
            k[rows],
            v[rows],
            cos[rows],
            sin[rows],
            out[rows],
            keys[rows],
            values[rows],
            cos,  # unused: each program's slot is its position
            (cos.stride(0), cos.stride(1)),
            (out.stride(0), out.stride(1), out.stride(2)),
            model_rounding=model_rounding,
            prompt=True,
            qk_norm=qk_norm,
        )
    return out


# launched through the compiled kernel once Triton has compiled it (less host time a launch: a prefill's many)
if triton is not None:
    _rotate_write_launch = DirectLauncher(_rotate_write_kernel)
