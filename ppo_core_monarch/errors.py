"""Typed failures of a Monarch worker group; every one names its ranks and where they run (host, pid).

Each is a subclass of the backend-neutral error of ``ppo_core.workers.errors``, so a trainer written against
the protocol catches Monarch's failures with the same ``except`` as any other backend's:

=====================  =====================================
``ppo_core_monarch``   ``ppo_core.workers``
=====================  =====================================
``RemoteWorkerError``  ``WorkerCallError``
``WorkerLost``         ``WorkerLostError``
``CallTimeout``        ``CallTimeoutError`` (a ``TimeoutError``)
``GroupBroken``        ``GroupBrokenError``
=====================  =====================================

``is_supervision_error`` holds the only import of a non-re-exported Monarch name (``SupervisionError``), guarded
so that a Monarch upgrade that moves it degrades to matching the type's name.

Example:
    >>> from ppo_core.workers import RankLocation
    >>> err = CallTimeout(method="step", pending_ranks=(1, 3), timeout_s=2.0,
    ...                   locations=[RankLocation(1, "node0", 51), RankLocation(3, "node1", 52)])
    >>> "ranks 1 (host node0, pid 51), 3 (host node1, pid 52)" in str(err)
    True
"""

from __future__ import annotations

from ppo_core.workers.errors import (
    CallTimeoutError,
    GroupBrokenError,
    WorkerCallError,
    WorkerGroupError,
    WorkerLostError,
)

__all__ = [
    "CallTimeout",
    "GroupBroken",
    "MonarchBackendError",
    "RemoteWorkerError",
    "SpawnError",
    "WorkerLost",
    "is_supervision_error",
]

try:  # not re-exported by monarch.actor in 0.7
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError as _SupervisionError
except ImportError:  # pragma: no cover - depends on the Monarch build
    _SupervisionError = None


class MonarchBackendError(WorkerGroupError):
    """Base class of every error raised by ``ppo_core_monarch`` (a ``ppo_core.workers.WorkerGroupError``)."""


class RemoteWorkerError(MonarchBackendError, WorkerCallError):
    """A worker method raised: carries rank, host, pid, method, the original type and the remote traceback.

    ``__cause__`` is the original exception when it could be unpickled on the controller. It is also a
    ``ppo_core.workers.WorkerCallError``, so backend-independent code catches it the same way.
    """

    def __init__(
        self,
        *,
        rank: int,
        host: str,
        pid: int,
        method: str,
        exc_type: str,
        message: str,
        remote_traceback: str,
    ) -> None:
        self.rank, self.host, self.pid, self.method = rank, host, pid, method
        self.exc_type, self.message, self.remote_traceback = exc_type, message, remote_traceback
        self.group_broken, self.unanswered = False, ()
        RuntimeError.__init__(self, self._text())

    def _text(self) -> str:
        return (
            f"rank {self.rank} (host {self.host}, pid {self.pid}) raised {self.exc_type} in {self.method}(): "
            f"{self.message}{self._broken_tail()}\n"
            f"--- remote traceback (rank {self.rank}) ---\n{self.remote_traceback}"
        )

    def __reduce__(self):  # keyword-only __init__ needs an explicit pickle recipe
        return (
            _rebuild_remote_error,
            (
                self.rank,
                self.host,
                self.pid,
                self.method,
                self.exc_type,
                self.message,
                self.remote_traceback,
            ),
        )


def _rebuild_remote_error(rank, host, pid, method, exc_type, message, remote_traceback) -> RemoteWorkerError:
    return RemoteWorkerError(
        rank=rank,
        host=host,
        pid=pid,
        method=method,
        exc_type=exc_type,
        message=message,
        remote_traceback=remote_traceback,
    )


class WorkerLost(MonarchBackendError, WorkerLostError):
    """A worker process or its host is gone (crash, ``os._exit``, SIGKILL, lost host); names host and pid."""


class CallTimeout(MonarchBackendError, CallTimeoutError):
    """A wait passed its deadline; names the ranks that had not answered, their hosts and pids.

    ``broken`` is True when the call's own deadline passed (the group then refuses further calls, since Monarch
    cannot cancel the running work); False when only a shorter ``result(timeout=...)`` expired, and the call
    can be waited on again.
    """


class GroupBroken(MonarchBackendError, GroupBrokenError):
    """The group lost a worker or timed out earlier (``__cause__``) and refuses further calls."""


class SpawnError(MonarchBackendError):
    """Processes or workers did not start within ``ready_timeout_s`` or their set-up failed."""


def is_supervision_error(exc: BaseException) -> bool:
    """True for Monarch's ``SupervisionError`` (a worker process or host is gone)."""
    if _SupervisionError is not None and isinstance(exc, _SupervisionError):
        return True
    return type(exc).__name__ == "SupervisionError"
