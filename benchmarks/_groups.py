"""A Monarch worker group on this host or on simulated hosts, for the CPU benchmarks of ``benchmarks/``.

``hosts > 1`` starts that many worker loops on 127.0.0.1 (pickled over TCP, as across a network) and attaches the
group to them; one host spawns the processes here, with shared memory for large results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ppo_core_monarch  # noqa: F401  (before monarch, which reads its supervision poll at import)
from ppo_core.workers import WorkerSpec
from ppo_core_monarch import MonarchConfig, attach_hosts, start_worker_loops
from ppo_core_monarch.group import MonarchWorkerGroup


@contextlib.contextmanager
def monarch_group(spec: WorkerSpec, *, procs: int, hosts: int) -> Iterator[MonarchWorkerGroup]:
    """``procs`` ranks on each of ``hosts`` hosts (simulated when > 1); every process is stopped on exit."""
    loops = start_worker_loops(hosts) if hosts > 1 else None
    try:
        cfg = MonarchConfig(call_timeout_s=600.0, ready_timeout_s=300.0, shared_memory=loops is None)
        where = attach_hosts(loops.addresses) if loops is not None else None
        with MonarchWorkerGroup(spec, procs_per_host=procs, hosts=where, config=cfg) as wg:
            yield wg
    finally:
        if loops is not None:
            loops.stop()
