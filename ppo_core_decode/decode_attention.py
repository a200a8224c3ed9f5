"""Attention of one new token per row over a KV cache (grouped-query), the inner loop of decoding.

``out[b, h] = softmax(q[b, h] . K[b, g(h), :L] * scale + bias[b, :L]) V[b, g(h), :L]`` with ``g(h) = h // (H / G)``
and an additive ``bias`` (0 for slots a query may see, ``-inf`` for the others).

Two implementations, the same maths:

- :func:`decode_attention_sdpa`: ``torch.nn.functional.scaled_dot_product_attention`` with the ``H / G`` query heads
  of a group as its "query positions" (any device; the reference).
- :func:`decode_attention_triton`: one Triton program per (row, key/value head) streams that head's keys and values
  once, in blocks of ``BLOCK_L`` slots, with an online softmax (fp32 statistics and accumulator), for all the
  group's query heads at once. A decode step reads the cache once at memory speed; PyTorch's fused kernels are
  built for long queries and, for a query of one token, take several times what reading the cache takes.

:func:`decode_attention` picks Triton on CUDA when it is installed (``PPO_CORE_DECODE_ATTENTION=sdpa`` forces the
reference). Given ``filled`` (a device scalar: slots ``>= filled`` are all masked), the Triton kernel stops reading
there: a decode graph captured for a cache length ``L`` rounded up to its bucket reads only what is filled.

Shapes: ``q [B, H, 1, d]``, ``k``/``v [B, G, L, d]`` (views of the cache, last dimension contiguous), ``bias
[B, 1, 1, L]`` (fp32 or the model dtype); output ``[B, H, 1, d]``.

Example:
    >>> q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    >>> bias = torch.zeros(2, 1, 1, 5)
    >>> decode_attention(q, k, v, bias).shape
    torch.Size([2, 4, 1, 8])
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ppo_core.kernels.launch_sizes import next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU-only installs lack it
    triton = None
    tl = None

__all__ = [
    "decode_attention",
    "decode_attention_sdpa",
    "decode_attention_triton",
    "default_block_l",
    "triton_available",
]


def default_block_l(head_dim: int) -> int:
    """Cache slots per block of the Triton decode kernels for a head width ``d``: ``4096 / d``, between 16 and 64
    (64 up to ``d = 64``, 32 at ``d = 128``), so a block's key tile is 4096 entries whatever the head width.
    A program's loop is bound by its arithmetic per block (see
    :mod:`~ppo_core_decode.decode_rotary_attention`), and 64 slots of 128-wide heads make a block twice as long
    for the same number of blocks in flight; ``docs/performance.md`` has the sweep behind the rule. Both decode
    kernels use it, so the one-launch and two-launch paths keep the same blocks (the same bits).

    Example:
        >>> default_block_l(64), default_block_l(128), default_block_l(16)
        (64, 32, 64)
    """
    return max(16, min(64, 4096 // head_dim))


def decode_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """The reference: SDPA over the grouped queries (see the module docstring for shapes)."""
    b, h, _, d = q.shape
    g = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, g, h // g, d), k, v, attn_mask=bias, scale=scale)
    return out.reshape(b, h, 1, d)


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device``."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _softmax_block(s, m_i, l_i):
        """One block's step of the online softmax over scores ``s [R, L]`` (fp32, ``-inf`` where masked) with the
        running maximum ``m_i`` and sum ``l_i`` ``[R]``: ``(m_new, alpha, p, l_new)``, the new maximum, the factor
        that rescales what was accumulated, the block's unnormalised probabilities and the new sum (a block with
        nothing visible yet keeps a maximum of ``-inf`` and adds nothing)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)

    @triton.jit(do_not_specialize=["kv_len"])
    def _decode_kernel(
        Q,
        K,
        V,
        Bias,
        Out,
        sq_b,
        sq_h,
        sk_b,
        sk_g,
        sk_l,
        sv_b,
        sv_g,
        sv_l,
        sb_b,
        sb_l,
        so_b,
        so_h,
        kv_len,
        Filled,
        scale,
        HAS_FILLED: tl.constexpr,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK_L: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        g = tl.program_id(1)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        heads = g * REP + r
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=r[:, None] < REP, other=0.0)
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        k_base = K + b * sk_b + g * sk_g
        v_base = V + b * sv_b + g * sv_g
        n = kv_len
        if HAS_FILLED:  # the slots past the filled ones are masked: do not read them
            n = tl.minimum(kv_len, tl.load(Filled).to(tl.int32))
        for start in range(0, n, BLOCK_L):
            slots = start + tl.arange(0, BLOCK_L)
            inside = slots < n
            k = tl.load(
                k_base + slots[None, :] * sk_l + d[:, None], mask=inside[None, :], other=0.0
            )  # [D, L]
            s = (tl.dot(q, k, input_precision=PRECISION) * scale).to(tl.float32)  # [REP_PAD, BLOCK_L]
            bias = tl.load(Bias + b * sb_b + slots * sb_l, mask=inside, other=float("-inf")).to(tl.float32)
            s = s + bias[None, :]
            m_new, alpha, p, l_i = _softmax_block(s, m_i, l_i)
            v = tl.load(
                v_base + slots[:, None] * sv_l + d[None, :], mask=inside[:, None], other=0.0
            )  # [L, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            Out + b * so_b + heads[:, None] * so_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=r[:, None] < REP,
        )


def decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None = None,
    *,
    filled: torch.Tensor | None = None,
    block_l: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """The Triton kernel (CUDA; see the module docstring). ``q``'s heads and ``k``/``v``'s last dimension must be
    contiguous; the head width a power of two >= 16. ``filled``: a device scalar, every slot at or past it is
    masked (read no further). ``block_l`` None: :func:`default_block_l`."""
    if triton is None:
        raise RuntimeError("decode_attention_triton needs Triton")
    b, h, _, d = q.shape
    g, kv_len = k.shape[1], k.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton decode kernel needs a power-of-two head width >= 16, got {d}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in their last dimension")
    q = q if q.stride(-1) == 1 else q.contiguous()
    rep = h // g
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    bias2 = bias.reshape(b, -1) if bias.shape[0] == b else bias.reshape(1, -1).expand(b, -1)
    _decode_kernel[(b, g)](
        q,
        k,
        v,
        bias2,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        bias2.stride(0),
        bias2.stride(1),
        out.stride(0),
        out.stride(1),
        kv_len,
        out if filled is None else filled,  # an unused pointer without it
        float(scale if scale is not None else d**-0.5),
        HAS_FILLED=filled is not None,
        REP=rep,
        REP_PAD=max(16, next_power_of_2(rep)),
        D=d,
        BLOCK_L=block_l or default_block_l(d),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None = None,
    filled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention on the fastest available implementation (see the module docstring); ``filled``: an optional
    device scalar past which every slot is masked."""
    d = q.shape[-1]
    if (
        triton_available(q.device)
        and os.environ.get("PPO_CORE_DECODE_ATTENTION", "auto") != "sdpa"
        and d >= 16
        and not d & (d - 1)
    ):
        return decode_attention_triton(q, k, v, bias, scale, filled=filled)
    return decode_attention_sdpa(q, k, v, bias, scale)
