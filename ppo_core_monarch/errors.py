"""Typed failures of a Monarch worker group; every one names the ranks (and hosts) it concerns.

``translate`` maps what Monarch raises (``ActorError``, ``SupervisionError``, ``TimeoutError``, spawn
errors) onto this hierarchy. It holds the only import of a non-re-exported Monarch name
(``SupervisionError``), guarded so that a Monarch upgrade that moves it degrades to message matching.

Example:
    >>> err = CallTimeout(method="step", pending_ranks=(1, 3), timeout_s=2.0)
    >>> "ranks [1, 3]" in str(err)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from ppo_core.workers.group import WorkerCallError

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


class MonarchBackendError(RuntimeError):
    """Base class of every error raised by ``ppo_core_monarch``."""


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
        RuntimeError.__init__(
            self,
            f"rank {rank} (host {host}, pid {pid}) raised {exc_type} in {method}(): {message}\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback}",
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


class WorkerLost(MonarchBackendError):
    """A worker process or its host is gone (crash, ``os._exit``, SIGKILL, lost host)."""

    def __init__(self, *, ranks: Sequence[int], method: str, report: str) -> None:
        self.ranks, self.method, self.report = tuple(ranks), method, report
        super().__init__(
            f"worker(s) lost during {method}() on ranks {list(self.ranks)} (the group is now broken; "
            f"shut it down and start a new one): {report}"
        )


class CallTimeout(MonarchBackendError, TimeoutError):
    """A wait passed its deadline; names the ranks that had not answered (their work keeps running).

    ``broken`` is True when the call's own deadline passed (the group then refuses further calls, since Monarch
    cannot cancel the running work); False when only a shorter ``result(timeout=...)`` expired, and the call
    can be waited on again.
    """

    def __init__(
        self, *, method: str, pending_ranks: Sequence[int], timeout_s: float, broken: bool = True
    ) -> None:
        self.method, self.pending_ranks, self.timeout_s = method, tuple(pending_ranks), timeout_s
        self.broken = broken
        tail = (
            "Monarch cannot cancel a running call, so the group is now broken"
            if broken
            else "the call is still running and can be waited on again"
        )
        super().__init__(
            f"{method}() did not finish within {timeout_s:.3g} s on ranks {list(self.pending_ranks)}; {tail}"
        )


class GroupBroken(MonarchBackendError):
    """The group lost a worker or timed out earlier (``__cause__``) and refuses further calls."""


class SpawnError(MonarchBackendError):
    """Processes or workers did not start within ``ready_timeout_s`` or their set-up failed."""


def is_supervision_error(exc: BaseException) -> bool:
    """True for Monarch's ``SupervisionError`` (a worker process or host is gone)."""
    if _SupervisionError is not None and isinstance(exc, _SupervisionError):
        return True
    return type(exc).__name__ == "SupervisionError"
