"""Where the processes run: the local host, already-running worker loops, or a ``monarch.job`` job.

Each source is a :class:`Hosts` (a Monarch ``HostMesh`` plus whether the group that uses it owns it and must
shut it down). :func:`start_worker_loops` starts worker-loop processes on this machine (what
``python -m ppo_core_monarch.serve`` does on every machine of a real cluster), which simulates several hosts.

Example:
    >>> hosts = local_hosts()  # doctest: +SKIP
    >>> loops = start_worker_loops(2)  # doctest: +SKIP
    >>> hosts = attach_hosts(loops.addresses)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hosts", "WorkerLoops", "attach_hosts", "job_hosts", "local_hosts", "start_worker_loops"]

logger = logging.getLogger(__name__)

CA = "trust_all_connections"  # the only certificate mode Monarch 0.7 implements


@dataclass
class Hosts:
    """A Monarch ``HostMesh`` and whether shutting the group down must also shut these hosts down."""

    mesh: Any
    """The ``monarch.actor.HostMesh``."""
    owned: bool
    """True for attached worker loops and jobs the group created; False for ``this_host()``."""
    job: Any = None
    """The ``monarch.job`` job the hosts come from, if any (its lifetime stays with the caller)."""

    def shutdown(self, timeout_s: float) -> None:
        """Shut owned hosts down (their worker loops exit); a no-op for the local host."""
        if not self.owned:
            return
        self.mesh.shutdown().get(timeout=timeout_s)


def local_hosts() -> Hosts:
    """This machine (``this_host()``): a mesh without a host dimension; never shut down by the group."""
    from monarch.actor import this_host

    return Hosts(mesh=this_host(), owned=False)


def attach_hosts(addresses: Sequence[str], *, timeout_s: float = 60.0) -> Hosts:
    """Attach to worker loops already serving at ``addresses`` (``tcp://host:port``); one host each.

    Raises:
        ValueError: no address, or an address without a scheme.
        SpawnError: the worker loops did not answer within ``timeout_s``.
    """
    from monarch.actor import attach_to_workers

    from ppo_core_monarch.errors import SpawnError

    addresses = [str(a) for a in addresses]
    if not addresses:
        raise ValueError("addresses must name at least one worker loop (tcp://host:port)")
    bad = [a for a in addresses if "://" not in a]
    if bad:
        raise ValueError(f"addresses must look like tcp://host:port, got {bad}")
    # the name marks the mesh as ours for the fault hook (its late failures must not exit the controller)
    mesh = attach_to_workers(ca=CA, workers=addresses, name=f"ppo_worker_hosts_{uuid.uuid4().hex[:10]}")
    try:
        mesh.initialized.get(timeout=timeout_s)
    except Exception as exc:
        raise SpawnError(f"worker loops {addresses} did not answer within {timeout_s} s: {exc!r}") from exc
    return Hosts(mesh=mesh, owned=True)


def job_hosts(job: Any, name: str, *, owned: bool = True) -> Hosts:
    """The host mesh ``name`` of a ``monarch.job`` job (``SlurmJob``, ``KubernetesJob``, ``LocalJob``...).

    ``owned``: shut the hosts down with the group (default; pass False when other groups use the same job).
    ``LocalJob`` maps every name to this machine, so its mesh has no host dimension, like :func:`local_hosts`.
    """
    state = job.state()
    mesh = getattr(state, name, None)
    if mesh is None:
        names = sorted(k for k in vars(state) if not k.startswith("_")) if hasattr(state, "__dict__") else []
        raise ValueError(f"job has no host mesh {name!r}; valid names: {names}")
    return Hosts(mesh=mesh, owned=owned, job=job)


@dataclass
class WorkerLoops:
    """Worker-loop processes started on this machine (simulated hosts); :meth:`stop` ends them all."""

    addresses: list[str]
    """``tcp://127.0.0.1:port`` of each loop, in host order."""
    processes: list[subprocess.Popen] = field(default_factory=list)
    """The loop processes (each the leader of its own process group, so children go with it)."""

    @property
    def pids(self) -> list[int]:
        """Process ids of the loops."""
        return [p.pid for p in self.processes]

    def kill(self, index: int) -> None:
        """SIGKILL loop ``index`` and its children (a host lost without warning)."""
        _signal_group(self.processes[index], signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate every loop (SIGTERM, then SIGKILL after ``timeout_s``) together with its children."""
        for p in self.processes:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=timeout_s)
            _signal_group(p, signal.SIGKILL)  # children left behind by a loop that exited first

    def __enter__(self) -> WorkerLoops:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the starting process dies, so simulated hosts never outlive it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the loops end only through WorkerLoops.stop()
        pass


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_worker_loops(
    count: int, *, host: str = "127.0.0.1", ready_timeout_s: float = 30.0, retries: int = 3
) -> WorkerLoops:
    """Start ``count`` worker loops on this machine, each on a free port (a port taken meanwhile is retried).

    Each loop runs ``python -m ppo_core_monarch.serve --address tcp://host:port`` in its own session, so
    :meth:`WorkerLoops.stop` also ends the processes it spawns; started from the main thread, a loop is also sent
    SIGTERM when this process dies (Linux). The loops start together (each takes seconds to import its libraries),
    and ``ready_timeout_s`` bounds each round of starts; a loop that did not start is retried up to ``retries``
    times.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    tmpdir = tempfile.mkdtemp(prefix="ppo_core_monarch-loops-")
    started: dict[int, tuple[str, subprocess.Popen]] = {}
    spawned: list[subprocess.Popen] = []
    pending = dict.fromkeys(range(count), 0)  # loop index -> attempts made
    preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
    try:
        while pending:
            round_: dict[int, tuple[str, str, subprocess.Popen]] = {}
            for index, attempt in pending.items():
                address = f"tcp://{host}:{_free_port(host)}"
                ready = os.path.join(tmpdir, f"loop-{index}-{attempt}")
                command = [
                    sys.executable,
                    "-m",
                    "ppo_core_monarch.serve",
                    "--address",
                    address,
                    "--ready-file",
                    ready,
                ]
                # preexec: one prctl call in the child before exec (PR_SET_PDEATHSIG)
                proc = subprocess.Popen(
                    command,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    preexec_fn=preexec,
                )
                spawned.append(proc)
                round_[index] = (address, ready, proc)
            deadline = time.monotonic() + ready_timeout_s
            failed = {}
            for index, (address, ready, proc) in round_.items():
                if _wait_ready(proc, ready, deadline - time.monotonic()):
                    started[index] = (address, proc)
                    continue
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
                attempt = pending[index] + 1
                if attempt > retries:
                    raise RuntimeError(
                        f"could not start a worker loop on {host} after {retries + 1} attempts"
                    )
                logger.warning("worker loop at %s did not start (attempt %d); retrying", address, attempt)
                failed[index] = attempt
            pending = failed
    except BaseException:
        WorkerLoops(addresses=[], processes=spawned).stop()
        raise
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    ordered = [started[index] for index in range(count)]
    return WorkerLoops(addresses=[a for a, _ in ordered], processes=[p for _, p in ordered])


def _wait_ready(proc: subprocess.Popen, ready_file: str, timeout_s: float) -> bool:
    """Whether the loop wrote its ready file within ``timeout_s`` (False if it exited first: port taken)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(ready_file):
            return True
        if time.monotonic() >= deadline:
            return False
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
