"""Data parallelism for the reference workers: process group set-up, DDP wrapping, global sums.

A worker of a group with ``world_size > 1`` joins (or creates) the default ``torch.distributed`` process group
(gloo on CPU, nccl on CUDA) and wraps its model in ``DistributedDataParallel``, so gradients are averaged over the
ranks. This is what runs under torchrun, Monarch (``setup_torch_elastic_env`` sets ``MASTER_ADDR``/``MASTER_PORT``)
or any launcher that starts one process per rank. With ``world_size == 1`` nothing is initialised.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ppo_core.workers._common import resolve_device

__all__ = ["all_reduce_sum", "init_data_parallel", "maybe_no_sync", "resolve_device", "unwrap", "wrap_ddp"]

logger = logging.getLogger(__name__)


def init_data_parallel(rank: int, world_size: int, device: torch.device) -> bool:
    """Join the default process group when ``world_size > 1``; returns whether data parallelism is on.

    An existing default group is reused (it must have ``world_size`` ranks). Otherwise one is created from the
    ``MASTER_ADDR``/``MASTER_PORT`` environment variables with backend nccl (CUDA) or gloo (CPU).

    Raises:
        ValueError: ``world_size > 1`` in a process without a process group and without ``MASTER_ADDR`` (for
            example several ranks simulated in one process), where gradients could not be averaged.

    Example:
        >>> init_data_parallel(rank=0, world_size=1, device=torch.device("cpu"))
        False
    """
    if world_size == 1:
        return False
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size={world_size} but the default process group has {dist.get_world_size()} ranks"
            )
        return True
    if "MASTER_ADDR" not in os.environ:
        raise ValueError(
            f"world_size={world_size} needs one process per rank and torch.distributed: set MASTER_ADDR and "
            "MASTER_PORT (torchrun, monarch.spmd.setup_torch_elastic_env) or initialise the process group first"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    logger.info("joined process group: rank %d of %d (%s)", rank, world_size, backend)
    return True


def wrap_ddp(model: nn.Module, device: torch.device, enabled: bool) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` when ``enabled`` (rank 0's weights are broadcast)."""
    if not enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or ``model`` itself): use it for inference and state dicts."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def all_reduce_sum(value: torch.Tensor, enabled: bool) -> torch.Tensor:
    """Sum of ``value`` over the data-parallel ranks (a copy; ``value`` itself when ``enabled`` is False)."""
    if not enabled:
        return value
    out = value.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, skip_sync: bool) -> Iterator[None]:
    """DDP's ``no_sync`` (accumulate gradients locally) when ``skip_sync`` and ``model`` is wrapped."""
    if skip_sync and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield
