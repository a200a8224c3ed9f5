"""Megatron parallel state from the backend's ranks: join ``torch.distributed``, build the TP/PP/CP/DP groups.

A backend (Monarch, torchrun, the local one) starts one process per rank and exports the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); :func:`init_megatron_parallel` joins (or reuses)
the default process group (nccl on CUDA, gloo on CPU), calls ``megatron.core.parallel_state.
initialize_model_parallel`` and returns this rank's :class:`MegatronLayout`. Megatron orders ranks
``tp-cp-ep-dp-pp`` (TP fastest, PP slowest), which :func:`megatron_layout` computes without any process group,
so the controller and tests can predict every rank's place.

The rank reported to the dispatch layer (``Worker.set_dp_layout``): a dp group is the TP x PP x CP ranks holding
one model replica; they all receive the same shard and only TP rank 0 of the last pipeline stage (CP rank 0)
is collected, because it holds the outputs (log-probs, values, losses) of the whole replica.

Example:
    >>> megatron_layout(rank=5, world_size=8, parallel=ParallelConfig(tensor_model_parallel_size=2,
    ...                 pipeline_model_parallel_size=2))
    MegatronLayout(rank=5, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, cp_rank=0, cp_size=1, dp_rank=0, dp_size=2)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppo_core.workers.megatron.config import ParallelConfig

__all__ = ["MegatronLayout", "destroy_megatron_parallel", "init_megatron_parallel", "megatron_layout"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronLayout:
    """Where one rank sits in the TP x CP x DP x PP grid."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_collect_rank(self) -> bool:
        """TP rank 0, CP rank 0, last pipeline stage: the rank whose outputs represent its dp group."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the output layer (and computes the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the input embedding."""
        return self.pp_rank == 0


def megatron_layout(rank: int, world_size: int, parallel: ParallelConfig) -> MegatronLayout:
    """This rank's coordinates under megatron's default ``tp-cp-ep-dp-pp`` order (no process group needed).

    Raises:
        ValueError: ``world_size`` not divisible by ``TP * PP * CP``, or ``rank`` outside ``[0, world_size)``.
    """
    dp = parallel.data_parallel_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    pp = parallel.pipeline_model_parallel_size
    rest = rank
    tp_rank, rest = rest % tp, rest // tp
    cp_rank, rest = rest % cp, rest // cp
    dp_rank, pp_rank = rest % dp, rest // dp
    return MegatronLayout(
        rank=rank,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        cp_rank=cp_rank,
        cp_size=cp,
        dp_rank=dp_rank,
        dp_size=dp,
    )


def _join_default_group(rank: int, world_size: int, device: torch.device) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"rank/world_size {rank}/{world_size} disagree with the default process group "
                f"({dist.get_rank()}/{dist.get_world_size()})"
            )
        return
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise ValueError(
            f"world_size={world_size} needs one process per rank and torch.distributed: set MASTER_ADDR and "
            "MASTER_PORT (torchrun, Monarch) or initialise the process group first"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    logger.info("joined process group: rank %d of %d (%s)", rank, world_size, backend)


def init_megatron_parallel(
    parallel: ParallelConfig, *, rank: int, world_size: int, device: torch.device, seed: int = 1234
) -> MegatronLayout:
    """Join the default process group and initialise megatron's model-parallel groups; idempotent.

    Args:
        parallel: TP / PP / CP sizes (validated against ``world_size`` first, with a clear error).
        rank, world_size: this process's global rank and the group's size (from the backend).
        device: the rank's device; CUDA uses nccl and seeds megatron's CUDA RNG tracker, CPU uses gloo.
        seed: seed of the model-parallel RNG (weight initialisation), the same on every rank.

    Returns:
        The rank's :class:`MegatronLayout`, checked against what ``parallel_state`` reports.

    Raises:
        ValueError: sizes that do not divide ``world_size``, or megatron already initialised with other sizes.
    """
    expected = megatron_layout(rank, world_size, parallel)
    _join_default_group(rank, world_size, device)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        want = (
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.context_parallel_size,
        )
        if have != want:
            raise ValueError(
                f"megatron parallel state is already initialised with (TP, PP, CP) = {have}; this worker wants "
                f"{want}. Colocated megatron roles must share one parallel layout."
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
        )
        if device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    got = MegatronLayout(
        rank=rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )
    assert got == expected, f"megatron placed rank {rank} at {got}, expected {expected}"
    return got


def destroy_megatron_parallel() -> None:
    """Tear down megatron's groups and the default process group (a worker's ``close``)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
