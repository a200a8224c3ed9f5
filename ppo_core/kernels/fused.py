"""Fused element-wise pieces of a decoder layer: RMSNorm, rotary position embeddings, SwiGLU.

Without Transformer Engine or Apex, megatron-core's local layer spec normalises with ``torch.nn.RMSNorm`` built
in fp32 (megatron expects a ``Float16Module`` wrapper to cast it), so every bf16 activation goes through
PyTorch's composite RMSNorm: about eight fp32 passes forward and more backward. Its rotary embedding is five
bf16 passes over each of ``q`` and ``k``. Here each is one pure function computed in fp32 and rounded once,
which :func:`~ppo_core.kernels.compiled.cuda_compiled` turns into one kernel forward (and one or two
backward) on CUDA; on the CPU the same functions run eagerly.

Shapes: ``x [..., D]`` for the norms and SwiGLU; for the rotary embedding ``q [..., h, d]``, ``k [..., g, d]``
and tables ``cos``/``sin`` that broadcast against both, e.g. ``[s, 1, 1, d]`` for megatron's sequence-first
``[s, b, h, d]`` layout or ``[B, S, 1, d]`` for per-row positions in the batch-first ``[B, S, h, d]`` layout.

Example:
    >>> x = torch.tensor([[3.0, 4.0]])
    >>> rms_norm(x, torch.ones(2), 0.0)  # x / sqrt(mean(x^2)) = x / sqrt(12.5)
    tensor([[0.8485, 1.1314]])
"""

from __future__ import annotations

import torch

from ppo_core.kernels.compiled import cuda_compiled

__all__ = ["add_rms_norm", "apply_rotary", "rms_norm", "rotary_tables", "silu_mul"]


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for half precision and fp32, fp64 for fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32 (fp64 for fp64), returned in
    ``x.dtype``.

    The compiled kernel sees ``x`` as ``[N, D]`` rows, so the leading shape (megatron's ``[s, b, D]`` with
    ``b = 1`` packed or ``b > 1`` padded, a decode step's single token) never forces a recompile of its own.

    Args:
        x: ``[..., D]`` activations (any floating dtype).
        weight: ``[D]`` scale.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x.dtype`` (the rounding of ``torch.nn.RMSNorm`` with an fp32 weight: one, at the end).
    """
    return _rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


@cuda_compiled
def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` of ``x [N, D]``."""
    xf = x.to(_math_dtype(x))
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(xf.dtype)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm of its result in one pass: ``(x + delta, rms_norm(x + delta))``.

    The sum is rounded to ``x.dtype`` first (it is the residual stream the next layer adds to), then
    normalised exactly as :func:`rms_norm` does.

    Args:
        x: ``[..., D]`` residual stream. delta: ``[..., D]`` what the sub-layer adds. weight: ``[D]``.

    Example:
        >>> h, n = add_rms_norm(torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 2.0]]), torch.ones(2), 0.0)
        >>> h, n
        (tensor([[3., 4.]]), tensor([[0.8485, 1.1314]]))
    """
    if x.shape != delta.shape:
        x, delta = torch.broadcast_tensors(x, delta)
    d = x.shape[-1]
    h, normed = _add_rms_norm_rows(x.reshape(-1, d), delta.reshape(-1, d), weight, eps)
    return h.view(x.shape), normed.view(x.shape)


@cuda_compiled
def _add_rms_norm_rows(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` of ``x, delta [N, D]``."""
    h = x + delta
    hf = h.to(_math_dtype(h))
    inv_rms = torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    return h, (hf * inv_rms * weight.to(hf.dtype)).to(x.dtype)


@cuda_compiled
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` by their positions (non-interleaved halves, as Llama / megatron's default).

    ``t -> t cos + rotate_half(t) sin`` with ``rotate_half([t1, t2]) = [-t2, t1]``, in fp32, rounded once.

    Args:
        q: ``[..., h, d]`` queries; k: ``[..., g, d]`` keys (e.g. ``[s, b, h, d]``).
        cos, sin: tables broadcasting against ``q`` and ``k`` (e.g. ``[s, 1, 1, d]`` fp32 from
            :func:`rotary_tables`, or ``[B, S, 1, d]`` for per-row positions).

    Returns:
        ``(q, k)`` rotated, in their input dtypes.
    """

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = t.to(_math_dtype(t))
        t1, t2 = tf.chunk(2, dim=-1)
        return (tf * cos.to(tf.dtype) + torch.cat((-t2, t1), dim=-1) * sin.to(tf.dtype)).to(t.dtype)

    return rotate(q), rotate(k)


def rotary_tables(
    seq_len: int, dim: int, base: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[seq_len, 1, 1, dim]`` (fp32) of positions ``0 .. seq_len - 1``.

    The angle of position ``p`` and channel ``i`` is ``p * base^(-2 (i mod dim/2) / dim)``, megatron-core's and
    Hugging Face's frequencies for ``rotary_percent=1`` without scaling.

    Example:
        >>> cos, sin = rotary_tables(3, 4, 10000.0)
        >>> cos.shape, float(sin[0].abs().max())
        (torch.Size([3, 1, 1, 4]), 0.0)
    """
    if dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, got dim={dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


@cuda_compiled
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating ``silu(gate) * up`` in fp32, rounded once to ``gate.dtype``.

    Args:
        gate, up: ``[..., F]`` projections of the same shape.

    Example:
        >>> silu_mul(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0]))
        tensor([0.0000, 1.4621])
    """
    g = gate.to(_math_dtype(gate))
    return (g * torch.sigmoid(g) * up.to(g.dtype)).to(gate.dtype)
