"""``LocalWorkerGroup``: the embedded backend, every rank's worker living in the controller process.

With ``world_size > 1`` the ranks are simulated: each worker object is built inside
``worker_context(rank, world_size)`` and calls run one rank after another in rank order. That is enough to test
dispatch, colocation and trainers without processes; real data parallelism needs a process backend (Monarch).
"""

from __future__ import annotations

import logging
from typing import Any

from ppo_core.workers.base import WorkerSpec, resolve_method, worker_context
from ppo_core.workers.dispatch import DispatchPlan
from ppo_core.workers.group import CompletedCall, PendingCall, WorkerCallError, WorkerGroup

__all__ = ["LocalWorkerGroup"]

logger = logging.getLogger(__name__)


class LocalWorkerGroup(WorkerGroup):
    """Workers in the controller process (ranks simulated when ``world_size > 1``).

    Args:
        spec: the worker class and its constructor arguments (a bare class is accepted).
        world_size: number of simulated ranks.

    Example:
        >>> from ppo_core.workers import Dispatch, Worker, register
        >>> class Echo(Worker):
        ...     @register(dispatch=Dispatch.ONE_TO_ALL)
        ...     def whoami(self):
        ...         return self.rank
        >>> with LocalWorkerGroup(Echo, world_size=3) as wg:
        ...     wg.whoami()
        [0, 1, 2]
    """

    def __init__(self, spec: WorkerSpec | type, world_size: int = 1) -> None:
        if isinstance(spec, type):
            spec = WorkerSpec(spec)
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec or a class, got {type(spec).__name__}")
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._world_size = int(world_size)
        self.workers: list[Any] = []
        for rank in range(self._world_size):
            with worker_context(rank=rank, world_size=self._world_size, local_rank=rank):
                self.workers.append(spec.build())
        super().__init__(spec)

    @property
    def world_size(self) -> int:
        return self._world_size

    def _submit(self, method: str, plan: DispatchPlan) -> PendingCall:
        outputs = []
        for call in plan.calls:
            fn = resolve_method(self.workers[call.rank], method)
            try:
                outputs.append(fn(*call.args, **call.kwargs))
            except Exception as exc:
                err = WorkerCallError(call.rank, method, f"{type(exc).__name__}: {exc}")
                err.__cause__ = exc
                return CompletedCall(error=err)
        return CompletedCall(outputs)

    def _shutdown(self) -> None:
        for rank, worker in enumerate(self.workers):
            close = getattr(worker, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.exception("closing the worker of rank %d failed", rank)
        self.workers.clear()
