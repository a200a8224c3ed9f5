"""megatron-core's mixed-precision optimizer without Apex, at full speed: gradient norm, clipping, the fp32 ->
bf16 parameter copy and AdamW through PyTorch's multi-tensor kernels.

Without Apex megatron falls back to per-tensor Python loops: its gradient norm converts a list of CUDA scalars
into a tensor (one host sync per parameter, ~100 for a 16-layer model), its clipping and its copy of the fp32
master weights into the bf16 model run ``dst.copy_(src * scale)`` (two passes per tensor), and its AdamW is the
``foreach`` one. Here the norm is one ``torch._foreach_norm`` and one sync, clipping one ``_foreach_mul_``, the
copy one ``_foreach_copy_`` and AdamW the fused CUDA kernel. The results are megatron's: the same gradients
enter the norm (shared and tensor-parallel duplicate parameters counted once, summed over
``get_grad_stats_parallel_group()``), the same coefficient ``max_norm / (norm + 1e-6)`` clips.

Example:
    >>> # opt = get_megatron_optimizer(...); speed_up_megatron_optimizer(opt, device)
    >>> # norm = grad_norm(opt); clip_grads(opt, 1.0, norm); opt.step_with_ready_grads()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["clip_grads", "grad_norm", "speed_up_megatron_optimizer"]


def _chain(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def grad_norm(optimizer: Any) -> float:
    """The global L2 norm of the gradients megatron's ``optimizer.get_grad_norm()`` would measure.

    One fused norm over this rank's gradients, one all-reduce of the squared norm over the optimizer's grad-stats
    group (model-parallel ranks; every rank with the distributed optimizer), one host sync.
    """
    parts = _chain(optimizer)
    groups = [o.get_grad_stats_parallel_group() for o in parts]
    if any(g != groups[0] for g in groups):  # per-optimizer groups: megatron's own combination
        return float(optimizer.get_grad_norm())
    grads = [g for o in parts for g in o.get_main_grads_for_grad_norm()]
    if grads:
        squared = torch.stack(torch._foreach_norm(grads)).double().square().sum()
    else:  # a rank without gradients still joins the all-reduce
        squared = torch.zeros((), dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    group = groups[0]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squared, group=group)
    return float(squared.sqrt())


def clip_grads(optimizer: Any, max_norm: float, total_norm: float) -> None:
    """Scale every gradient the optimizer steps by ``max_norm / (total_norm + 1e-6)`` if that is below 1."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    grads = [p.grad for o in _chain(optimizer) for p in o.get_parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coeff)


def speed_up_megatron_optimizer(optimizer: Any, device: torch.device) -> None:
    """On CUDA: AdamW through its fused kernel and the master-to-model weight copy through ``_foreach_copy_``.

    Changes only ``optimizer`` (its inner ``torch.optim.AdamW`` parameter groups, and the copy method of its
    non-distributed mixed-precision parts), never megatron's modules.
    """
    if device.type != "cuda":
        return
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for opt in _chain(optimizer):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
        if isinstance(opt, Float16OptimizerWithFloat16Params):
            opt._copy_main_params_to_model_params = _foreach_copy_main_to_model(opt)


def _foreach_copy_main_to_model(opt: Any) -> Any:
    def copy() -> None:
        model_data, main_data = opt._get_model_and_main_params_data_float16()
        if model_data:
            torch._foreach_copy_(model_data, main_data)

    return copy
