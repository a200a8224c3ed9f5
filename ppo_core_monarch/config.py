"""``MonarchConfig``: every deadline, the supervision poll, the device and the same-host transport.

Monarch reads its supervision poll period only from ``HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY`` when it is
first imported; ``import ppo_core_monarch`` sets it (to 1 s) before importing Monarch unless the variable is
already set. The other Monarch timeouts are applied with ``monarch.configure`` by :meth:`MonarchConfig.apply`
before any mesh is spawned.

Example:
    >>> cfg = MonarchConfig(call_timeout_s=30.0)
    >>> MonarchConfig.from_dict(cfg.to_dict()) == cfg
    True
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from ppo_core._checks import FieldValueError, check_int, check_positive
from ppo_core._config_base import ConfigBase

__all__ = ["SUPERVISION_POLL_ENV", "MonarchConfig"]

logger = logging.getLogger(__name__)

SUPERVISION_POLL_ENV = "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"


@dataclass(frozen=True, kw_only=True)
class MonarchConfig(ConfigBase):
    """Deadlines (seconds), failure detection and transport of a Monarch worker group."""

    ready_timeout_s: float = 120.0
    """Deadline for processes to start and every worker's ``setup`` (constructor) to return."""
    call_timeout_s: float = 1800.0
    """Default deadline of every call; a call that passes it raises ``CallTimeout`` and breaks the group."""
    shutdown_timeout_s: float = 30.0
    """Deadline for each shutdown step (worker ``close``, proc-mesh stop, host shutdown)."""
    lost_shutdown_timeout_s: float = 5.0
    """Deadline of each shutdown step once a worker was lost (Monarch waits for a dead host until then)."""
    host_lost_timeout_s: float = 30.0
    """Silence after which a host is declared lost (Monarch ``get_proc_state_max_idle``, default 60 s)."""
    failure_grace_s: float = 2.0
    """After a rank raised, how long the other ranks of that call may take to answer before the group is marked
    broken (they may be blocked in a collective with the failed rank); the error is raised by then."""
    wait_slice_s: float = 0.1
    """Longest a blocked wait goes without checking the other ranks and the fault monitor (fail-fast delay)."""
    master_port: int = 0
    """Rendezvous port on rank 0's host; 0 lets the OS pick a free one (no race)."""
    master_port_retries: int = 4
    """With a fixed ``master_port`` that is taken, try this many following ports."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """``"auto"`` (CUDA from the local rank when present, else CPU), ``"cuda"`` or ``"cpu"``."""
    torch_threads: int = 0
    """``torch.set_num_threads`` in every worker; 0: automatic, i.e. ``OMP_NUM_THREADS`` when the worker's
    environment sets it, else the worker's usable cores divided by the workers on its host (at least 1).
    torch's own default (one thread per core in every process) oversubscribes a shared host, and its idle
    threads spin, which slows a data-parallel call several-fold."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every worker, set before its worker is built (e.g. NCCL settings)."""
    shared_memory: bool = True
    """Pass large tensors through ``/dev/shm`` files between processes of one host instead of pickling them."""
    shm_threshold_bytes: int = 1 << 16
    """Tensors at least this large travel through shared memory when the receiver is on the same host."""
    shm_pool_bytes: int = 1 << 30
    """Most bytes of warm shared-memory files kept for reuse between calls (0: a new file per call)."""
    shm_root: str = "/dev/shm"
    """Directory (a tmpfs) for the shared-memory transfer files; one sub-directory per group."""
    log_forwarding: bool = False
    """Stream remote workers' stdout/stderr to the controller (Monarch ``enable_log_forwarding``)."""

    def __post_init__(self) -> None:
        for name in (
            "ready_timeout_s",
            "call_timeout_s",
            "shutdown_timeout_s",
            "lost_shutdown_timeout_s",
            "host_lost_timeout_s",
            "failure_grace_s",
            "wait_slice_s",
        ):
            check_positive(name, getattr(self, name))
        for name in ("torch_threads", "master_port_retries", "shm_pool_bytes", "shm_threshold_bytes"):
            check_int(name, getattr(self, name), 0)
        if not 0 <= self.master_port < 65536:
            raise FieldValueError("master_port", f" must be in [0, 65536), got {self.master_port}")

    def monarch_settings(self) -> dict[str, object]:
        """The ``monarch.configure`` keyword arguments derived from this config."""
        return {
            "get_proc_state_max_idle": _humantime(self.host_lost_timeout_s),
            "enable_log_forwarding": bool(self.log_forwarding),
        }

    def apply(self) -> None:
        """Apply :meth:`monarch_settings` to the process-wide Monarch configuration (before spawning)."""
        from monarch.config import configure

        configure(**self.monarch_settings())
        if SUPERVISION_POLL_ENV not in os.environ:
            logger.warning(
                "%s is unset: Monarch was imported before ppo_core_monarch, so a dead worker is detected only "
                "after Monarch's default 10 s poll",
                SUPERVISION_POLL_ENV,
            )


def _humantime(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"
