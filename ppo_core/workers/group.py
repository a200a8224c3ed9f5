"""The ``WorkerGroup`` protocol every backend implements, and views of colocated roles.

A backend subclasses :class:`WorkerGroup` and implements three things: ``world_size``, ``_submit`` (run one
method on the ranks of a :class:`~ppo_core.workers.dispatch.DispatchPlan`, returning a :class:`PendingCall`) and
``_shutdown``. Everything else (``call_all``, ``call_rank``, ``dispatch``, their async variants, the
data-parallel layout, binding of ``@register``-ed methods so that a trainer writes
``actor_wg.compute_log_prob(batch)``, colocated role views) is written here once.

Colocation: build the group from ``WorkerSpec(ColocatedWorker, kwargs={"roles": {...}})``; ``group.role("actor")``
returns a view that shares the processes and binds the actor class's methods under their own names.

Failures and deadlines, the same for every backend (enforced here, in :class:`GroupResult`):

- every call has a deadline, ``group.call_timeout_s`` from submission (None: none); a wait that passes it raises
  :class:`~ppo_core.workers.errors.CallTimeoutError` naming the ranks still running, and the group is broken;
- a failing rank fails the call at once (:meth:`PendingCall.result` must not wait for its peers, which may be
  blocked in a collective with it); if the peers have not answered ``group.failure_grace_s`` later, the group
  is broken (the error says so: ``WorkerCallError.group_broken``);
- a broken group refuses every later call (:class:`~ppo_core.workers.errors.GroupBrokenError`); ``shutdown()``
  never waits on stuck work.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from typing import Any

from ppo_core.workers.base import KEEP_KWARG, ColocatedWorker, Registration, WorkerSpec, registered_methods
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
from ppo_core.workers.errors import (
    BlockingWaitInEventLoopError,
    CallTimeoutError,
    GroupBrokenError,
    RankLocation,
    WorkerCallError,
    WorkerLostError,
)
from ppo_core.workers.resident import BatchRef, Keep, merge_shard_infos
from ppo_core.workers.traffic import TrafficCounter, payload_nbytes, plan_sent_nbytes

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_FAILURE_GRACE_S",
    "CompletedCall",
    "FuturesCall",
    "GroupResult",
    "PendingCall",
    "WorkerCallError",
    "WorkerGroup",
]

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 1800.0
"""Default deadline of a group call (seconds): generous for a PPO update, finite so that nothing waits forever."""

DEFAULT_FAILURE_GRACE_S = 2.0
"""How long the other ranks of a failed call may take to answer before the group is declared broken."""

_ASYNC_SLACK_S = 1.0

# concurrent.futures and asyncio have their own TimeoutError classes before Python 3.11
_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError)


class PendingCall(abc.ABC):
    """Outputs of one submitted call, one per ``plan.calls`` entry, available later.

    The contract every backend keeps (``docs/backends.md``, "Failures and deadlines"):

    - :meth:`result` returns or raises within ``timeout`` seconds (raising ``TimeoutError``);
    - it raises as soon as one rank has failed, without waiting for the others (``WorkerCallError`` or a
      subclass naming rank, host, pid and method; ``WorkerLostError`` for a dead process);
    - :attr:`pending_ranks` names the ranks that have not answered, and :meth:`settle` waits for them.
    """

    @abc.abstractmethod
    def result(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank answered or one failed; outputs in the order of ``plan.calls``.

        Raises ``TimeoutError`` once ``timeout`` seconds passed, the failed rank's ``WorkerCallError`` at once.
        """

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether :meth:`result` would return without blocking."""

    @property
    def pending_ranks(self) -> tuple[int, ...]:
        """Ranks that have not answered yet (the default knows none)."""
        return ()

    def settle(self, timeout: float) -> bool:
        """After a failure: wait up to ``timeout`` s for the other ranks; True once none is still running.

        The default polls :meth:`done`; backends whose ``done()`` turns True at the first failure override it.
        """
        deadline = time.monotonic() + timeout
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))
        return True

    async def wait_async(self, timeout: float | None = None) -> list[Any]:
        """Await the outputs without blocking the event loop (``timeout`` as in :meth:`result`).

        The default waits in a helper thread; backends with native awaitables (Monarch futures) override it.
        """
        if self.done():
            return self.result()
        return await asyncio.get_running_loop().run_in_executor(None, self.result, timeout)


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
    """Per-rank ``concurrent.futures.Future`` objects (thread or process pools), one per ``plan.calls`` entry.

    The first future to raise fails the call at once (a cancelled future counts as answered); ``ranks`` (default
    ``0..n-1``) name the futures in :attr:`pending_ranks` and in timeouts.
    """

    def __init__(
        self, futures: Sequence[concurrent.futures.Future], ranks: Sequence[int] | None = None
    ) -> None:
        self._futures = list(futures)
        self._ranks = tuple(range(len(self._futures))) if ranks is None else tuple(ranks)
        if len(self._ranks) != len(self._futures):
            raise ValueError(f"got {len(self._ranks)} ranks for {len(self._futures)} futures")

    def result(self, timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = concurrent.futures.wait(
                self._futures, timeout=left, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            failed = [
                f for f in self._futures if f in done and not f.cancelled() and f.exception() is not None
            ]
            if failed:
                raise failed[0].exception()  # the lowest failing rank: the others may wait on it forever
            if not pending:
                return [f.result() for f in self._futures]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{len(pending)} of {len(self._futures)} ranks did not answer within {timeout} s"
                )

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    @property
    def pending_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, f in zip(self._ranks, self._futures, strict=True) if not f.done()))

    def settle(self, timeout: float) -> bool:
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout)
        return not pending


class GroupResult:
    """The collected result of a group call, later: ``.result(timeout)``, ``.done()``, or ``await``.

    Built by a :class:`WorkerGroup` with the call's deadline (``group.call_timeout_s`` from now): waits past it
    raise :class:`~ppo_core.workers.errors.CallTimeoutError` and break the group; a failed rank whose peers do not
    answer within ``group.failure_grace_s`` breaks it too (see the module docstring). Built without a group
    (``GroupResult(pending, collect)``) it only waits.

    Example:
        >>> r = GroupResult(CompletedCall([1, 2]), sum)
        >>> r.result()
        3
    """

    def __init__(
        self,
        pending: PendingCall,
        collect: Callable[[list[Any]], Any],
        *,
        method: str = "call",
        group: WorkerGroup | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._pending = pending
        self._collect = collect
        self._method = method
        self._group = group
        if timeout_s is None and group is not None:
            timeout_s = group.call_timeout_s
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def result(self, timeout: float | None = None) -> Any:
        """Wait for all ranks (at most ``timeout`` s, and never past the call's deadline); the collected value."""
        left, is_deadline = self._wait_limit(timeout)
        try:
            outputs = self._pending.result(left)
        except BaseException as exc:
            error, stuck = self._failure(exc, is_deadline, timeout)
            if stuck:
                self._check_peers(error)
            if error is exc:
                raise
            raise error from exc
        return self._collect(outputs)

    def done(self) -> bool:
        """Whether :meth:`result` would return without blocking."""
        return self._pending.done()

    @property
    def pending(self) -> PendingCall:
        """The backend's handle on the per-rank outputs."""
        return self._pending

    @property
    def deadline(self) -> float | None:
        """The call's deadline on the ``time.monotonic()`` clock (None: no deadline)."""
        return self._deadline

    def __await__(self) -> Generator[Any, None, Any]:
        return self._await().__await__()

    async def _await(self) -> Any:
        # a backend's own wait_async (e.g. awaiting Monarch futures natively) is used when it has one; a pending
        # call without it (duck-typed, not a PendingCall) is waited on in a helper thread
        loop = asyncio.get_running_loop()
        left, is_deadline = self._wait_limit(None)
        wait_async = getattr(self._pending, "wait_async", None)
        try:
            honours_limit = True  # such a wait gets a little slack, so that it raises its own (typed) error
            if wait_async is None:
                waiting = loop.run_in_executor(None, self._pending.result, left)
            else:
                try:
                    waiting = wait_async(timeout=left)
                except TypeError:  # a backend's wait_async without a timeout: only wait_for bounds it
                    waiting, honours_limit = wait_async(), False
            if left is not None:
                waiting = asyncio.wait_for(waiting, left + _ASYNC_SLACK_S if honours_limit else left)
            outputs = await waiting
        except BaseException as exc:
            error, stuck = self._failure(exc, is_deadline, None)
            if stuck:
                await loop.run_in_executor(None, self._check_peers, error)
            if error is exc:
                raise
            raise error from exc
        return self._collect(outputs)

    # ----- failures ---------------------------------------------------------------------------------------
    def _wait_limit(self, timeout: float | None) -> tuple[float | None, bool]:
        """``(seconds to wait, whether that limit is the call's deadline)``."""
        if self._deadline is None:
            return timeout, False
        to_deadline = max(0.0, self._deadline - time.monotonic())
        if timeout is not None and timeout < to_deadline:
            return timeout, False
        return to_deadline, True

    def _failure(
        self, exc: BaseException, is_deadline: bool, timeout: float | None
    ) -> tuple[BaseException, bool]:
        """The error to raise for ``exc``, and whether the other ranks must be checked for being stuck."""
        if not isinstance(exc, Exception) or isinstance(exc, GroupBrokenError | BlockingWaitInEventLoopError):
            return exc, False  # nothing a rank did: the call goes on, the group stays as it is
        group = self._group
        if isinstance(exc, CallTimeoutError):  # the backend's own deadline error (Monarch's CallTimeout)
            if exc.broken and group is not None:
                group._mark_broken(exc)
            return exc, False
        if isinstance(exc, _TIMEOUTS):
            ranks = tuple(getattr(self._pending, "pending_ranks", ()))
            error = CallTimeoutError(
                method=self._method,
                pending_ranks=ranks,
                timeout_s=float(self._timeout_s if is_deadline else (timeout or 0.0)),
                broken=is_deadline,
                locations=group.rank_locations(ranks) if group is not None else (),
            )
            if is_deadline and group is not None:
                group._mark_broken(error)
            return error, False
        if isinstance(exc, WorkerLostError):
            if group is not None:
                exc = group._name_lost_batches(exc)
                group._mark_broken(exc)
            return exc, False
        return exc, group is not None and group.failure_grace_s is not None

    def _check_peers(self, error: BaseException) -> None:
        """A rank failed: if the call's other ranks are still running after the grace period, break the group."""
        group = self._group
        assert group is not None and group.failure_grace_s is not None
        settle = getattr(self._pending, "settle", None)
        settled = settle(group.failure_grace_s) if settle is not None else self._pending.done()
        if settled:
            return
        ranks = tuple(getattr(self._pending, "pending_ranks", ()))
        if isinstance(error, WorkerCallError):
            error.mark_group_broken(group.rank_locations(ranks), group.failure_grace_s)
        group._mark_broken(error)


def _slim(value: Any) -> Any:
    """A :class:`BatchRef` without its key specs (what a rank needs to resolve it), anything else as is."""
    return dataclasses.replace(value, keys=()) if isinstance(value, BatchRef) else value


def _check_seconds(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a positive number of seconds (or an allowed None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        expected = "a positive number of seconds" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _fixed_mode_names() -> tuple[str, ...]:
    return (Dispatch.ONE_TO_ALL.name, Dispatch.ALL_TO_ALL.name, Dispatch.RANK_ZERO.name)


class WorkerGroup(abc.ABC):
    """A set of ranks running one worker class (or one colocated set of roles), driven by the controller.

    Subclasses implement :attr:`world_size`, :meth:`_submit` and :meth:`_shutdown`; they call
    ``super().__init__(spec)`` after they can serve calls. A backend whose ``_submit`` copies or compacts every
    tensor payload before it leaves the process sets :attr:`compacts_payloads` to receive data-parallel shards
    as views (one copy of the batch fewer). Backends set :attr:`call_timeout_s` and :attr:`failure_grace_s`
    (instance attributes, typically from their config) and override :meth:`rank_locations` so that errors say
    where a rank runs.

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

    call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S
    """Deadline of every call, in seconds from its submission (None: none). Waits past it raise
    ``CallTimeoutError`` and break the group, since the backend cannot know whether the work still runs."""

    failure_grace_s: float | None = DEFAULT_FAILURE_GRACE_S
    """After a rank failed, how long its peers in the same call may take to answer before the group is broken
    (they may be blocked in a collective with the failed rank). None: never break on a failure."""

    concurrent_ranks: bool = False
    """Whether every rank runs in its own process, concurrently (collectives between ranks can complete): in-group
    reshards of resident batches then use ``torch.distributed`` point-to-point."""

    _broken: BaseException | None = None
    _broken_error: type[GroupBrokenError] = GroupBrokenError
    """What a call on a broken group raises (backends may name a subclass of their own)."""

    def __init__(self, spec: WorkerSpec, *, method_prefix: str = "") -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec, got {type(spec).__name__}")
        for name in ("call_timeout_s", "failure_grace_s"):
            _check_seconds(name, getattr(self, name), allow_none=True)
        self._spec = spec
        self._prefix = method_prefix
        self._layout: DPLayout | None = None
        self._closed = False
        self._registrations: dict[str, Registration] = registered_methods(spec.cls)
        self._bind_registered_methods()
        self._resident_id = f"group-{uuid.uuid4().hex[:12]}"
        self._resident_refs: dict[str, BatchRef] = {}
        self._traffic = TrafficCounter()

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
        layout, plan = self._plan(method, mode, args, kwargs, execute)
        return self._launch(method, plan, functools.partial(mode.collect, layout, plan))

    def _plan(
        self,
        method: str,
        mode: DispatchMode,
        args: Sequence[Any],
        kwargs: dict | None,
        execute: Execute | str,
    ) -> tuple[DPLayout, DispatchPlan]:
        layout = DPLayout.trivial(self.world_size) if mode.name in _fixed_mode_names() else self.layout
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, BatchRef) and value.placement.group != self.resident_group_id:
                raise ValueError(
                    f"{method}(): resident batch {value.id} lives in {value.placement.group}, not in this group's "
                    f"processes ({self.resident_group_id}); reshard it first (WorkerGroup.reshard)"
                )
        # the ranks resolve a handle by its id and row ranges: its key specs stay on the controller
        args = tuple(_slim(a) for a in args)
        kwargs = {k: _slim(v) for k, v in (kwargs or {}).items()}
        plan = mode.dispatch(layout, tuple(args), dict(kwargs or {}), copy=not self.compacts_payloads)
        if Execute(execute) is Execute.RANK_ZERO:
            plan = DispatchPlan([c for c in plan.calls if c.rank == 0], plan.context, plan.uniform)
        for call in plan.calls:
            if not 0 <= call.rank < self.world_size:
                raise ValueError(
                    f"dispatch mode {mode.name!r} addressed rank {call.rank} of {self.world_size}"
                )
        return layout, plan

    def _launch(self, method: str, plan: DispatchPlan, collect: Callable[[list[Any]], Any]) -> GroupResult:
        full = self._prefix + method
        traffic = self.traffic
        sent = plan_sent_nbytes(plan.calls)
        pending = self._submit(full, plan)
        traffic.record(full, sent=sent)

        def counted(outputs: list[Any]) -> Any:
            traffic.record(full, received=sum(payload_nbytes(o) for o in outputs))
            return collect(outputs)

        return GroupResult(pending, counted, method=full, group=self)

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
        return self._launch(method, plan, lambda outs: outs[0])

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

    # ----- resident batches (docs/resident-batches.md) -------------------------------------------------------
    @property
    def resident_group_id(self) -> str:
        """The id resident batches of these processes carry in their placement (shared by colocated role views)."""
        return self._resident_id

    @property
    def traffic(self) -> TrafficCounter:
        """Bytes through the controller, per call and direction (shared by colocated role views)."""
        return self._traffic

    def dispatch_resident_async(
        self,
        method: str,
        /,
        *args: Any,
        columns: Sequence[str] = (),
        step: int = 0,
        into: BatchRef | None = None,
        **kwargs: Any,
    ) -> GroupResult:
        """Run a ``DP_COMPUTE`` method whose output stays in the workers; resolves to ``(BatchRef, columns)``.

        Each rank keeps its real rows of the output (a ``[rows]`` TensorDict) in its resident store, until the end
        of ``step``; ``into`` adds the output's keys to that resident batch instead (same rows). ``columns``: keys
        of the kept batch to bring back, merged in row order (a ``[B]`` TensorDict; None when not asked for).
        """
        self._check_open(method)
        reg = self._registrations.get(method)
        mode = reg.mode if reg is not None else Dispatch.DP_COMPUTE
        if mode.name != "dp_compute":
            raise ValueError(f"{method}() is dispatched as {mode.name!r}; resident outputs need 'dp_compute'")
        layout, plan = self._plan(method, mode, args, kwargs, Execute.ALL)
        ctx = plan.context
        rows_by_dp = (
            tuple(int(c) for c in ctx.valid_counts)
            if hasattr(ctx, "valid_counts")
            else tuple(hi - lo for lo, hi in ctx.row_ranges)
        )
        if into is not None and (
            into.placement.group != self.resident_group_id or into.rows != sum(rows_by_dp)
        ):
            raise ValueError(
                f"{method}(): into={into.id} must be a resident batch of this group with the call's rows"
            )
        batch_id = into.id if into is not None else f"batch-{uuid.uuid4().hex[:12]}"
        keep_step = into.step if into is not None else int(step)
        keep = Keep(
            id=batch_id,
            step=keep_step,
            rows_by_dp=rows_by_dp,
            columns=tuple(columns),
            update=into is not None,
        )
        plan = DispatchPlan(
            [RankCall(c.rank, c.args, {**c.kwargs, KEEP_KWARG: keep}) for c in plan.calls], ctx, plan.uniform
        )
        if plan.uniform:  # one kwargs object for all ranks keeps the broadcast a broadcast
            shared = plan.calls[0].kwargs
            plan.calls = [RankCall(c.rank, c.args, shared) for c in plan.calls]
        root = self._resident_root()

        def collect(outputs: list[Any]) -> tuple[BatchRef, Any]:
            by_rank = {call.rank: out for call, out in zip(plan.calls, outputs, strict=True)}
            infos = [by_rank[r] for r in layout.collect_ranks()]
            ref, cols = merge_shard_infos(batch_id, self.resident_group_id, layout, keep_step, infos)
            root._resident_refs[ref.id] = ref
            return ref, cols

        return self._launch(method, plan, collect)

    def dispatch_resident(self, method: str, /, *args: Any, **kwargs: Any) -> tuple[BatchRef, Any]:
        """Blocking :meth:`dispatch_resident_async`."""
        return self.dispatch_resident_async(method, *args, **kwargs).result()

    def fetch_resident(self, ref: BatchRef, keys: Sequence[str]) -> Any:
        """Bring exactly ``keys`` of a resident batch to the controller: a ``[B]`` TensorDict in row order."""
        for k in keys:
            ref.spec(k)
        return self.run("resident_select", Dispatch.DP_COMPUTE, (ref, tuple(keys)))

    def gather_resident(self, method: str, ref: BatchRef, /, *args: Any) -> list[Any]:
        """Run ``method(ref, *args)`` on every rank (each resolves its rows of ``ref``) and return what the collect
        ranks answer, in dp order: per-rank partials (moments, metric parts) the controller combines."""
        outputs = self.call_all(method, ref, *args)
        return [outputs[r] for r in ref.placement.layout.collect_ranks()]

    def scatter_resident(self, ref: BatchRef, data: Any) -> BatchRef:
        """Add the columns of ``data`` (a ``[B]`` TensorDict, e.g. advantages) to a resident batch, each rank
        receiving its rows only; returns the updated handle."""
        return self.dispatch_resident("resident_update", ref, data, into=ref)[0]

    def reshard(
        self,
        ref: BatchRef,
        source: WorkerGroup | None = None,
        *,
        keys: Sequence[str] | None = None,
        executor: str = "auto",
        host: str | None = None,
        timeout_s: float = 300.0,
    ) -> BatchRef:
        """Lay a resident batch of ``source`` (default: this group) out for this group's dp layout, worker to worker.

        The controller computes the plan (:func:`~ppo_core.workers.reshard.plan_reshard`) and sends it and the
        handle only. ``executor``: ``"p2p"`` (``torch.distributed`` inside one group whose ranks run concurrently),
        ``"tcp"`` (sockets; across groups, or any backend), ``"auto"`` (p2p where possible). ``keys``: the keys to
        move (default: all). The new batch lives until the end of the same step as ``ref``; ``ref`` stays held.
        ``timeout_s`` bounds every wait of the transfer.
        """
        from ppo_core.workers.reshard import plan_reshard

        source = self if source is None else source
        if ref.placement.group != source.resident_group_id:
            raise ValueError(f"reshard(): resident batch {ref.id} is not held by the source group")
        if executor not in ("auto", "p2p", "tcp"):
            raise ValueError(f"executor must be 'auto', 'p2p' or 'tcp', got {executor!r}")
        specs = ref.keys if keys is None else tuple((k, ref.spec(k)) for k in keys)
        layout = self.layout
        plan = plan_reshard(ref.placement, layout, group=self.resident_group_id)
        new_id = f"batch-{uuid.uuid4().hex[:12]}"
        p2p = executor == "p2p" or (executor == "auto" and plan.same_group and self.concurrent_ranks)
        if p2p:
            if not plan.same_group:
                raise ValueError("executor='p2p' moves rows inside one group; use 'tcp' across groups")
            if not self.concurrent_ranks:
                raise ValueError(
                    f"executor='p2p' needs ranks that run concurrently; {type(self).__name__} runs them one after "
                    "another: use 'tcp'"
                )
            infos = self.call_all("resident_reshard_p2p", plan, ref.id, specs, new_id, ref.step, timeout_s)
        else:
            addresses = self.call_all("resident_listen", plan, specs, new_id, timeout_s, host)
            sending = source.call_all_async("resident_send", plan, ref.id, specs, addresses, timeout_s)
            finishing = self.call_all_async("resident_finish", ref.id, new_id, ref.step)
            sending.result()
            infos = finishing.result()
        collected = [infos[r] for r in layout.collect_ranks()]
        new, _ = merge_shard_infos(new_id, self.resident_group_id, layout, ref.step, collected)
        self._resident_root()._resident_refs[new.id] = new
        return new

    def drop_resident(self, *refs: BatchRef) -> None:
        """Forget resident batches now, on every rank (before their step ends)."""
        ids = tuple(r.id for r in refs)
        self.call_all("resident_drop", ids)
        for i in ids:
            self._resident_root()._resident_refs.pop(i, None)

    def end_resident_step(self, step: int) -> None:
        """Drop every resident batch made at ``step`` or earlier, on every rank (the end of a training step)."""
        self.call_all("resident_end_step", int(step))
        refs = self._resident_root()._resident_refs
        for i in [i for i, r in refs.items() if r.step <= step]:
            del refs[i]

    def resident_refs(self) -> tuple[BatchRef, ...]:
        """The resident batches this controller knows the group holds."""
        return tuple(self._resident_root()._resident_refs.values())

    def _resident_root(self) -> WorkerGroup:
        return self

    def _name_lost_batches(self, error: WorkerLostError) -> WorkerLostError:
        """``error`` with the resident batches the lost ranks held named in its report (``error.batches``)."""
        held = []
        for ref in self.resident_refs():
            for rank in error.ranks:
                if 0 <= rank < ref.placement.layout.world_size:
                    lo, hi = ref.placement.rows_of_rank(rank)
                    held.append(f"{ref.id} (rows {lo}:{hi} of {ref.rows}, on rank {rank})")
        if not held or getattr(error, "batches", ()):
            return error
        kwargs = error._keywords()
        kwargs["report"] = f"{error.report}; the lost ranks held resident batch(es) {', '.join(held)}"
        named = type(error)(**kwargs)
        named.batches = tuple(dict.fromkeys(h.split(" ")[0] for h in held))
        return named

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

    # ----- failures -------------------------------------------------------------------------------------
    @property
    def broken(self) -> BaseException | None:
        """The error that broke the group (a lost worker, a passed deadline, ranks stuck after a failure), or None."""
        return self._broken

    def rank_locations(self, ranks: Sequence[int]) -> tuple[RankLocation, ...]:
        """Where ``ranks`` run (host, pid), for error messages; backends override it (default: unknown)."""
        return tuple(RankLocation(int(r)) for r in ranks)

    def _mark_broken(self, error: BaseException) -> None:
        """Refuse every later call (first error wins); shutdown must then not wait on the stuck work."""
        if self._broken is None:
            self._broken = error
            logger.error("%s is broken: %s", type(self).__name__, error)

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
        if self._broken is not None:
            raise self._broken_error(
                f"cannot call {method}(): the group is broken ({self._broken})"
            ) from self._broken

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

    @property
    def call_timeout_s(self) -> float | None:  # type: ignore[override]
        return self._parent.call_timeout_s

    @property
    def failure_grace_s(self) -> float | None:  # type: ignore[override]
        return self._parent.failure_grace_s

    @property
    def broken(self) -> BaseException | None:
        return self._parent.broken

    def rank_locations(self, ranks: Sequence[int]) -> tuple[RankLocation, ...]:
        return self._parent.rank_locations(ranks)

    @property
    def resident_group_id(self) -> str:
        return self._parent.resident_group_id

    @property
    def traffic(self) -> TrafficCounter:
        return self._parent.traffic

    @property
    def concurrent_ranks(self) -> bool:  # type: ignore[override]
        return self._parent.concurrent_ranks

    def _resident_root(self) -> WorkerGroup:
        return self._parent._resident_root()

    def _mark_broken(self, error: BaseException) -> None:
        self._parent._mark_broken(error)

    def shutdown(self) -> None:
        self._parent.shutdown()

    def _check_open(self, method: str) -> None:
        self._parent._check_open(method)

    def _submit(self, method: str, plan: DispatchPlan) -> PendingCall:
        return self._parent._submit(method, plan)

    def _shutdown(self) -> None:
        self._parent.shutdown()
