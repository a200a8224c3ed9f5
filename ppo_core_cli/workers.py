"""The workers the command runs: ppo-core's torch and megatron PPO workers plus two methods.

- ``peak_memory`` reports, per rank, the most memory the process has held since it started (CUDA:
  ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; always: the peak resident set size), so the
  timings JSON of a run can say what a step needs. Colocated roles share a process: each reports the same numbers.
- ``save_weights`` writes this rank's model state dict to ``path/rank_<rank>.pt`` (``{"model": ...}``, the layout
  of a worker checkpoint without the optimizer state), what the export at the end of a run reads: a full
  checkpoint of a 1.5B-parameter actor and critic would write about 40 GB.

The megatron classes are in :mod:`ppo_core_cli._megatron_workers` (they import megatron-core).
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from ppo_core.workers import register
from ppo_core.workers.dispatch import Dispatch
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker

__all__ = ["CommandMethods", "TorchActor", "TorchCritic", "peak_memory_of_process"]


def peak_memory_of_process(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory of this process in GiB: ``{"cuda_allocated", "cuda_reserved"}`` on a CUDA device, and
    ``host_rss`` (the peak resident set size) always."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = kib / 2**20 if sys.platform != "darwin" else kib / 2**30  # kilobytes on Linux, bytes on macOS
    out = {"host_rss": float(rss)}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        out["cuda_allocated"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["cuda_reserved"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


class CommandMethods:
    """Mixin for a PPO worker (it reads ``self.engine`` and ``self.rank``)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def peak_memory(self) -> dict[str, float]:
        """This rank's :func:`peak_memory_of_process` (a list over the ranks, through a group)."""
        return peak_memory_of_process(self.engine.device)  # type: ignore[attr-defined]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_weights(self, path: str) -> None:
        """Write this rank's model weights to ``path/rank_<rank>.pt`` as ``{"model": state_dict}``."""
        os.makedirs(path, exist_ok=True)
        state = {"model": self.engine.module.state_dict()}  # type: ignore[attr-defined]
        torch.save(state, os.path.join(path, f"rank_{self.rank}.pt"))  # type: ignore[attr-defined]


class TorchActor(CommandMethods, TorchActorWorker):
    """:class:`~ppo_core.workers.torch.TorchActorWorker` with ``peak_memory`` and ``save_weights``."""


class TorchCritic(CommandMethods, TorchCriticWorker):
    """:class:`~ppo_core.workers.torch.TorchCriticWorker` with ``peak_memory`` and ``save_weights``."""
