"""The projections of a decode step as weight-streaming Triton GEMMs with the layer's element-wise steps fused in.

A decode step multiplies a few rows (one token per sequence, ``M <= 64``) by every weight matrix of the model, so
each projection is bound by reading its weight once, and at this size a kernel's launch, ramp-up and tail cost as
much as the read of a small matrix. Unfused, a Llama-family layer spends five more kernels around its four
products: the residual add + RMSNorm before the q/k/v and the gate/up products (twice), SiLU x up after gate/up,
and the split-K reduction of the down product. :func:`decode_linear` folds them into the products' epilogues and
keeps the main loop a plain product (an element-wise prologue on the rows is slower: it keeps the rows from feeding
the tensor cores straight from shared memory):

- **residual epilogue** (``residual``): the product, rounded to the model dtype, is added to the residual stream as
  the models add it, and the new residual ``h`` is the output; each program also writes the sum of squares of its
  block of ``h``'s columns per row (``[P, M]`` partial sums over ``P`` column blocks), for the norm that follows;
- **scaled copy** (``next_norm_weight``, with ``residual``): the new residual times the next norm's weight, rounded
  (a second output): the input of a product whose norm weight is not folded into its weight (the output layer,
  whose weight is the embedding's, and the megatron engine's products with ``fold_norms=False``, which copies no
  weight), normalised by the row scale below;
- **norm epilogue** (``sumsq``): RMSNorm of a row is a per-row scale, ``rmsnorm(h) W^T = rstd * (h (W diag w)^T)``
  with ``rstd = 1 / sqrt(mean(h^2) + eps)``: the caller folds the norm weight ``w`` into the weight once per
  generation (:func:`fold_norm_weight`), and each program sums the partial sums of squares in a fixed order and
  scales its accumulator;
- **SwiGLU epilogue** (``swiglu``): the weight is ``[gate; up]`` (``[2F, K]``); a program accumulates a block of
  gate columns and the matching up columns and writes ``silu(gate) * up`` ``[M, F]`` only;
- **split-K in one launch**: a product with few column blocks splits its ``K`` range over several programs; each
  writes its fp32 partial to a workspace, and the program that finishes last for a column block (an atomic
  counter, reset by that program for the next call) sums the partials in a fixed order and runs the epilogue. The
  result is deterministic.
- **persistent launch** (``DecodeLinearConfig.tiles_per_program``, the output layer's default): one program per SM
  streams an equal share of the weight's rows, its tiles' ``K`` loops flattened into one software pipeline (a
  product without residual, SwiGLU or split);
- **programmatic dependent launch** on Hopper (:mod:`ppo_core_decode.pdl`; ``PPO_CORE_PDL=0`` turns it off): a
  program loads its first weight tile and, for a weight of at most :data:`PREFETCH_MAX_BYTES`, fetches the rest of
  its slice into the L2 (``prefetch.global.L2``, no registers held), then waits for the previous kernel and lets
  the next one launch at once: the next kernel's weight reads overlap this kernel's work, not its end.

Roundings: the residual add and the SwiGLU steps round as the models' eager forwards do (the product rounded to the
model dtype, then the add in it; the gate and up products, SiLU and their product each rounded). The norm does not:
the models round the normalised row and its product with ``w``; here ``W diag w`` is rounded once per generation and
``rstd`` scales the fp32 accumulator. A decode step through these kernels therefore differs from the model's own
forward by roundings of the size bf16 carries, like any change of GEMM kernel (the greedy tokens of the default
engines differ from a full recomputation on near-ties already); the batch-invariant engines never use them.

:func:`decode_linear_reference` is the contract in PyTorch (any device): the tests compare the kernel with it.
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ppo_core.kernels.compiled import cuda_compiled
from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2
from ppo_core.kernels.triton_launch import DirectLauncher
from ppo_core.kernels.triton_scan import _interpreting
from ppo_core_decode.pdl import pdl_enabled, prefetch_l2
from ppo_core_decode.split_launch import arrival_counters, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

# the Triton element types of the dtypes whose addresses a table holds (fold_norm_weights_all)
_TL_DTYPES = (
    {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if tl is not None
    else {}
)

__all__ = [
    "MAX_ROWS",
    "PREFETCH_MAX_BYTES",
    "DecodeLinearConfig",
    "DecodeLinearOutput",
    "decode_linear",
    "decode_linear_available",
    "decode_linear_reference",
    "fold_norm_weight",
    "fold_norm_weights",
    "fold_norm_weights_all",
    "prefetches_weight",
    "row_sumsq",
    "row_sumsq_scaled",
]

MAX_ROWS = 64
"""Most rows a call multiplies (one block of rows: every program reads the weight once for all of them)."""

PREFETCH_MAX_BYTES = 16 * 2**20
"""Largest weight whose programs fetch their whole slice into the L2 before they wait for the previous kernel (with
PDL): a thin layer's products (4-13 MB at Qwen3-0.6B's shape) then stream from the L2 once the wait ends; a larger
weight's lines would start to evict each other in a 50 MB L2 before they are read (``docs/performance.md``)."""


def prefetches_weight(weight: torch.Tensor) -> bool:
    """Whether :func:`decode_linear`'s grid launch prefetches ``weight`` (``[N, K]``) into the L2 (where it launches
    with PDL): at most :data:`PREFETCH_MAX_BYTES`."""
    return weight.numel() * weight.element_size() <= PREFETCH_MAX_BYTES


class DecodeLinearOutput(NamedTuple):
    """What :func:`decode_linear` returns."""

    y: torch.Tensor
    """``[M, N]`` (``[M, N / 2]`` with SwiGLU) in the dtype of ``x``: the product, or with ``residual`` the new
    residual stream."""
    sumsq: torch.Tensor | None
    """With ``residual``: ``[P, M]`` fp32 partial sums of squares of ``y``'s rows (one per block of its columns);
    else None."""
    scaled: torch.Tensor | None
    """With ``next_norm_weight``: ``y * next_norm_weight`` rounded to the dtype of ``x`` ``[M, N]``; else None."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeLinearConfig:
    """Launch shape of :func:`decode_linear` (None: chosen from the shapes by :func:`_default_config`)."""

    block_n: int = 32
    """Output columns per program (for ``swiglu``: gate columns, and as many up columns)."""
    block_k: int = 128
    """Reduction columns per loop iteration."""
    split_k: int = 1
    """Programs sharing one column block's ``K`` range (a power of two; partials summed in a fixed order)."""
    num_warps: int = 4
    num_stages: int = 4
    tiles_per_program: int = 0
    """0: one program per column block. ``T > 0`` (a product without ``residual``, SwiGLU or split): persistent,
    one program per SM running ``T`` column tiles back to back in one pipelined loop, each tile
    ``ceil(N / (SMs * T))`` columns (at most ``block_n``), so every program reads the same share of the weight."""


def decode_linear_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` runs its kernel for ``x [M, K]`` and ``weight [N, K]``: Triton on CUDA (or
    the interpreter), bf16 or fp16, ``1 <= M <= MAX_ROWS``, a contiguous weight."""
    return (
        triton is not None
        and (x.is_cuda or _interpreting())
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape[1] == x.shape[1]
    )


def fold_norm_weight(
    weight: torch.Tensor, norm_weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``W diag w``: the weight ``[N, K]`` of a product that follows an RMSNorm with weight ``w [K]``, each column
    scaled by the norm's weight and rounded to the weight's dtype (written into ``out`` when given)."""
    return torch.mul(weight, norm_weight.to(weight.dtype), out=out)


FOLD_MAX_WEIGHTS = 4
"""Most weights :func:`fold_norm_weights` stacks in one launch."""


def fold_norm_weights(out: torch.Tensor, scale: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    """Stack ``weights`` (``[N_i, K]`` each) along their rows into ``out [sum N_i, K]``, each column times
    ``scale [K]``: :func:`fold_norm_weight` of each weight into its rows of ``out``, the same bits (one product,
    rounded to ``out``'s dtype, as ``torch.mul`` rounds it).

    On CUDA, with contiguous tensors of one dtype and at most :data:`FOLD_MAX_WEIGHTS` weights, one Triton launch
    writes the whole stack; elsewhere one ``torch.mul`` per weight. The HF engine refreshes these stacks before every
    generation: ``torch.mul`` per weight broadcasts the ``[K]`` scale over the rows through PyTorch's unvectorised
    element-wise kernel, and a compiled function per group costs host time with the GPU idle, both ahead of the
    prefill.

    Example:
        >>> out = torch.empty(3, 2)
        >>> fold_norm_weights(out, torch.tensor([2.0, 3.0]), [torch.ones(1, 2), torch.ones(2, 2)])
        >>> out.tolist()
        [[2.0, 3.0], [2.0, 3.0], [2.0, 3.0]]
    """
    _check_fold(out, scale, weights)
    _fold_checked(out, scale, weights)


def fold_norm_weights_all(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]]) -> None:
    """:func:`fold_norm_weights` of every job ``(out, scale, weights)``, the same bits.

    On CUDA, where every job takes :func:`fold_norm_weights`' one-launch path and all share one device and one dtype
    (outputs and weights; scales another, shared), one Triton launch writes every stack: each program copies a block
    of rows of one weight, the weights' addresses and sizes read from a table sent to the device without a host
    synchronisation. Elsewhere, one :func:`fold_norm_weights` a job. The HF engine refreshes two stacks a layer at
    the start of every generation: one launch for all of them takes that host time (a Python call and a launch a
    stack, 56 for a 28-layer model) out of the prefill, which on a thin model the host bounds.

    Example:
        >>> outs = [torch.empty(1, 2), torch.empty(2, 2)]
        >>> fold_norm_weights_all([(outs[0], torch.tensor([2.0, 3.0]), [torch.ones(1, 2)]),
        ...                        (outs[1], torch.tensor([1.0, 5.0]), [torch.ones(1, 2), 2 * torch.ones(1, 2)])])
        >>> [o.tolist() for o in outs]
        [[[2.0, 3.0]], [[1.0, 5.0], [2.0, 10.0]]]
    """
    for i, (out, scale, weights) in enumerate(jobs):
        try:
            _check_fold(out, scale, weights)
        except ValueError as error:
            raise ValueError(f"jobs[{i}]: {error}") from None
    if not jobs:
        return
    out0, scale0 = jobs[0][0], jobs[0][1]
    one_launch = (
        out0.dtype in _TL_DTYPES
        and scale0.dtype in _TL_DTYPES
        and all(
            _folds_in_one_launch(out, scale, weights)
            and out.device == out0.device
            and out.dtype == out0.dtype
            and scale.dtype == scale0.dtype
            for out, scale, weights in jobs
        )
    )
    if one_launch:
        _fold_pieces_triton(jobs)
        return
    for out, scale, weights in jobs:
        _fold_checked(out, scale, weights)


def _check_fold(out: torch.Tensor, scale: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the shape of a :func:`fold_norm_weights` job that does not fit."""
    rows = [w.shape[0] for w in weights]
    if out.dim() != 2 or sum(rows) != out.shape[0] or any(w.shape[1:] != out.shape[1:] for w in weights):
        raise ValueError(
            f"out must be [sum N_i, K] = [{sum(rows)}, K] for weights {[tuple(w.shape) for w in weights]}, "
            f"got {tuple(out.shape)}"
        )
    if tuple(scale.shape) != (out.shape[1],):
        raise ValueError(f"scale must be [{out.shape[1]}], got {tuple(scale.shape)}")


def _fold_checked(out: torch.Tensor, scale: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    """:func:`fold_norm_weights` of a job :func:`_check_fold` accepted: one launch where it can, else one
    :func:`fold_norm_weight` a weight."""
    if _folds_in_one_launch(out, scale, weights):
        _fold_norm_weights_triton(out, scale, weights)
        return
    rows = [w.shape[0] for w in weights]
    for weight, part in zip(weights, out.split(rows), strict=True):
        fold_norm_weight(weight, scale, out=part)


def _folds_in_one_launch(out: torch.Tensor, scale: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether a checked :func:`fold_norm_weights` job runs as one Triton launch: CUDA, contiguous tensors of one
    device, weights of ``out``'s dtype, 1 to :data:`FOLD_MAX_WEIGHTS` of them."""
    return (
        triton is not None
        and out.is_cuda
        and 1 <= len(weights) <= FOLD_MAX_WEIGHTS
        and out.is_contiguous()
        and scale.is_contiguous()
        and all(w.is_contiguous() and w.dtype == out.dtype and w.device == out.device for w in weights)
        and scale.device == out.device
    )


_PIECE_COLUMNS = 5
"""A weight's row of :func:`_fold_pieces_triton`'s table: the address of its rows in the output stack, its own
address, its scale's address, its rows and its columns."""


def _fold_pieces_triton(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]]) -> None:
    """:func:`fold_norm_weights_all`'s launch: a grid of (row blocks, weights), the weights' addresses and sizes in a
    table (on CPU tensors under ``TRITON_INTERPRET=1`` too, whose fp32 -> bf16 conversion truncates where the GPU
    rounds to nearest). The table reaches the device through pinned memory, queued without a host synchronisation.
    The kernel reads its addresses from memory, so only the host can tell it they are 16-byte aligned (then rows
    move as 16-byte vectors)."""
    table: list[int] = []
    longest, widest, aligned = 0, 0, True
    for out, scale, weights in jobs:
        k = out.shape[1]
        step = k * out.element_size()
        at = out.data_ptr()
        for w in weights:
            n = w.shape[0]
            if n and k:
                table += [at, w.data_ptr(), scale.data_ptr(), n, k]
                longest, widest = max(longest, n), max(widest, k)
                aligned = aligned and (at | w.data_ptr() | scale.data_ptr()) % 16 == 0 and k % 16 == 0
            at += n * step
    if not table:
        return
    out0 = jobs[0][0]
    cuda = out0.device.type == "cuda"
    addresses = torch.tensor(table, dtype=torch.int64, pin_memory=cuda)
    block_r = 16
    _fold_pieces_launch(
        (cdiv(longest, block_r), len(table) // _PIECE_COLUMNS),
        addresses.to(out0.device, non_blocking=True) if cuda else addresses,
        BLOCK_R=block_r,
        BLOCK_K=min(256, max(16, next_power_of_2(widest))),
        DTYPE=_TL_DTYPES[out0.dtype],
        SCALE_DTYPE=_TL_DTYPES[jobs[0][1].dtype],
        ALIGNED=aligned,
        COLUMNS=_PIECE_COLUMNS,
        num_warps=4,
    )


def _fold_norm_weights_triton(
    out: torch.Tensor, scale: torch.Tensor, weights: Sequence[torch.Tensor]
) -> None:
    """:func:`fold_norm_weights`' launch (contiguous tensors, 1 to :data:`FOLD_MAX_WEIGHTS` weights; on CPU tensors
    under ``TRITON_INTERPRET=1``, whose fp32 -> bf16 conversion truncates where the GPU rounds to nearest)."""
    n, k = out.shape
    if n == 0 or k == 0:
        return
    ends = list(itertools.accumulate(w.shape[0] for w in weights)) + [n] * (FOLD_MAX_WEIGHTS - len(weights))
    padded = list(weights) + [weights[0]] * (FOLD_MAX_WEIGHTS - len(weights))
    block_r, block_k = 16, 256
    _fold_launch(
        (cdiv(n, block_r), cdiv(k, block_k)),
        out,
        scale,
        *padded,
        ends[0],
        ends[1],
        ends[2],
        n,
        k,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        NUM=len(weights),
        num_warps=4,
    )


@cuda_compiled
def row_sumsq(h: torch.Tensor) -> torch.Tensor:
    """``[1, M]`` fp32 sums of squares of the rows of ``h [M, K]``: the ``sumsq`` of the first normed product of a
    decode step (later ones get theirs from the residual epilogue). One kernel on CUDA."""
    return h.float().square().sum(-1)[None]


@cuda_compiled
def row_sumsq_scaled(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_sumsq` and ``h * weight`` rounded to ``h``'s dtype (``weight [K]``): the first normed product's
    statistics and input where the norm's weight is not folded into it. One kernel on CUDA."""
    return h.float().square().sum(-1)[None], h * weight


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sumsq: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    next_norm_weight: torch.Tensor | None = None,
) -> DecodeLinearOutput:
    """:func:`decode_linear`'s contract in PyTorch, with its roundings (see the module docstring). Its ``sumsq``
    output is the whole per-row sum of squares ``[M]`` rather than partial sums."""
    acc = x.float() @ weight.float().T
    if sumsq is not None:
        total = sumsq.float().sum(0) if sumsq.dim() == 2 else sumsq.float()
        acc = acc * torch.rsqrt(total / x.shape[1] + eps)[:, None]
    if bias is not None:
        acc = acc + bias.float()
    if swiglu:
        gate, up = acc.to(x.dtype).chunk(2, dim=-1)
        y = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    else:
        y = acc.to(x.dtype)
    if residual is None:
        return DecodeLinearOutput(y, None, None)
    y = residual + y
    scaled = None if next_norm_weight is None else y * next_norm_weight.to(y.dtype)
    return DecodeLinearOutput(y, y.float().pow(2).sum(-1), scaled)


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    sumsq: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    next_norm_weight: torch.Tensor | None = None,
    config: DecodeLinearConfig | None = None,
) -> DecodeLinearOutput:
    """``y = x W^T + b`` for a few rows in one launch, with RMSNorm's row scale, SwiGLU or the residual add fused
    into its epilogue (see the module docstring).

    Args:
        x: ``[M, K]`` rows (``M <= MAX_ROWS``; the residual stream itself when ``sumsq`` is given).
        weight: ``[N, K]`` contiguous (``[gate; up]``, ``N = 2F``, with ``swiglu``; the norm weight folded in by
            :func:`fold_norm_weight` with ``sumsq``).
        bias: ``[N]`` or None.
        sumsq: ``[P, M]`` fp32 partial sums of squares of ``x``'s rows (the second output of the call that produced
            ``x``, or ``x.float().pow(2).sum(-1)[None]``): scale each row by ``1 / sqrt(mean(x^2) + eps)``.
        eps: the norm's epsilon.
        residual: ``[M, N]``: return ``residual + y`` (the new residual stream) and its partial sums of squares.
        swiglu: return ``silu(gate) * up`` ``[M, N / 2]`` instead of ``[M, N]``.
        next_norm_weight: ``[N]`` in the dtype of ``x``, with ``residual``: also return the new residual times it.
        config: launch shape; None: chosen from the shapes.

    Returns:
        :class:`DecodeLinearOutput` ``(y, sumsq, scaled)``.

    Example:
        >>> x, w = torch.ones(2, 4), torch.eye(4)
        >>> out = decode_linear_reference(
        ...     x, 2 * w, sumsq=torch.full((2,), 4.0), eps=0.0, residual=x, next_norm_weight=torch.full((4,), 0.5)
        ... )
        >>> out.y[0].tolist(), out.sumsq.tolist(), out.scaled[0].tolist()
        ([3.0, 3.0, 3.0, 3.0], [36.0, 36.0], [1.5, 1.5, 1.5, 1.5])
    """
    if not decode_linear_available(x, weight):
        raise ValueError(
            f"decode_linear needs Triton on CUDA, x [M <= {MAX_ROWS}, K] and a contiguous weight [N, K] of its "
            f"dtype; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if swiglu and n % 2:
        raise ValueError(f"swiglu needs an even number of weight rows ([gate; up]), got {n}")
    width = n // 2 if swiglu else n
    if bias is not None and (tuple(bias.shape) != (n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    if residual is not None and (
        tuple(residual.shape) != (m, width) or residual.device != x.device or residual.dtype != x.dtype
    ):
        raise ValueError(
            f"residual must be [{m}, {width}] {x.dtype} on {x.device}, got {tuple(residual.shape)} "
            f"{residual.dtype} on {residual.device}"
        )
    if next_norm_weight is not None and (
        residual is None
        or tuple(next_norm_weight.shape) != (width,)
        or next_norm_weight.dtype != x.dtype
        or next_norm_weight.device != x.device
    ):
        raise ValueError(
            f"next_norm_weight needs residual and must be [{width}] {x.dtype} on {x.device}, got "
            f"{tuple(next_norm_weight.shape)} {next_norm_weight.dtype} on {next_norm_weight.device}"
            + ("" if residual is not None else " (no residual)")
        )
    if sumsq is not None and (
        sumsq.dim() != 2 or sumsq.shape[1] != m or sumsq.dtype != torch.float32 or sumsq.device != x.device
    ):
        raise ValueError(
            f"sumsq must be [P, {m}] float32 on {x.device}, got {tuple(sumsq.shape)} {sumsq.dtype} on {sumsq.device}"
        )
    cfg = config or _default_config(width, k, swiglu, x.device, plain=residual is None)
    block_m = max(16, next_power_of_2(m))
    x = x if x.stride(-1) == 1 else x.contiguous()
    if sumsq is not None and not sumsq.is_contiguous():
        sumsq = sumsq.contiguous()
    if cfg.tiles_per_program > 0:
        if residual is not None or swiglu or cfg.split_k != 1:
            raise ValueError(
                "DecodeLinearConfig.tiles_per_program > 0 (a persistent launch) takes no residual, swiglu or "
                f"split_k; got residual={residual is not None}, swiglu={swiglu}, split_k={cfg.split_k}"
            )
        return DecodeLinearOutput(_persistent(x, weight, bias, sumsq, eps, cfg, block_m), None, None)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = torch.empty(m, width, dtype=x.dtype, device=x.device)
    scaled = torch.empty_like(y) if next_norm_weight is not None else None
    n_blocks = cdiv(width, cfg.block_n)
    sumsq_out = torch.empty(n_blocks, m, device=x.device) if residual is not None else None
    split = cfg.split_k
    if split > 1:
        parts = torch.empty(split, 2 if swiglu else 1, block_m, n_blocks * cfg.block_n, device=x.device)
        counters = arrival_counters(x.device, n_blocks)
    else:
        parts = counters = y  # unused
    k_per_split = cdiv(cdiv(k, split), cfg.block_k) * cfg.block_k
    p_in = sumsq.shape[0] if sumsq is not None else 1
    pdl = pdl_enabled(x.device)
    _decode_linear_kernel[(n_blocks, split)](
        x,
        weight,
        bias if bias is not None else x,
        y,
        residual if residual is not None else x,
        sumsq if sumsq is not None else y,
        sumsq_out if sumsq_out is not None else y,
        next_norm_weight if next_norm_weight is not None else y,
        scaled if scaled is not None else y,
        parts,
        counters,
        m,
        width,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        p_in,
        float(eps),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_P=next_power_of_2(p_in),
        SPLIT=split,
        NORM=sumsq is not None,
        RESIDUAL=residual is not None,
        SCALED=next_norm_weight is not None,
        SWIGLU=swiglu,
        HAS_BIAS=bias is not None,
        UPCAST=_interpreting(),
        PDL=pdl,
        PREFETCH=pdl and prefetches_weight(weight),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return DecodeLinearOutput(y, sumsq_out, scaled)


def _persistent(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    eps: float,
    cfg: DecodeLinearConfig,
    block_m: int,
) -> torch.Tensor:
    """:func:`decode_linear`'s persistent launch (``cfg.tiles_per_program > 0``): ``y [M, N]``."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    sms = sm_count(x.device)
    cols = -(-n // (sms * cfg.tiles_per_program))
    if cols > cfg.block_n:
        raise ValueError(
            f"DecodeLinearConfig: {cfg.tiles_per_program} tiles a program on {sms} SMs give tiles "
            f"of {cols} of the {n} columns, more than block_n = {cfg.block_n}"
        )
    tiles = -(-n // cols)  # no tile without columns
    progs = min(sms, tiles)
    p_in = sumsq.shape[0] if sumsq is not None else 1
    pdl = pdl_enabled(x.device)
    _decode_linear_persistent_kernel[(progs,)](
        x,
        weight,
        bias if bias is not None else x,
        y,
        sumsq if sumsq is not None else y,
        m,
        n,
        k,
        cols,
        tiles,
        x.stride(0),
        weight.stride(0),
        p_in,
        float(eps),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_P=next_power_of_2(p_in),
        PROGRAMS=progs,
        STAGES=cfg.num_stages,
        NORM=sumsq is not None,
        HAS_BIAS=bias is not None,
        UPCAST=_interpreting(),
        PDL=pdl,
        num_warps=cfg.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


def _default_config(
    width: int, k: int, swiglu: bool, device: torch.device, *, plain: bool = True
) -> DecodeLinearConfig:
    """From sweeps at 64 rows (``benchmarks/decode_linear.py``): 32-column blocks for narrow
    products, 64 for wide or deep ones (and with SwiGLU's two weights). For a vocabulary without a residual (the
    output layer) a persistent launch: one program per SM, each running the fewest tiles of at most 128 columns
    that cover the vocabulary (Llama-3.2-1B's head: 8 tiles of 122 columns) through 128-column ``K`` blocks in one
    four-stage pipeline, so that every program reads the same share of the weight and none refills its pipeline
    between tiles: the product is bound by reading its weight, and a grid launch of many tiles runs in a
    fractional number of waves that leaves SMs idle at its tail (the same bits); otherwise 256 columns of 64-column ``K``
    blocks in a four-stage pipeline. ``K`` split while there are fewer programs than half the SMs (each split keeping at
    least four ``block_k`` iterations).

    Pipeline depth (``stages + 1`` tiles in shared memory, the first loaded before the loop): three stages with
    SwiGLU's two weights (four do not fit the 227 KiB of shared memory); six where one program per
    column block leaves SMs idle (the q/k/v product of a Llama-3.2-1B layer: 96 programs), so that each streams more
    of its weight at once; four otherwise. The timings behind these choices are in ``docs/performance.md``."""
    vocabulary = width >= 65536 and not swiglu
    sms = sm_count(device)
    if vocabulary and plain:  # persistent: the fewest tiles of at most 128 columns a program
        tiles = -(-width // (sms * 128))
        return DecodeLinearConfig(block_n=128, block_k=128, num_stages=4, tiles_per_program=tiles)
    block_n = 256 if vocabulary else 64 if width > 4096 or k >= 4096 else 32
    block_k = 64 if vocabulary else 128
    n_blocks = -(-width // block_n)
    split = 1
    while n_blocks * split < sms // 2 and k // (2 * split) >= 4 * block_k:
        split *= 2
    if vocabulary:
        stages = 4
    elif swiglu:
        stages = 3
    elif split == 1 and n_blocks < sms:
        stages = 6
    else:
        stages = 4
    return DecodeLinearConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=stages)


if triton is not None:

    @triton.jit
    def _decode_linear_kernel(
        X,
        W,
        Bias,
        Y,
        Res,
        SqIn,
        SqOut,
        NormW,
        Scaled,
        Parts,
        Counters,
        M,
        N,
        K,
        K_PER_SPLIT,
        stride_x,
        stride_w,
        stride_r,
        P_IN,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_P: tl.constexpr,
        SPLIT: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        SCALED: tl.constexpr,
        SWIGLU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
        PDL: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_in = rows < M
        col_in = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        # the first weight tile before waiting for the previous kernel (with PDL: while it finishes)
        ks = k_start + tl.arange(0, BLOCK_K)
        k_in = ks < k_end
        w_mask = col_in[:, None] & k_in[None, :]
        w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        w_up = w
        if SWIGLU:
            w_up = tl.load(W + (cols + N)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        if PDL:
            if PREFETCH:
                # the rest of this program's weight slice into the L2 while the previous kernel finishes
                _prefetch_rows(W, cols, col_in, k_start + BLOCK_K, k_end, stride_w, BLOCK_K)
                if SWIGLU:
                    _prefetch_rows(W, cols + N, col_in, k_start + BLOCK_K, k_end, stride_w, BLOCK_K)
            tl.extra.cuda.gdc_wait()
            # the next kernel may launch now: until its own wait it reads only what no kernel of the step writes
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(
            X + rows[:, None] * stride_x + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0
        )
        acc = _dot(acc, x, w, UPCAST)
        if SWIGLU:
            acc_up = _dot(acc_up, x, w_up, UPCAST)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_in = ks < k_end
            x = tl.load(
                X + rows[:, None] * stride_x + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0
            )
            w_mask = col_in[:, None] & k_in[None, :]
            w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
            acc = _dot(acc, x, w, UPCAST)
            if SWIGLU:
                w_up = tl.load(W + (cols + N)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
                acc_up = _dot(acc_up, x, w_up, UPCAST)
        last = True  # whether this program runs the epilogue: every program unless K is split
        if SPLIT > 1:
            # publish this split's partials; the last program of the column block to arrive sums them in order
            width = tl.num_programs(0) * BLOCK_N
            part = Parts + pid_k * (1 + SWIGLU) * BLOCK_M * width + rows[:, None] * width + cols[None, :]
            tl.store(part, acc)
            if SWIGLU:
                tl.store(part + BLOCK_M * width, acc_up)
            tl.debug_barrier()
            arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
            last = arrived == SPLIT - 1
            if last:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    base = Parts + s * (1 + SWIGLU) * BLOCK_M * width + rows[:, None] * width + cols[None, :]
                    acc += tl.load(base, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(base + BLOCK_M * width, cache_modifier=".cg")
                tl.store(Counters + pid_n, 0)
        if last:
            _epilogue(
                acc,
                acc_up,
                pid_n,
                rows,
                cols,
                row_in,
                col_in,
                Bias,
                Y,
                Res,
                SqIn,
                SqOut,
                NormW,
                Scaled,
                M,
                N,
                K,
                stride_r,
                P_IN,
                eps,
                BLOCK_M,
                BLOCK_P,
                NORM,
                RESIDUAL,
                SCALED,
                SWIGLU,
                HAS_BIAS,
            )

    @triton.jit
    def _decode_linear_persistent_kernel(
        X,
        W,
        Bias,
        Y,
        SqIn,
        M,
        N,
        K,
        COLS,
        TILES,
        stride_x,
        stride_w,
        P_IN,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_P: tl.constexpr,
        PROGRAMS: tl.constexpr,
        STAGES: tl.constexpr,
        NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Tiles ``pid, pid + PROGRAMS, ...`` of ``COLS`` columns each (``COLS <= BLOCK_N``; the lanes past
        ``COLS`` masked, so they read nothing), the tiles' ``K`` loops flattened into one software pipeline: a
        program streams its share of the weight without refilling the pipeline between tiles."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        lanes = tl.arange(0, BLOCK_N)
        row_in = rows < M
        if PDL:
            tl.extra.cuda.gdc_wait()
        rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
        if NORM:
            p = tl.arange(0, BLOCK_P)
            parts = tl.load(
                SqIn + p[:, None] * M + rows[None, :], mask=(p[:, None] < P_IN) & row_in[None, :], other=0.0
            )
            rstd = 1.0 / tl.sqrt(tl.sum(parts, axis=0) / K + eps)
        for tile in tl.range(pid, TILES, PROGRAMS, flatten=True, num_stages=STAGES):
            cols = tile * COLS + lanes
            col_in = (lanes < COLS) & (cols < N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_in = ks < K
                x = tl.load(
                    X + rows[:, None] * stride_x + ks[None, :],
                    mask=row_in[:, None] & k_in[None, :],
                    other=0.0,
                )
                w = tl.load(
                    W + cols[:, None] * stride_w + ks[None, :],
                    mask=col_in[:, None] & k_in[None, :],
                    other=0.0,
                )
                acc = _dot(acc, x, w, UPCAST)
            # the grid launch's epilogue (bias, rounding, store) on the row-scaled tile; the norm's scale was read
            # once, before the loop
            _epilogue(
                acc * rstd[:, None],
                acc,
                tile,
                rows,
                cols,
                row_in,
                col_in,
                Bias,
                Y,
                Y,
                SqIn,
                SqIn,
                Y,
                Y,
                M,
                N,
                K,
                0,
                P_IN,
                eps,
                BLOCK_M,
                BLOCK_P,
                NORM=False,
                RESIDUAL=False,
                SCALED=False,
                SWIGLU=False,
                HAS_BIAS=HAS_BIAS,
            )
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _fold_pieces_kernel(
        Table,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DTYPE: tl.constexpr,
        SCALE_DTYPE: tl.constexpr,
        ALIGNED: tl.constexpr,
        COLUMNS: tl.constexpr,
    ):
        """Rows ``[program_id(0) * BLOCK_R, + BLOCK_R)`` of weight ``program_id(1)`` times its scale (rounded to
        ``DTYPE`` first, as :func:`fold_norm_weight` casts it), rounded, written to its rows of the output stack;
        the addresses and sizes from the weight's row of ``Table`` (``COLUMNS`` int64s, laid out as
        ``_PIECE_COLUMNS`` says). A program past the weight's rows does nothing."""
        piece = Table + tl.program_id(1).to(tl.int64) * COLUMNS
        n = tl.load(piece + 3)
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        if first < n:
            k = tl.load(piece + 4)
            out = tl.load(piece).to(tl.pointer_type(DTYPE))
            w = tl.load(piece + 1).to(tl.pointer_type(DTYPE))
            scale_at = tl.load(piece + 2).to(tl.pointer_type(SCALE_DTYPE))
            if ALIGNED:  # every address 16-byte aligned, every width a multiple of 16 (checked by the host)
                k = tl.multiple_of(k, 16)
                out = tl.multiple_of(out, 16)
                w = tl.multiple_of(w, 16)
                scale_at = tl.multiple_of(scale_at, 16)
            rows = first + tl.arange(0, BLOCK_R)
            row_ok = rows < n
            for k0 in range(0, k, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < k
                scale = tl.load(scale_at + cols, mask=col_ok, other=0.0).to(DTYPE).to(tl.float32)
                ok = row_ok[:, None] & col_ok[None, :]
                at = rows[:, None] * k + cols[None, :]
                x = tl.load(w + at, mask=ok, other=0.0)
                tl.store(out + at, (x.to(tl.float32) * scale[None, :]).to(DTYPE), mask=ok)

    @triton.jit
    def _fold_kernel(
        Out,
        Scale,
        W0,
        W1,
        W2,
        W3,
        E0,
        E1,
        E2,
        N,
        K,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM: tl.constexpr,
    ):
        """Rows ``[E_{i-1}, E_i)`` of ``Out`` are weight ``i`` times ``Scale`` (rounded to ``Out``'s dtype first, as
        :func:`fold_norm_weight` casts it), rounded: one ``[BLOCK_R, BLOCK_K]`` tile a program."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        row_ok = rows < N
        dtype = Out.dtype.element_ty
        scale = tl.load(Scale + cols, mask=col_ok, other=0.0).to(dtype).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        # each row reads its own weight (a select, not a sum of masked loads: -0.0 stays -0.0)
        w = tl.load(W0 + rows[:, None] * K + cols[None, :], mask=ok & (rows < E0)[:, None], other=0.0)
        if NUM > 1:
            mine = (rows >= E0) & (rows < E1)
            w1 = tl.load(W1 + (rows - E0)[:, None] * K + cols[None, :], mask=ok & mine[:, None], other=0.0)
            w = tl.where(mine[:, None], w1, w)
        if NUM > 2:
            mine = (rows >= E1) & (rows < E2)
            w2 = tl.load(W2 + (rows - E1)[:, None] * K + cols[None, :], mask=ok & mine[:, None], other=0.0)
            w = tl.where(mine[:, None], w2, w)
        if NUM > 3:
            mine = rows >= E2
            w3 = tl.load(W3 + (rows - E2)[:, None] * K + cols[None, :], mask=ok & mine[:, None], other=0.0)
            w = tl.where(mine[:, None], w3, w)
        y = (w.to(tl.float32) * scale[None, :]).to(dtype)
        tl.store(Out + rows[:, None] * K + cols[None, :], y, mask=ok)

    @triton.jit
    def _prefetch_rows(W, rows, row_in, k_from, k_end, stride_w, BLOCK_K: tl.constexpr):
        """``prefetch.global.L2`` of columns ``k_from .. k_end`` of weight rows ``rows``: one prefetch per 128-byte
        line (64 half-precision entries; one per ``BLOCK_K`` entries for narrower blocks, a line fetched twice);
        rows outside ``row_in`` fetch row 0's lines again (always in the buffer)."""
        LINE: tl.constexpr = min(BLOCK_K, 64)
        line = tl.arange(0, BLOCK_K // LINE) * LINE
        base = W + tl.where(row_in, rows, 0).to(tl.int64)[:, None] * stride_w
        for k0 in range(k_from, k_end, BLOCK_K):
            prefetch_l2(base + tl.minimum(k0 + line, k_end - 1)[None, :])

    @triton.jit
    def _dot(acc, x, w, UPCAST: tl.constexpr):
        """``acc + x w^T``. ``UPCAST`` (the interpreter, whose bf16 products are wrong): in fp32, exact for half
        precision inputs as the tensor cores' products are."""
        if UPCAST:
            return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)

    @triton.jit
    def _epilogue(
        acc,
        acc_up,
        pid_n,
        rows,
        cols,
        row_in,
        col_in,
        Bias,
        Y,
        Res,
        SqIn,
        SqOut,
        NormW,
        Scaled,
        M,
        N,
        K,
        stride_r,
        P_IN,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_P: tl.constexpr,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        SCALED: tl.constexpr,
        SWIGLU: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """The norm's row scale, the bias, SwiGLU or the residual add in the models' roundings; store ``[M, N]``."""
        if NORM:
            p = tl.arange(0, BLOCK_P)
            parts = tl.load(
                SqIn + p[:, None] * M + rows[None, :], mask=(p[:, None] < P_IN) & row_in[None, :], other=0.0
            )
            rstd = 1.0 / tl.sqrt(tl.sum(parts, axis=0) / K + eps)
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(Bias + N + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        dtype = Y.dtype.element_ty
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        else:
            out = acc.to(dtype)
        tile = row_in[:, None] & col_in[None, :]
        if RESIDUAL:
            res = tl.load(Res + rows[:, None] * stride_r + cols[None, :], mask=tile, other=0.0)
            out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
            out32 = tl.where(tile, out.to(tl.float32), 0.0)
            tl.store(SqOut + pid_n * M + rows, tl.sum(out32 * out32, axis=1), mask=row_in)
            if SCALED:
                w = tl.load(NormW + cols, mask=col_in, other=0.0).to(tl.float32)
                tl.store(
                    Scaled + rows[:, None] * N + cols[None, :], (out32 * w[None, :]).to(dtype), mask=tile
                )
        tl.store(Y + rows[:, None] * N + cols[None, :], out, mask=tile)


# launched through the compiled kernel once Triton has compiled it (less host time a launch: a prefill's many)
if triton is not None:
    _fold_launch = DirectLauncher(_fold_kernel)
    _fold_pieces_launch = DirectLauncher(_fold_pieces_kernel)
