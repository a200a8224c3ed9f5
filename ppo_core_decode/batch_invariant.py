"""Batch-invariant numerics for the rollout engine: each row's result independent of the other rows and of how many.

A KV-cached decode step and a full forward compute the same sums in different orders: a decode GEMM has ``M = B``
rows where the full forward has ``M = B x S`` (so cuBLAS picks other tiles, or splits ``K``), and attention over
a cache is another kernel than attention over a sequence. In bf16 the results then differ in the last bits, and a
random-weights model's nearly flat next-token logits turn that into other greedy tokens. The functions here give a
row the same bits whatever else is computed with it, so that cached decoding is bit for bit a full recomputation
through the same functions (and a prompt's response does not depend on the batch it was sampled in):

- :func:`invariant_rows` applies a row-wise function to fixed-size chunks of ``CHUNK_ROWS`` rows (the last one
  padded with zeros): every kernel call then has the same shape, so the same kernel with the same order of sums
  runs for every row. :func:`invariant_linear` is ``y = x W^T + b``: on CUDA one Triton GEMM whose tiles are fixed
  per dtype (a row's sums over ``K`` run in the same order in every tile, whatever the number of rows), elsewhere
  that chunked way (one product per chunk in float64, rounded once, because CPU GEMMs may treat a row by its
  position in the tile).
  :func:`invariant_rms_norm` is RMSNorm (with an optional residual add before it) with one Triton program per row
  on CUDA, its sum of squares over the row in a fixed order whatever the number of rows (one launch, where
  :func:`invariant_rows` would call a compiled kernel per chunk); elsewhere it goes through :func:`invariant_rows`.
  (Element-wise steps need nothing: each element is computed alone.)
- :func:`invariant_attention` computes each query on its own: it walks the keys from slot 0 in blocks of
  ``BLOCK_L`` slots up to its own slot with an online softmax (fp32 statistics and accumulator, the weights
  rounded to the value dtype before their product with the values), so that the query of slot ``i`` gives the same
  bits in a prefill of the whole sequence and in the decode step that produced slot ``i``. One Triton program per
  (query, key/value head) on CUDA; on other devices the same steps in PyTorch in float64, rounded once at the end
  (an order of sums that depends on the number of queries changes only bits far below the output's precision).

The price: GEMMs with fixed tiles where cuBLAS would pick per shape, and attention computes each query alone.

Example:
    >>> x, w = torch.randn(5, 8), torch.randn(3, 8)
    >>> torch.equal(invariant_linear(x, w)[2], invariant_linear(x[2:3], w)[0])
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppo_core.kernels.fused import add_rms_norm, rms_norm
from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2
from ppo_core.kernels.triton_launch import DirectLauncher
from ppo_core.kernels.triton_scan import _interpreting
from ppo_core_decode.eager_rounding import add_rms_norm_as_model, rms_norm_as_model

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU-only installs lack it
    triton = None
    tl = None

__all__ = [
    "BLOCK_L",
    "CHUNK_ROWS",
    "FP32_TRITON_MAX_N",
    "LINEAR_TILES",
    "invariant_attention",
    "invariant_linear",
    "invariant_rms_norm",
    "invariant_rows",
    "linear_chunked",
    "linear_path",
]

CHUNK_ROWS = 64
"""Rows per call of a row-wise kernel (a decode step of up to 64 rows is one chunk)."""

BLOCK_L = 64
"""Key/value slots per step of :func:`invariant_attention`'s walk over the keys."""


def _chunked(rows: int) -> int:
    return -(-rows // CHUNK_ROWS) * CHUNK_ROWS


def invariant_rows(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *rows: torch.Tensor, **kwargs: object
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(*rows, **kwargs)`` for a row-wise ``fn``, run on chunks of :data:`CHUNK_ROWS` rows.

    Args:
        fn: maps ``[C, D_i]`` inputs to one or more ``[C, E_j]`` outputs, row by row.
        rows: ``[..., D_i]`` inputs with the same leading dimensions (``M`` rows in all).
        kwargs: passed to ``fn`` unchanged (weights, epsilons).

    Returns:
        ``fn``'s outputs, ``[..., E_j]``.
    """
    lead = rows[0].shape[:-1]
    flat = [t.reshape(-1, t.shape[-1]) for t in rows]
    m = flat[0].shape[0]
    if m == 0:  # nothing to chunk: the function itself on the empty rows
        return fn(*rows, **kwargs)
    padded = _chunked(m)
    if padded != m:
        flat = [torch.cat([t, t.new_zeros(padded - m, t.shape[-1])]) for t in flat]
    chunks = [fn(*(t[i : i + CHUNK_ROWS] for t in flat), **kwargs) for i in range(0, padded, CHUNK_ROWS)]
    single = isinstance(chunks[0], torch.Tensor)
    outs = [chunks] if single else list(zip(*chunks, strict=True))
    joined = tuple(torch.cat(list(parts))[:m].reshape(*lead, -1) for parts in outs)
    return joined[0] if single else joined


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` with each row's bits independent of the other rows and of how many there are (see the module
    docstring).

    On CUDA (and under Triton's interpreter) one Triton GEMM of fixed tiles (:data:`LINEAR_TILES`, by dtype): every
    output element is its row's dot product with one column of ``W^T``, summed over ``K`` in the same order (the same
    blocks, the same matrix instructions) in every tile, whatever ``M``; fp32 in IEEE single precision (no TF32),
    half precision with an fp32 accumulator, the bias added in fp32 before the one rounding to ``x``'s dtype.
    fp32 products wider than :data:`FP32_TRITON_MAX_N` outputs (a vocabulary head) take the chunked path below on
    CUDA too. The choice depends on the weight alone, never on ``M``, so a weight's rows always meet the same sums.
    Elsewhere one fixed-shape product per :data:`CHUNK_ROWS` rows in float64, each rounded once (CPU GEMMs may treat
    a row by its position in the tile: in float64 that changes bits far below the output's precision).

    Args:
        x: ``[..., K]``. weight: ``[N, K]``. bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Raises:
        ValueError: ``weight`` or ``bias`` of another dtype than ``x`` (as ``F.linear`` refuses them: a silent
            conversion would copy the weight at every call and change what the product computes).
    """
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(
                f"invariant_linear: x is {str(x.dtype).removeprefix('torch.')} but {name} is "
                f"{str(t.dtype).removeprefix('torch.')}; they must share one dtype (convert the layer, as F.linear "
                "requires too)"
            )
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    run = _linear_triton if linear_path(x, weight) == "triton" else linear_chunked
    return run(flat, weight, bias).reshape(*lead, weight.shape[0])


def _triton_linear_runs(x: torch.Tensor) -> bool:
    """Whether :func:`_linear_kernel` can take ``x``: Triton on CUDA (or its interpreter), a dtype with tiles."""
    return triton is not None and (x.is_cuda or _interpreting()) and x.dtype in LINEAR_TILES


def linear_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which of :func:`invariant_linear`'s two paths computes ``x W^T``: ``"triton"`` (the fixed-tile GEMM) or
    ``"chunked"`` (:func:`linear_chunked`). It depends on the device, the dtype and the weight's width (fp32 weights
    wider than :data:`FP32_TRITON_MAX_N` stay chunked), never on how many rows there are, except that no rows at
    all need no kernel.

    Args:
        x: ``[..., K]`` the rows. weight: ``[N, K]``.

    Example:
        >>> linear_path(torch.randn(3, 8), torch.randn(4, 8))  # a CPU tensor: no Triton kernel
        'chunked'
    """
    wide_fp32 = x.dtype == torch.float32 and weight.shape[0] > FP32_TRITON_MAX_N
    rows = x.shape[:-1].numel()
    return "triton" if _triton_linear_runs(x) and rows > 0 and not wide_fp32 else "chunked"


def linear_chunked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`invariant_linear`'s path without Triton: ``[M, K]`` rows as one fixed-shape product per
    :data:`CHUNK_ROWS` rows (padded with zeros), in float64 off CUDA, each chunk rounded once to ``x``'s dtype.
    Batch-invariant too, but host-bound on long inputs (one launch per chunk); kept as the CPU path and as the
    baseline of ``benchmarks/batch_invariant.py``.

    Args:
        x: ``[M, K]``. weight: ``[N, K]``. bias: ``[N]`` or None.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    m, k = x.shape
    padded = _chunked(m)
    flat = torch.cat([x, x.new_zeros(padded - m, k)]) if padded != m else x
    if not x.is_cuda:
        flat, weight = flat.double(), weight.double()
        bias = None if bias is None else bias.double()
    out = torch.empty(padded, weight.shape[0], dtype=flat.dtype, device=x.device)
    wt = weight.t()
    # the chunk views made in one call each (a prefill has hundreds of chunks a layer: the loop is host-bound)
    pairs = zip(flat.split(CHUNK_ROWS), out.split(CHUNK_ROWS), strict=True)
    if bias is None:
        for rows, into in pairs:
            torch.mm(rows, wt, out=into)
    else:
        for rows, into in pairs:
            torch.addmm(bias, rows, wt, out=into)
    return out[:m].to(x.dtype)


FP32_TRITON_MAX_N = 16384
"""The widest fp32 product (``N``) :func:`invariant_linear` runs through its Triton GEMM: beyond it (vocabulary heads)
cuBLAS's fp32 kernels on fixed 64-row chunks are faster than the fixed-tile IEEE GEMM, below it the single launch
is (``benchmarks/batch_invariant.py`` times both)."""

LINEAR_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (64, 64, 32, 4, 3),
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
}
""":func:`invariant_linear`'s Triton tiles by input dtype: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``.
Fixed, never tuned per shape: a row's bits are the kernel's order of sums, so a decode step (``M = B``) and a
prefill (``M = B x S``) must run the same tiles."""


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])
    def _linear_kernel(
        X,
        W,
        Bias,
        Y,
        n_rows,
        n_cols,
        n_inner,
        sxm,
        swn,
        sym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_inner, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                X + rm[:, None] * sxm + kk[None, :],
                mask=(rm[:, None] < n_rows) & (kk[None, :] < n_inner),
                other=0.0,
            )
            b = tl.load(
                W + rn[None, :] * swn + kk[:, None],
                mask=(rn[None, :] < n_cols) & (kk[:, None] < n_inner),
                other=0.0,
            )
            if UPCAST:  # the interpreter's dot multiplies the raw bits of bf16 values; fp32 is exact for them
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=rn < n_cols, other=0.0).to(tl.float32)[None, :]
        tl.store(
            Y + rm[:, None] * sym + rn[None, :],
            acc.to(Y.dtype.element_ty),
            mask=(rm[:, None] < n_rows) & (rn[None, :] < n_cols),
        )


def _linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`invariant_linear` on ``[M, K]`` rows through :func:`_linear_kernel` (one launch)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = LINEAR_TILES[x.dtype]
    _linear_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        x,
        weight,
        bias.contiguous() if bias is not None else weight,  # unused pointer without a bias
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=_interpreting() and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # (ignored for half-precision inputs)
        num_warps=warps,
        num_stages=stages,
    )
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["n_queries"])
    def _attention_kernel(
        Q,
        K,
        V,
        Valid,
        Slots,
        Out,
        sq_b,
        sq_h,
        sq_s,
        sk_b,
        sk_g,
        sk_l,
        sv_b,
        sv_g,
        sv_l,
        sval_b,
        sslot,
        so_b,
        so_h,
        so_s,
        n_queries,
        scale,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        query = tl.program_id(0)
        g = tl.program_id(1)
        b = query // n_queries
        s = query % n_queries
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        heads = g * REP + r
        own = tl.load(Slots + s * sslot).to(tl.int32)  # this query's slot: it sees the slots 0..own
        q = tl.load(
            Q + b * sq_b + s * sq_s + heads[:, None] * sq_h + d[None, :], mask=r[:, None] < REP, other=0.0
        )
        if UPCAST:  # the interpreter's dot multiplies the raw bits of bf16 values; fp32 is exact for them
            q = q.to(tl.float32)
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        for start in range(0, own + 1, BLOCK):
            slots = start + tl.arange(0, BLOCK)
            inside = slots <= own
            k = tl.load(
                K + b * sk_b + g * sk_g + slots[None, :] * sk_l + d[:, None], mask=inside[None, :], other=0.0
            )
            v = tl.load(
                V + b * sv_b + g * sv_g + slots[:, None] * sv_l + d[None, :], mask=inside[:, None], other=0.0
            )
            if UPCAST:
                k = k.to(tl.float32)
            valid = tl.load(Valid + b * sval_b + slots, mask=inside, other=0) != 0
            seen = inside & (valid | (slots == own))  # a query always sees itself: never an empty softmax
            s_blk = tl.dot(q, k, input_precision=PRECISION) * scale
            s_blk = tl.where(seen[None, :], s_blk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_blk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block before anything visible
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s_blk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(V.dtype.element_ty)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            Out + b * so_b + s * so_s + heads[:, None] * so_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=r[:, None] < REP,
        )


if triton is not None:

    @triton.jit  # n_cols specialised: a multiple of 16 lets the masked loads and stores be vectorised
    def _rms_norm_kernel(
        X,
        Delta,
        W,
        Sum,
        Out,
        sx,
        sd,
        ssum,
        so,
        n_cols,
        eps,
        ADD: tl.constexpr,
        MODEL_ROUNDING: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        inside = cols < n_cols
        x = tl.load(X + row * sx + cols, mask=inside, other=0.0)
        if ADD:  # the residual stream: rounded to its dtype, stored, then normalised
            x = (
                x.to(tl.float32) + tl.load(Delta + row * sd + cols, mask=inside, other=0.0).to(tl.float32)
            ).to(X.dtype.element_ty)
            tl.store(Sum + row * ssum + cols, x, mask=inside)
        xf = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)  # one row, one fixed reduction tree
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        if MODEL_ROUNDING:  # noqa: SIM108 (the model's: the normalised row rounded to the input dtype, then the weight)
            y = (xf * inv_rms).to(X.dtype.element_ty).to(tl.float32) * w
        else:  # one rounding at the end
            y = xf * inv_rms * w
        tl.store(Out + row * so + cols, y.to(Out.dtype.element_ty), mask=inside)


def _norm_functions(model_rounding: bool) -> tuple[Callable, Callable]:
    """The PyTorch forms of :func:`invariant_rms_norm`'s arithmetic: ``(norm, add + norm)``."""
    if model_rounding:
        return rms_norm_as_model, add_rms_norm_as_model
    return rms_norm, add_rms_norm


def invariant_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    model_rounding: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of ``x`` (after the residual add ``x + delta`` if ``delta`` is given), a row's result
    independent of the other rows and of how many there are.

    ``model_rounding``: the Hugging Face models' arithmetic (the normalised row rounded to ``x``'s dtype, then
    multiplied by the weight: the output in the promoted dtype of the two;
    :func:`~ppo_core_decode.eager_rounding.rms_norm_as_model`); otherwise one rounding at the end
    (``torch.nn.RMSNorm``'s, and megatron's fused norm: the output in ``x``'s dtype;
    :func:`~ppo_core.kernels.fused.rms_norm`). The sum ``x + delta`` is
    rounded to ``x``'s dtype before it is normalised. On CUDA (and under Triton's interpreter) one Triton program
    normalises one row (fp32 statistics; half and single precision); elsewhere the same arithmetic runs in PyTorch
    through :func:`invariant_rows`.

    Args:
        x: ``[..., D]`` activations. weight: ``[D]``. eps: added to the mean square.
        delta: ``[..., D]`` residual branch to add first (``x``'s shape and dtype), or None.
        model_rounding: see above.

    Returns:
        ``[..., D]`` normalised rows, or ``(x + delta, normalised rows)`` when ``delta`` is given.

    Example:
        >>> x, w = torch.randn(5, 8), torch.rand(8)
        >>> torch.equal(invariant_rms_norm(x, w, 1e-6)[3], invariant_rms_norm(x[3:4], w, 1e-6)[0])
        True
    """
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(
            f"delta is {delta.dtype} {tuple(delta.shape)} but x is {x.dtype} {tuple(x.shape)}: they must match"
        )
    use_triton = (
        triton is not None
        and (x.is_cuda or _interpreting())
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and x.numel() > 0
    )
    if not use_triton:
        norm, add_norm = _norm_functions(model_rounding)
        if delta is None:
            return invariant_rows(norm, x, weight=weight, eps=eps)
        return invariant_rows(add_norm, x, delta, weight=weight, eps=eps)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if model_rounding else x.dtype
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if delta is not None:
        branch = delta.reshape(-1, d)
        if branch.stride(-1) != 1:
            branch = branch.contiguous()
        summed = torch.empty_like(rows)
    else:
        branch = summed = rows  # unused pointers
    _rms_norm_launch(
        (rows.shape[0],),
        rows,
        branch,
        weight.contiguous(),
        summed,
        out,
        rows.stride(0),
        branch.stride(0),
        summed.stride(0),
        out.stride(0),
        d,
        float(eps),
        ADD=delta is not None,
        MODEL_ROUNDING=model_rounding,
        BLOCK_D=next_power_of_2(d),
        num_warps=4 if d <= 4096 else 8,
    )
    normed = out.reshape(x.shape)
    return normed if delta is None else (summed.reshape(x.shape), normed)


def _attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    b, h, s, d = q.shape
    g = k.shape[1]
    rep = h // g
    out = torch.empty_like(q)
    valid_u8 = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    _attention_kernel[(b * s, g)](
        q,
        k,
        v,
        valid_u8,
        slots,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        valid_u8.stride(0),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        s,
        float(scale),
        REP=rep,
        REP_PAD=max(16, next_power_of_2(rep)),
        D=d,
        BLOCK=BLOCK_L,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # (ignored for half-precision inputs)
        num_warps=4,
        num_stages=2,
    )
    return out


def _attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """The kernel's steps in PyTorch for all queries at once, in float64 and rounded once at the end: the order of
    a sum may depend on how many queries there are, but only in bits far below the output's precision."""
    b, h, s, d = q.shape
    g, length = k.shape[1], k.shape[2]
    rep = h // g
    f64 = torch.float64
    qf = q.reshape(b, g, rep, s, d).to(f64)  # [B, G, R, S, d]
    own = slots.expand(s).to(torch.long)  # [S]
    m_i = torch.full((b, g, rep, s), float("-inf"), dtype=f64, device=q.device)
    l_i = torch.zeros(b, g, rep, s, dtype=f64, device=q.device)
    acc = torch.zeros(b, g, rep, s, d, dtype=f64, device=q.device)
    for start in range(0, int(own.max()) + 1 if s else 0, BLOCK_L):
        idx = torch.arange(start, min(start + BLOCK_L, length), device=q.device)
        k_blk, v_blk = k[:, :, idx].to(f64), v[:, :, idx].to(f64)  # [B, G, L, d]
        seen = (idx[None, :] <= own[:, None]) & (
            valid[:, None, idx] | (idx[None, :] == own[:, None])
        )  # [B, S, L]
        s_blk = torch.einsum("bgrsd,bgld->bgrsl", qf, k_blk) * scale
        s_blk = torch.where(seen[:, None, None], s_blk, float("-inf"))
        m_new = torch.maximum(m_i, s_blk.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(m_i - m_safe)
        p = torch.exp(s_blk - m_safe[..., None])
        l_i = l_i * alpha + p.sum(-1)
        p = p.to(v.dtype).to(f64)  # the weights in the value dtype, as the kernel multiplies them
        acc = acc * alpha[..., None] + torch.einsum("bgrsl,bgld->bgrsd", p, v_blk)
        m_i = m_new
    return (acc / l_i[..., None]).to(q.dtype).reshape(b, h, s, d)


def invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    query_slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of each query on its own over the keys up to its slot (see the module docstring).

    Query ``s`` of row ``b`` sits at slot ``query_slots[s]`` and sees key ``j`` when ``j <= query_slots[s]`` and
    the key holds a real token (``key_valid[b, j]``) or is its own (``j == query_slots[s]``: a padding query sees
    itself, so its softmax is finite). Keys past a query's slot are never read.

    Args:
        q: ``[B, H, S, d]`` queries (position embedding applied; the head width contiguous).
        k, v: ``[B, G, L, d]`` keys and values (the cache, or a whole sequence), ``H`` a multiple of ``G``, the
            head width contiguous.
        key_valid: ``[B, L]`` bool.
        query_slots: ``[S]`` int64 slots of the queries (the same for every row), each ``< L``.
        scale: softmax scale (None: ``1 / sqrt(d)``).

    Returns:
        ``[B, H, S, d]`` in ``q``'s dtype.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
        >>> out = invariant_attention(q, k, v, torch.ones(1, 3, dtype=torch.bool), torch.arange(3))
        >>> torch.equal(out[:, :, 2:], invariant_attention(q[:, :, 2:], k, v, torch.ones(1, 3, dtype=torch.bool),
        ...                                                torch.tensor([2])))
        True
    """
    d = q.shape[-1]
    scale = float(scale if scale is not None else d**-0.5)
    if q.numel() == 0:
        return torch.empty_like(q)
    use_triton = triton is not None and (q.is_cuda or _interpreting()) and d >= 16 and not d & (d - 1)
    if use_triton:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"invariant_attention needs {name}'s head width contiguous")
        return _attention_triton(q, k, v, key_valid, query_slots, scale)
    return _attention_torch(q, k, v, key_valid, query_slots, scale)


# launched through the compiled kernel once Triton has compiled it (less host time a launch: a prefill's many)
if triton is not None:
    _rms_norm_launch = DirectLauncher(_rms_norm_kernel)
