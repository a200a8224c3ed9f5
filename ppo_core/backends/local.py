"""``LocalWorkerGroup``: the embedded backend, every rank's worker living in the controller process.

With ``world_size > 1`` the ranks are simulated: each worker object is built inside
``worker_context(rank, world_size)`` and calls run one rank after another in rank order. That is enough to test
dispatch, colocation and trainers without processes; real data parallelism needs a process backend (Monarch).

Deadlines: with ``call_timeout_s`` set (the default), calls run on one helper thread of the group, in submission
order, so that the controller can stop waiting for a rank that hangs: the wait raises ``CallTimeoutError`` and the
group is broken (a thread cannot be cancelled; it is a daemon, so it never holds up the interpreter's exit).

Exit: a daemon thread still alive when the interpreter finalizes is stopped where it next needs the GIL; if that is
inside torch (a tensor being freed: C++ code that cannot be unwound) the process aborts with SIGABRT after its work
is done. So the call thread drops each call's function, arguments and result as soon as the call is done (nothing
of a call is freed later on that thread), ``shutdown()`` stops and joins it (and the thread closing the workers of
a broken group), and an ``atexit`` hook stops and joins the call threads of groups never shut down. Only a rank
that hangs past its deadline is left running, as before.
Each call runs with the caller's grad mode and current CUDA device (torch keeps both per thread). A failing rank
fails the call at once and the later ranks of that call do not run. ``call_timeout_s=None`` runs calls inline in
the caller's thread, without a deadline, as a debugger expects.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppo_core.workers.base import WorkerSpec, resolve_method, worker_context
from ppo_core.workers.dispatch import DispatchPlan, RankCall
from ppo_core.workers.errors import RankLocation
from ppo_core.workers.group import (
    DEFAULT_CALL_TIMEOUT_S,
    CompletedCall,
    FuturesCall,
    PendingCall,
    WorkerCallError,
    WorkerGroup,
    _check_seconds,
)

__all__ = ["LocalWorkerGroup"]

logger = logging.getLogger(__name__)


class LocalWorkerGroup(WorkerGroup):
    """Workers in the controller process (ranks simulated when ``world_size > 1``).

    Args:
        spec: the worker class and its constructor arguments (a bare class is accepted).
        world_size: number of simulated ranks.
        call_timeout_s: deadline of every call (see the module docstring); None runs calls inline, unbounded.
        shutdown_timeout_s: longest :meth:`shutdown` waits for outstanding calls and the workers' ``close()``.

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

    def __init__(
        self,
        spec: WorkerSpec | type,
        world_size: int = 1,
        *,
        call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
        shutdown_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(spec, type):
            spec = WorkerSpec(spec)
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec or a class, got {type(spec).__name__}")
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        _check_seconds("call_timeout_s", call_timeout_s, allow_none=True)
        _check_seconds("shutdown_timeout_s", shutdown_timeout_s)
        self._world_size = int(world_size)
        self.call_timeout_s = call_timeout_s
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self._runner = _CallThread() if call_timeout_s is not None else None
        self._location = (socket.gethostname(), os.getpid())
        self.workers: list[Any] = []
        for rank in range(self._world_size):
            with worker_context(rank=rank, world_size=self._world_size, local_rank=rank):
                self.workers.append(spec.build())
        super().__init__(spec)

    @property
    def world_size(self) -> int:
        return self._world_size

    def rank_locations(self, ranks: Sequence[int]) -> tuple[RankLocation, ...]:
        host, pid = self._location
        return tuple(RankLocation(int(r), host, pid) for r in ranks)

    def _submit(self, method: str, plan: DispatchPlan) -> PendingCall:
        # methods are looked up here, so that a wrong name raises in the caller and shutdown cannot race a call
        fns = [resolve_method(self.workers[call.rank], method) for call in plan.calls]
        if self._runner is None:
            outputs = []
            for fn, call in zip(fns, plan.calls, strict=True):
                try:
                    outputs.append(self._run_rank(fn, method, call))
                except WorkerCallError as err:
                    return CompletedCall(error=err)
            return CompletedCall(outputs)
        # what the caller's thread would have run with: torch's grad mode and current CUDA device are per thread
        state = (
            torch.is_grad_enabled(),
            torch.cuda.current_device() if torch.cuda.is_initialized() else None,
        )
        futures = [
            self._runner.submit(functools.partial(self._run_as_caller, state, fn, method, call))
            for fn, call in zip(fns, plan.calls, strict=True)
        ]

        def cancel_the_rest(done: concurrent.futures.Future) -> None:
            # runs on the call thread before it takes the next task: later ranks of a failed call never start
            if not done.cancelled() and done.exception() is not None:
                for f in futures:
                    f.cancel()

        for f in futures:
            f.add_done_callback(cancel_the_rest)
        return FuturesCall(futures, [call.rank for call in plan.calls])

    def _run_as_caller(
        self, state: tuple[bool, int | None], fn: Callable[..., Any], method: str, call: RankCall
    ) -> Any:
        grad, device = state
        if device is not None:
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad):
            return self._run_rank(fn, method, call)

    def _run_rank(self, fn: Callable[..., Any], method: str, call: RankCall) -> Any:
        try:
            return fn(*call.args, **call.kwargs)
        except Exception as exc:
            host, pid = self._location
            err = WorkerCallError(call.rank, method, f"{type(exc).__name__}: {exc}", host=host, pid=pid)
            raise err from exc

    def _shutdown(self) -> None:
        workers = list(self.workers)
        self.workers.clear()
        if self._runner is None:
            _close_all(workers)
            return
        # a healthy group closes its workers after the calls already submitted; a broken one has a rank stuck on
        # the call thread, so its workers are closed beside it; either way the wait is bounded
        close = functools.partial(_close_all, workers)
        del workers  # only the close call holds them now: they are freed with it, on the thread that runs it
        closing = self._runner.submit(close) if self.broken is None else _start_daemon(close)
        del close
        deadline = time.monotonic() + self.shutdown_timeout_s
        try:
            closing.result(timeout=self.shutdown_timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning(
                "the workers of %s did not close within %.3g s; leaving them",
                self.worker_cls.__name__,
                self.shutdown_timeout_s,
            )
        # a broken group's call thread is stuck in the hung rank: it is not waited for
        runner_left = max(0.0, deadline - time.monotonic()) if self.broken is None else 0.0
        closer = getattr(closing, "thread", None)
        if closer is not None:
            closer.join(max(0.0, deadline - time.monotonic()))
        self._runner.stop(timeout=runner_left)


def _close_all(workers: list[Any]) -> None:
    for rank, worker in enumerate(workers):
        close = getattr(worker, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                logger.exception("closing the worker of rank %d failed", rank)


def _run_into(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to the waiter, which re-raises it
        future.set_exception(exc)


def _start_daemon(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """``fn`` run on a new daemon thread; the returned future carries the thread as ``.thread`` (to be joined)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    thread = threading.Thread(target=_run_into, args=(future, fn), name="ppo-local-close", daemon=True)
    future.thread = thread  # type: ignore[attr-defined]
    thread.start()
    return future


_LIVE_THREADS: weakref.WeakSet[_CallThread] = weakref.WeakSet()
"""Call threads not stopped yet: stopped and joined at exit (:func:`_stop_at_exit`)."""

_EXIT_JOIN_S = 10.0
"""Longest the exit hook waits for each call thread (a call still running at exit, e.g. a hung rank)."""


class _CallThread:
    """One daemon thread running submitted functions in order (``ThreadPoolExecutor`` threads are joined at
    exit, so a hung rank would hold up the interpreter). It ends when stopped or after an idle second, and
    starts again on the next submission. It keeps no reference to a finished call (see the module docstring)."""

    _IDLE_S = 1.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        _LIVE_THREADS.add(self)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the group's call thread was stopped")
            self._queue.put((future, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ppo-local-calls", daemon=True)
                self._thread.start()
        return future

    def stop(self, timeout: float | None = None) -> bool:
        """Let the thread finish the calls already submitted, then end; wait for it up to ``timeout`` seconds
        (None: no wait). Returns whether the thread has ended."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
            thread = self._thread
        _LIVE_THREADS.discard(self)
        if thread is None or thread is threading.current_thread():
            return thread is None
        if timeout is not None:
            thread.join(timeout)
        return not thread.is_alive()

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if item is None:
                return
            future, fn = item
            item = None
            # the call (its function, arguments and tensors) is dropped before the caller wakes up, not when the
            # next call arrives or the thread ends, which may be while the interpreter finalizes
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the waiter, which re-raises it
                fn = None
                future.set_exception(exc)
                del exc
            else:
                fn = None
                future.set_result(result)
                result = None
            future = None


@atexit.register
def _stop_at_exit() -> None:
    """Stop and join the call threads of groups never shut down, before the interpreter finalizes."""
    for runner in list(_LIVE_THREADS):
        if not runner.stop(timeout=_EXIT_JOIN_S):
            logger.warning("a local worker call was still running at exit (a hung rank?); leaving it")
