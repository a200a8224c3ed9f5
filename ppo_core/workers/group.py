"""The ``WorkerGroup`` protocol every backend implements, and views of colocated roles.

A backend subclasses :class:`WorkerGroup` and implements three things: ``world_size``, ``_submit`` (run one
method on the ranks of a :class:`~ppo_core.workers.dispatch.DispatchPlan`, returning a :class:`PendingCall`) and
``_shutdown``. Everything else (``call_all``, ``call_rank``, ``dispatch``, their async variants, the
data-parallel layout, binding of ``@register``-ed methods so that a trainer writes
``actor_wg.compute_log_prob(batch)``, colocated role views) is written here once.

Colocation: build the group from ``WorkerSpec(ColocatedWorker, kwargs={"roles": {...}})``; ``group.role("actor")``
returns a view that shares the processes and binds the actor class's methods under their own names.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Generator, Sequence
from typing import Any

from ppo_core.workers.base import ColocatedWorker, Registration, WorkerSpec, registered_methods
from ppo_core.workers.dispatch import (
    Dispatch,
    DispatchMode,
    DispatchPlan,
    DPLayout,
    Execute,
    RankCall,
    WorkerLayout,
    resolve_dispatch,
)

__all__ = [
    "CompletedCall",
    "FuturesCall",
    "GroupResult",
    "PendingCall",
    "WorkerCallError",
    "WorkerGroup",
]


class WorkerCallError(RuntimeError):
    """A worker method raised; names the rank and the method. The original exception is ``__cause__``."""

    def __init__(self, rank: int, method: str, message: str) -> None:
        super().__init__(f"rank {rank} failed in {method!r}: {message}")
        self.rank = rank
        self.method = method


class PendingCall(abc.ABC):
    """Outputs of one submitted call, one per ``plan.calls`` entry, available later."""

    @abc.abstractmethod
    def result(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank answered; outputs in the order of ``plan.calls``. Raises WorkerCallError."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether :meth:`result` would return without blocking."""

    async def wait_async(self) -> list[Any]:
        """Await the outputs without blocking the event loop.

        The default waits in a helper thread; backends with native awaitables (Monarch futures) override it.
        """
        if self.done():
            return self.result()
        return await asyncio.get_running_loop().run_in_executor(None, self.result)


class CompletedCall(PendingCall):
    """A call that already finished (synchronous backends): holds outputs or the error to raise."""

    def __init__(self, outputs: list[Any] | None = None, error: BaseException | None = None) -> None:
        self._outputs = outputs
        self._error = error

    def result(self, timeout: float | None = None) -> list[Any]:
        if self._error is not None:
            raise self._error
        return list(self._outputs or [])

    def done(self) -> bool:
        return True


class FuturesCall(PendingCall):
    """Per-rank ``concurrent.futures.Future`` objects (thread or process pools)."""

    def __init__(self, futures: Sequence[concurrent.futures.Future]) -> None:
        self._futures = list(futures)

    def result(self, timeout: float | None = None) -> list[Any]:
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout)
        if pending:
            raise TimeoutError(
                f"{len(pending)} of {len(self._futures)} ranks did not answer within {timeout} s"
            )
        return [f.result() for f in self._futures]

    def done(self) -> bool:
        return all(f.done() for f in self._futures)


class GroupResult:
    """The collected result of a group call, later: ``.result(timeout)``, ``.done()``, or ``await``.

    Example:
        >>> r = GroupResult(CompletedCall([1, 2]), sum)
        >>> r.result()
        3
    """

    def __init__(self, pending: PendingCall, collect: Callable[[list[Any]], Any]) -> None:
        self._pending = pending
        self._collect = collect

    def result(self, timeout: float | None = None) -> Any:
        """Wait for all ranks and return the collected value."""
        return self._collect(self._pending.result(timeout))

    def done(self) -> bool:
        """Whether :meth:`result` would return without blocking."""
        return self._pending.done()

    @property
    def pending(self) -> PendingCall:
        """The backend's handle on the per-rank outputs."""
        return self._pending

    def __await__(self) -> Generator[Any, None, Any]:
        return self._await().__await__()

    async def _await(self) -> Any:
        # a backend's own wait_async (e.g. awaiting Monarch futures natively) is used when it has one; a pending
        # call without it (duck-typed, not a PendingCall) is waited on in a helper thread
        wait_async = getattr(self._pending, "wait_async", None)
        if wait_async is not None:
            outputs = await wait_async()
        else:
            outputs = await asyncio.get_running_loop().run_in_executor(None, self._pending.result)
        return self._collect(outputs)


def _fixed_mode_names() -> tuple[str, ...]:
    return (Dispatch.ONE_TO_ALL.name, Dispatch.ALL_TO_ALL.name, Dispatch.RANK_ZERO.name)


class WorkerGroup(abc.ABC):
    """A set of ranks running one worker class (or one colocated set of roles), driven by the controller.

    Subclasses implement :attr:`world_size`, :meth:`_submit` and :meth:`_shutdown`; they call
    ``super().__init__(spec)`` after they can serve calls. A backend whose ``_submit`` copies or compacts every
    tensor payload before it leaves the process sets :attr:`compacts_payloads` to receive data-parallel shards
    as views (one copy of the batch fewer).

    Example:
        >>> from ppo_core.backends.local import LocalWorkerGroup
        >>> from ppo_core.workers import Worker
        >>> with LocalWorkerGroup(WorkerSpec(Worker), world_size=2) as wg:
        ...     wg.call_all("worker_layout")[1].dp_rank
        1
    """

    compacts_payloads: bool = False
    """True when ``_submit`` never sends a tensor view as is (it copies payloads into shared memory, or clones
    views before pickling): DP modes then plan row-slice views (``split_for_dp(copy=False)``) instead of
    compact clones. Keep False for backends that pickle or hand over arguments unchanged: a pickled view ships
    its parent's whole storage, and an in-process worker writing to a view would write to the caller's batch."""

    def __init__(self, spec: WorkerSpec, *, method_prefix: str = "") -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec, got {type(spec).__name__}")
        self._spec = spec
        self._prefix = method_prefix
        self._layout: DPLayout | None = None
        self._closed = False
        self._registrations: dict[str, Registration] = registered_methods(spec.cls)
        self._bind_registered_methods()

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks."""

    @abc.abstractmethod
    def _submit(self, method: str, plan: DispatchPlan) -> PendingCall:
        """Start ``method`` (full name, role prefix included) on every rank in ``plan.calls``; don't wait."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Close the workers and release the processes (called at most once)."""

    # ----- calls -----------------------------------------------------------------------------------------
    @property
    def worker_cls(self) -> type:
        """The worker class whose registered methods are bound on this group."""
        return self._spec.cls

    @property
    def layout(self) -> DPLayout:
        """The data-parallel layout reported by the workers (queried once)."""
        if self._layout is None:
            reported = self.call_all("worker_layout")
            if not all(isinstance(w, WorkerLayout) for w in reported):
                raise TypeError("worker_layout() must return a WorkerLayout on every rank")
            self._layout = DPLayout.from_workers(reported)
        return self._layout

    def run_async(
        self,
        method: str,
        mode: DispatchMode | str | tuple[Callable[..., Any], Callable[..., Any]],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        execute: Execute | str = Execute.ALL,
    ) -> GroupResult:
        """Dispatch ``method`` with an explicit mode; returns a handle to the collected result."""
        self._check_open(method)
        mode = resolve_dispatch(mode)
        layout = DPLayout.trivial(self.world_size) if mode.name in _fixed_mode_names() else self.layout
        plan = mode.dispatch(layout, tuple(args), dict(kwargs or {}), copy=not self.compacts_payloads)
        if Execute(execute) is Execute.RANK_ZERO:
            plan = DispatchPlan([c for c in plan.calls if c.rank == 0], plan.context, plan.uniform)
        for call in plan.calls:
            if not 0 <= call.rank < self.world_size:
                raise ValueError(
                    f"dispatch mode {mode.name!r} addressed rank {call.rank} of {self.world_size}"
                )
        pending = self._submit(self._prefix + method, plan)
        return GroupResult(pending, functools.partial(mode.collect, layout, plan))

    def run(
        self,
        method: str,
        mode: Any,
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        execute: Any = "all",
    ) -> Any:
        """Blocking :meth:`run_async`."""
        return self.run_async(method, mode, args, kwargs, execute).result()

    def call_all_async(self, method: str, /, *args: Any, **kwargs: Any) -> GroupResult:
        """Run ``method`` with the same arguments on every rank; result: list in rank order."""
        return self.run_async(method, Dispatch.ONE_TO_ALL, args, kwargs)

    def call_all(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Blocking :meth:`call_all_async`."""
        return self.call_all_async(method, *args, **kwargs).result()

    def call_rank_async(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> GroupResult:
        """Run ``method`` on one rank only; result: that rank's output."""
        self._check_open(method)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        plan = DispatchPlan([RankCall(rank, tuple(args), dict(kwargs))], uniform=True)
        return GroupResult(self._submit(self._prefix + method, plan), lambda outs: outs[0])

    def call_rank(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Blocking :meth:`call_rank_async`."""
        return self.call_rank_async(rank, method, *args, **kwargs).result()

    def dispatch_async(self, method: str, /, *args: Any, **kwargs: Any) -> GroupResult:
        """Run a ``@register``-ed method with its registered dispatch and execute modes."""
        reg = self._registrations.get(method)
        if reg is None:
            raise ValueError(
                f"{self._spec.cls.__name__} has no @register-ed method {method!r}; "
                f"registered: {', '.join(sorted(self._registrations)) or '(none)'}"
            )
        return self.run_async(method, reg.mode, args, kwargs, reg.execute)

    def dispatch(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Blocking :meth:`dispatch_async`."""
        return self.dispatch_async(method, *args, **kwargs).result()

    # ----- colocated roles ---------------------------------------------------------------------------------
    def role(self, name: str) -> WorkerGroup:
        """A view of one role of a colocated group: same processes, that role's methods bound by name.

        Shutting a view down shuts the colocated group down.
        """
        if not issubclass(self._spec.cls, ColocatedWorker):
            raise ValueError(
                f"role() needs a group of ColocatedWorker, this one runs {self._spec.cls.__name__}"
            )
        roles = dict(self._spec.kwargs.get("roles") or (self._spec.args[0] if self._spec.args else {}))
        if name not in roles:
            raise ValueError(f"unknown role {name!r}; valid roles: {', '.join(sorted(roles))}")
        return _RoleView(self, name, roles[name])

    # ----- lifetime -------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran."""
        return self._closed

    def shutdown(self) -> None:
        """Close workers and release processes; later calls are no-ops."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot call {method!r}: the worker group was shut down")

    def _bind_registered_methods(self) -> None:
        for name, reg in self._registrations.items():
            if hasattr(type(self), name) or name in vars(self):
                raise ValueError(
                    f"registered method {name!r} of {self._spec.cls.__name__} clashes with a WorkerGroup "
                    "attribute; rename it"
                )
            setattr(self, name, _BoundMethod(self, name, reg))


class _BoundMethod:
    """``group.<name>(...)``: dispatch a registered method; blocking ones return the value, others a handle."""

    def __init__(self, group: WorkerGroup, name: str, reg: Registration) -> None:
        self._group, self.__name__, self._reg = group, name, reg
        self.__doc__ = getattr(group.worker_cls, name).__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._group.run_async(self.__name__, self._reg.mode, args, kwargs, self._reg.execute)
        return handle.result() if self._reg.blocking else handle

    def __repr__(self) -> str:
        return f"<group method {self.__name__} ({self._reg.mode.name})>"


class _RoleView(WorkerGroup):
    """One role of a colocated group. The processes are shared, so shutting a view down shuts the whole
    colocated group down (every role); that is idempotent, so a trainer may shut down each of its groups."""

    def __init__(self, parent: WorkerGroup, role: str, spec: WorkerSpec) -> None:
        self._parent = parent
        super().__init__(spec, method_prefix=f"{role}.")

    @property
    def world_size(self) -> int:
        return self._parent.world_size

    @property
    def compacts_payloads(self) -> bool:  # type: ignore[override]
        return self._parent.compacts_payloads

    @property
    def closed(self) -> bool:
        return self._parent.closed

    def shutdown(self) -> None:
        self._parent.shutdown()

    def _check_open(self, method: str) -> None:
        self._parent._check_open(method)

    def _submit(self, method: str, plan: DispatchPlan) -> PendingCall:
        return self._parent._submit(method, plan)

    def _shutdown(self) -> None:
        self._parent.shutdown()
