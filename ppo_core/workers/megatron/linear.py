"""Column/row-parallel linear layers whose weight gradient is accumulated straight into megatron's fp32
``main_grad`` buffer.

megatron-core's DDP keeps one fp32 gradient buffer per model (``param.main_grad``). Without Apex's
``fused_weight_gradient_mlp_cuda`` its linear layers compute a bf16 weight gradient, which a hook then adds to
``main_grad``: one more write and a mixed-dtype read-modify-write of every weight gradient, every micro-batch.
Here the backward adds ``grad_out^T @ input`` to ``main_grad`` in the matrix product itself (a bf16 product with
an fp32 output and ``beta = 1``, ``torch.addmm(..., out_dtype=torch.float32)``) and follows megatron's protocol
(``weight.grad_added_to_main_grad = True`` and an unwritten placeholder gradient, so that the DDP hook skips its
addition). Where that product is not available (CPU, older PyTorch) the gradient is added with ``add_``: the
result is the same.

Only the layer's own matrix product is replaced (``_forward_impl``); tensor-parallel communication stays with
megatron, and sequence parallelism, deferred embedding gradients and frozen weights fall back to megatron's
implementation.

Shapes: ``input [s, b, D_in]``, ``weight [D_out, D_in]``, output ``[s, b, D_out]``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["MainGradColumnParallelLinear", "MainGradRowParallelLinear", "accumulate_weight_grad"]


@functools.cache
def _fp32_accumulating_mm(device: torch.device) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=float32, out=c)`` works and is right for bf16 ``a, b`` here."""
    if device.type != "cuda":
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 96, device=device, generator=g).bfloat16()
        b = torch.randn(96, 32, device=device, generator=g).bfloat16()
        c = torch.randn(64, 32, device=device, generator=g)
        expected = c + a.float() @ b.float()
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        return bool(torch.allclose(c, expected, rtol=1e-4, atol=1e-3))
    except (RuntimeError, TypeError):
        return False


def accumulate_weight_grad(main_grad: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """``main_grad += grad_out^T @ inputs`` in place, without materialising the product in the inputs' dtype
    where the device can (fp32 output of a bf16/fp16 product).

    Args:
        main_grad: ``[D_out, D_in]`` accumulator (fp32, or the inputs' dtype).
        grad_out: ``[N, D_out]`` gradient of the layer's output.
        inputs: ``[N, D_in]`` the layer's input.

    Example:
        >>> acc = torch.ones(2, 3)
        >>> accumulate_weight_grad(acc, torch.ones(4, 2), torch.ones(4, 3))
        >>> acc
        tensor([[5., 5., 5.],
                [5., 5., 5.]])
    """
    if main_grad.dtype == grad_out.dtype:
        main_grad.addmm_(grad_out.t(), inputs)
    elif main_grad.dtype == torch.float32 and _fp32_accumulating_mm(main_grad.device):
        torch.addmm(main_grad, grad_out.t(), inputs, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(grad_out.t() @ inputs)


class _LinearMainGrad(torch.autograd.Function):
    """``y = x W^T (+ b)``; backward: ``dx`` (all-reduced over ``group`` if asked), ``dW`` into ``W.main_grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, group):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = group
        out = torch.matmul(x, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)
            if ctx.allreduce_dgrad:
                handle = dist.all_reduce(
                    grad_x, group=ctx.group, async_op=True
                )  # overlaps the weight gradient
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            grad_w = g2.t() @ x2
        else:
            accumulate_weight_grad(main_grad, g2, x2)
            grad_w = None
            if hasattr(weight, "grad_added_to_main_grad"):
                # megatron DDP's hook fires on a gradient and skips the addition when this flag is set
                weight.grad_added_to_main_grad = True
                grad_w = torch.empty(weight.shape, dtype=x.dtype, device=x.device)
        grad_b = g2.sum(0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None


def _forward_impl(fallback: Any, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """megatron's ``linear_with_grad_accumulation_and_async_allreduce`` contract, fused where it applies."""
    names = (
        "bias",
        "gradient_accumulation_fusion",
        "allreduce_dgrad",
        "sequence_parallel",
        "grad_output_buffer",
    )
    opts = dict(zip(names, args, strict=False)) | kwargs
    plain = (
        weight.requires_grad
        and not opts.get("sequence_parallel", False)
        and opts.get("grad_output_buffer") is None
        and not opts.get("wgrad_deferral_limit")
    )
    if not plain:
        return fallback(input, weight, *args, **kwargs)
    allreduce_dgrad = bool(opts.get("allreduce_dgrad", False))
    group = opts.get("tp_group")
    if allreduce_dgrad and group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    return _LinearMainGrad.apply(input, weight, opts.get("bias"), allreduce_dgrad, group)


class MainGradColumnParallelLinear(ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` with the weight gradient accumulated into ``main_grad``."""

    def _forward_impl(self, input, weight, *args, **kwargs):  # type: ignore[override]
        return _forward_impl(super()._forward_impl, input, weight, *args, **kwargs)


class MainGradRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` with the weight gradient accumulated into ``main_grad``."""

    def _forward_impl(self, input, weight, *args, **kwargs):  # type: ignore[override]
        return _forward_impl(super()._forward_impl, input, weight, *args, **kwargs)
