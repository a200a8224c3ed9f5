"""ppo-core on PyTorch Monarch: run worker groups and the PPO trainer from one machine to many hosts.

Importing this package sets ``HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY`` (default 1 s) before Monarch is
imported, because Monarch reads it only once: a dead worker process is then reported within about a second
instead of ten. Import ``ppo_core_monarch`` before ``monarch`` for this to take effect.
"""

from __future__ import annotations

import os as _os
import sys as _sys

if "monarch" not in _sys.modules:
    _os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

from ppo_core_monarch.calls import GroupCall
from ppo_core_monarch.config import MonarchConfig
from ppo_core_monarch.errors import (
    CallTimeout,
    GroupBroken,
    MonarchBackendError,
    RemoteWorkerError,
    SpawnError,
    WorkerLost,
)
from ppo_core_monarch.group import MonarchWorkerGroup
from ppo_core_monarch.launch import (
    Hosts,
    WorkerLoops,
    attach_hosts,
    job_hosts,
    local_hosts,
    start_worker_loops,
)
from ppo_core_monarch.topology import MeshTopology
from ppo_core_monarch.trainer import MonarchPPOTrainer
from ppo_core_monarch.worker import RankInfo

__all__ = [
    "CallTimeout",
    "GroupBroken",
    "GroupCall",
    "Hosts",
    "MeshTopology",
    "MonarchBackendError",
    "MonarchConfig",
    "MonarchPPOTrainer",
    "MonarchWorkerGroup",
    "RankInfo",
    "RemoteWorkerError",
    "SpawnError",
    "WorkerLoops",
    "WorkerLost",
    "attach_hosts",
    "job_hosts",
    "local_hosts",
    "start_worker_loops",
]
