"""The element-wise steps of a Llama-family decoder layer with the roundings of the model's own eager forward.

In bf16 a ``transformers`` Llama/Qwen2/Mistral layer normalises in fp32, rounds, then scales by the weight and rounds
again; it rotates with tables in its dtype, rounding each product and the sum; and it rounds SiLU before the gating
product. :mod:`ppo_core.kernels.fused` rounds each of these once (more exact, and what megatron's layers use), which
is not what the model computes. These functions compute what the model computes, so that the rollout engine's
cached decoding draws what the model's own forward would; on CUDA each is one compiled kernel with the explicit
roundings kept (inductor's ``emulate_precision_casts``), on the CPU they run eagerly, bit for bit the model's.
On CUDA the engines normalise and gate through :mod:`~ppo_core_decode.elementwise_launch` instead (the same
roundings in plain Triton launches, which cost the host less a call); these remain the CPU's path, the Qwen3 head
norms' where no rotation kernel takes them, and the references of the kernels' tests.

Each is compiled per shape class of its arguments (``cuda_compiled(by_shape=True)``): the norm alone sees the
residual stream ``[B, S, D]``, the last position ``[B, D]`` and, in Qwen3, the per-head queries and keys
``[B, S, H, d]`` (strided views into the q/k/v product), in prefills and one-token decode steps, more variants
than dynamo compiles for one function before running it eagerly.

Shapes as in :mod:`ppo_core.kernels.fused`.

Example:
    >>> x = torch.tensor([[3.0, 4.0]]).to(torch.bfloat16)
    >>> rms_norm_as_model(x, torch.ones(2, dtype=torch.bfloat16), 0.0)
    tensor([[0.8477, 1.1328]], dtype=torch.bfloat16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ppo_core.kernels.compiled import cuda_compiled

__all__ = [
    "add_rms_norm_as_model",
    "heads_rms_norm_as_model",
    "rms_norm_as_model",
    "rotary_as_model",
    "silu_mul_as_model",
]

_EAGER_ROUNDING = {"emulate_precision_casts": True}


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


@cuda_compiled(options=_EAGER_ROUNDING, by_shape=True)
def rms_norm_as_model(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm of ``x [..., D]`` with its ``[D]`` weight (``LlamaRMSNorm``'s arithmetic)."""
    return _norm(x, weight, eps)


@cuda_compiled(options=_EAGER_ROUNDING, by_shape=True)
def heads_rms_norm_as_model(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_heads: int, eps: float
) -> torch.Tensor:
    """The model's RMSNorm of every head of ``x [..., H + G, d]``: the first ``q_heads`` (``H``) with ``q_weight
    [d]``, the other ``G`` with ``k_weight [d]``, so Qwen3's query and key norms (``q_norm``, ``k_norm``, one
    epsilon) over a view of both run as one kernel; each head the same bits as its own norm."""
    weight = torch.cat([q_weight.expand(q_heads, -1), k_weight.expand(x.shape[-2] - q_heads, -1)])
    return _norm(x, weight, eps)


@cuda_compiled(options=_EAGER_ROUNDING, by_shape=True)
def add_rms_norm_as_model(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add ``x + delta`` (in the model dtype) and the model's RMSNorm of it."""
    h = x + delta
    return h, _norm(h, weight, eps)


@cuda_compiled(options=_EAGER_ROUNDING, by_shape=True)
def rotary_as_model(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t cos + rotate_half(t) sin`` for ``q`` and ``k`` with ``cos``/``sin`` in the model dtype (broadcasting
    against both), each product and the sum rounded."""

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    return rotate(q), rotate(k)


@cuda_compiled(options=_EAGER_ROUNDING, by_shape=True)
def silu_mul_as_model(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with SiLU rounded to the model dtype first."""
    return F.silu(gate) * up
