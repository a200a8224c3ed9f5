"""A prefill's element-wise steps as plain Triton launches: RMSNorm (with the residual add before it) and SwiGLU.

Between its products a Llama-family layer normalises the residual stream twice and gates its MLP once. In a
prefill these run on ``[B, S, ...]`` activations, once a layer. As compiled functions
(:mod:`~ppo_core_decode.eager_rounding`, :mod:`ppo_core.kernels.fused`) every call first passes dynamo's guards and
the AOT runtime's wrappers on the host; a launch of a Triton kernel does the same arithmetic for less host time.
That host time matters here: a prefill's host side queues the layers at about the rate the device runs them, and
the engine captures the first decode step's CUDA graph on the host right after
(:class:`~ppo_core_decode.decoding.StaticCacheDecoder`), so whatever host time the prefill saves, the capture
hides behind the device's prefill instead of delaying the first decode step.

Roundings (``model_rounding``):

- ``True``, the Hugging Face models' arithmetic (what :mod:`~ppo_core_decode.eager_rounding` computes): the
  normalised row rounded to the input dtype, then times the weight; SiLU rounded to the input dtype before the
  gating product;
- ``False``, one rounding at the end (``torch.nn.RMSNorm``'s, megatron's fused kernels:
  :func:`ppo_core.kernels.fused.rms_norm`, :func:`~ppo_core.kernels.fused.silu_mul`).

The norm is :func:`~ppo_core_decode.batch_invariant.invariant_rms_norm`'s kernel (one program a row, fp32 sums);
SwiGLU is :func:`silu_mul_launch`'s (one program per row and block of columns), SiLU computed as the decode
products' epilogue computes it (``g / (1 + e^-g)`` in fp32), so a prefill and a decode step gate alike. Sums of
squares run in the kernel's own order: a normalised entry may differ from the compiled function's by one step of
the model dtype. :func:`launches_directly` says where the engines use these (CUDA tensors of a half or single
precision dtype), and :func:`engine_rms_norm` / :func:`engine_silu_mul` are the engines' one call for each step:
the launch where it applies, elsewhere the compiled or eager function of the same rounding (on the CPU, bit for
bit the model's).

Shapes: ``x``, ``delta`` ``[..., D]``, ``weight [D]``; ``gate``, ``up`` ``[..., F]`` (any strides whose rows
flatten to one stride, the last dimension contiguous: the two halves of a gate/up product).

Example:
    >>> gate, up = torch.tensor([[0.0, 2.0]]), torch.tensor([[3.0, 0.5]])
    >>> launches_directly(gate)  # a CPU tensor: the engines keep the compiled / eager functions
    False
"""

from __future__ import annotations

import torch

from ppo_core.kernels import fused
from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2
from ppo_core.kernels.triton_launch import DirectLauncher
from ppo_core.kernels.triton_scan import _interpreting
from ppo_core_decode.batch_invariant import _norm_functions, invariant_rms_norm
from ppo_core_decode.eager_rounding import silu_mul_as_model

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["engine_rms_norm", "engine_silu_mul", "launches_directly", "rms_norm_launch", "silu_mul_launch"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_BLOCK_F = 1024
"""Columns of ``[..., F]`` one SwiGLU program gates (fewer where ``F`` is smaller): eight a thread of four warps."""


def launches_directly(x: torch.Tensor) -> bool:
    """Whether the engines run ``x``'s norms and SwiGLU through this module: a CUDA tensor of a half or single
    precision dtype, with Triton installed."""
    return triton is not None and x.is_cuda and x.dtype in _DTYPES


rms_norm_launch = invariant_rms_norm
"""RMSNorm of each row of ``x [..., D]`` (after the residual add ``x + delta``, rounded to ``x``'s dtype, when
``delta`` is given) with ``weight [D]``, in one launch on CUDA, in either rounding (``model_rounding``): the kernel of
:func:`~ppo_core_decode.batch_invariant.invariant_rms_norm`, which it is."""


def engine_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    model_rounding: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The engines' RMSNorm of ``x [..., D]`` with ``weight [D]`` (after the residual add ``x + delta`` when
    ``delta`` is given): :func:`rms_norm_launch` where :func:`launches_directly` says so and ``delta`` has ``x``'s
    shape and dtype; elsewhere the compiled or eager function of the same rounding
    (:func:`~ppo_core_decode.eager_rounding.rms_norm_as_model` / ``add_rms_norm_as_model`` with ``model_rounding``,
    :func:`ppo_core.kernels.fused.rms_norm` / ``add_rms_norm`` without).

    Returns:
        ``[..., D]`` normalised rows, or ``(x + delta, normalised rows)`` when ``delta`` is given.
    """
    if launches_directly(x) and (delta is None or (delta.shape == x.shape and delta.dtype == x.dtype)):
        return rms_norm_launch(x, weight, eps, delta=delta, model_rounding=model_rounding)
    norm, add_norm = _norm_functions(model_rounding)
    return norm(x, weight, eps) if delta is None else add_norm(x, delta, weight, eps)


def engine_silu_mul(gate: torch.Tensor, up: torch.Tensor, *, model_rounding: bool = True) -> torch.Tensor:
    """The engines' SwiGLU ``silu(gate) * up`` of ``gate``, ``up`` ``[..., F]``: :func:`silu_mul_launch` where
    :func:`launches_directly` says so; elsewhere the compiled or eager function of the same rounding
    (:func:`~ppo_core_decode.eager_rounding.silu_mul_as_model` with ``model_rounding``,
    :func:`ppo_core.kernels.fused.silu_mul` without). Returns ``[..., F]`` in ``gate``'s dtype."""
    if launches_directly(gate):
        return silu_mul_launch(gate, up, model_rounding=model_rounding)
    return (silu_mul_as_model if model_rounding else fused.silu_mul)(gate, up)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Non-empty ``t [..., F]`` as ``[M, F]``: a view where its rows flatten to one stride and its last dimension is
    contiguous, else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def silu_mul_launch(gate: torch.Tensor, up: torch.Tensor, *, model_rounding: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate``, ``up`` ``[..., F]`` of one shape and dtype, in one launch on CUDA (and under
    Triton's interpreter); elsewhere in PyTorch with the same roundings. With ``model_rounding`` SiLU is rounded to
    the dtype before the product (the Hugging Face models'); without, one rounding at the end (megatron's).

    Returns:
        ``[..., F]`` contiguous, ``gate``'s dtype.

    Example:
        >>> silu_mul_launch(torch.tensor([[0.0, 2.0]]), torch.tensor([[3.0, 0.5]]))
        tensor([[0.0000, 0.8808]])
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match: gate is {gate.dtype} {tuple(gate.shape)} on {gate.device}, up is "
            f"{up.dtype} {tuple(up.shape)} on {up.device}"
        )
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension, got scalars")
    if gate.dtype not in _DTYPES:
        raise ValueError(f"gate must be float16, bfloat16 or float32, got {gate.dtype}")
    use_triton = triton is not None and (gate.is_cuda or _interpreting())
    if not use_triton or gate.numel() == 0:
        return _silu_mul_reference(gate, up, model_rounding)
    g, u = _rows(gate), _rows(up)
    m, f = g.shape
    out = torch.empty(m, f, dtype=gate.dtype, device=gate.device)
    block = min(MAX_BLOCK_F, next_power_of_2(f))
    _silu_mul_launch(
        (m, cdiv(f, block)),
        g,
        u,
        out,
        g.stride(0),
        u.stride(0),
        f,
        MODEL_ROUNDING=model_rounding,
        BLOCK_F=block,
        num_warps=4,
    )
    return out.reshape(gate.shape)


def _silu_mul_reference(gate: torch.Tensor, up: torch.Tensor, model_rounding: bool) -> torch.Tensor:
    """The PyTorch form of the kernel's arithmetic (fp32, SiLU as ``g / (1 + e^-g)``)."""
    g, u = gate.float(), up.float()
    act = g / (1.0 + torch.exp(-g))
    if model_rounding:
        act = act.to(gate.dtype).float()
    return (act * u).to(gate.dtype)


if triton is not None:

    @triton.jit  # n_cols specialised: a multiple of 16 lets the masked loads and stores be vectorised
    def _silu_mul_kernel(
        Gate,
        Up,
        Out,
        sg,
        su,
        n_cols,
        MODEL_ROUNDING: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        inside = cols < n_cols
        gate = tl.load(Gate + row * sg + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(Up + row * su + cols, mask=inside, other=0.0).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate))
        if MODEL_ROUNDING:  # SiLU in the model dtype, then the product
            act = act.to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + row * n_cols + cols, (act * up).to(Out.dtype.element_ty), mask=inside)


# launched through the compiled kernel once Triton has compiled it (less host time a launch: a prefill's many)
if triton is not None:
    _silu_mul_launch = DirectLauncher(_silu_mul_kernel)
