"""Process-wide Monarch fault hook: record mesh failures instead of exiting the controller.

Monarch hands every unhandled mesh failure to ``monarch.actor.unhandled_fault_hook``, whose default calls
``sys.exit(1)``, which reaches the controller's main thread as a ``KeyboardInterrupt``. :func:`fault_monitor`
installs (once per process) a hook that records failures of the meshes that ``ppo_core_monarch`` spawned (their
names contain a registered prefix) so that the owning group raises :class:`~ppo_core_monarch.errors.WorkerLost`
and refuses later calls. Failures of any other mesh go to the hook that was installed before, so code that
spawns its own meshes keeps Monarch's behaviour.

Example:
    >>> monitor = fault_monitor()
    >>> watch = monitor.watch("ppo_worker_ab12")
    >>> watch.failure is None
    True
    >>> monitor.unwatch(watch)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["FaultMonitor", "MeshWatch", "fault_monitor"]

logger = logging.getLogger(__name__)


class MeshWatch:
    """Failures of the meshes whose names contain ``prefix``; ``event`` is set at the first one."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.event = threading.Event()
        self.reports: list[str] = []
        self.expected = False

    @property
    def failure(self) -> str | None:
        """The first failure report, or None."""
        return self.reports[0] if self.reports else None


class FaultMonitor:
    """Routes Monarch mesh failures to the :class:`MeshWatch` of their mesh (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[MeshWatch] = []
        self._previous: Any = None
        self._installed = False

    def watch(self, prefix: str) -> MeshWatch:
        """Start recording failures of meshes whose names contain ``prefix``."""
        self._install()
        w = MeshWatch(prefix)
        with self._lock:
            self._watches.append(w)
        return w

    def unwatch(self, w: MeshWatch) -> None:
        """Stop routing to ``w`` (later failures of its meshes are logged and dropped)."""
        with self._lock:
            if w in self._watches:
                self._watches.remove(w)

    def _install(self) -> None:
        with self._lock:
            if self._installed:
                return
            import monarch.actor

            self._previous = monarch.actor.unhandled_fault_hook
            monarch.actor.unhandled_fault_hook = self._hook
            self._installed = True

    def _hook(self, failure: Any) -> None:
        name = str(getattr(failure, "mesh_name", ""))
        try:
            report = failure.report()
        except Exception:  # a report must never turn into an unhandled fault
            report = str(failure)
        with self._lock:
            # Monarch prefixes derived meshes ("proc_mesh_controller_<name>-..."): match the name anywhere
            # Some failures carry no mesh name ("<none>") but name the mesh in the report
            matches = [w for w in self._watches if w.prefix in name or w.prefix in report]
        for w in matches:
            w.reports.append(report)
            w.event.set()
            level = logging.DEBUG if w.expected else logging.ERROR
            logger.log(level, "worker mesh %s failed: %s", name, report)
        if matches:
            return
        if _OWN_PREFIX in name or _OWN_PREFIX in report or name.startswith("logger-"):
            # a mesh of ours that was already shut down (a stop that timed out reports late), or Monarch's
            # per-proc logger mesh, whose failure is always followed by that of the actor mesh on the same proc
            logger.debug("ignoring failure of mesh %s: %s", name, report)
            return
        previous = self._previous
        if previous is not None:
            logger.warning(
                "failure of mesh %r is not ppo_core_monarch's; passing it to the previous hook", name
            )
            previous(failure)


_OWN_PREFIX = "ppo_worker_"
_MONITOR = FaultMonitor()


def fault_monitor() -> FaultMonitor:
    """The process-wide monitor (its hook is installed on the first :meth:`FaultMonitor.watch`)."""
    return _MONITOR
