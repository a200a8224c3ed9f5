"""``GroupCall``: the Monarch futures of one group call, waited on with a deadline, failing fast.

A call is a list of parts, each a Monarch future for one rank (``call_one``) or for a contiguous range of ranks
(one ``call`` on a slice, answered by a ``ValueMesh`` in rank order). Waiting:

- the deadline is fixed at submit time (``MonarchConfig.call_timeout_s`` unless given); when it passes,
  :class:`~ppo_core_monarch.errors.CallTimeout` names the ranks still pending (host, pid) and the group becomes
  broken;
- the first failing rank in completion order raises at once (``RemoteWorkerError``), without waiting for
  peers that may be stuck in a collective with it (:meth:`GroupCall.settle` then lets the group decide whether
  they are); a lost process raises ``WorkerLost`` naming its host and pid as soon as Monarch's supervision or
  the fault hook reports it;
- the sync :meth:`GroupCall.result` refuses to run inside an event loop; ``await call`` waits on
  ``Future.as_asyncio()`` and never blocks the loop.

Outputs come back aligned with ``plan.calls``, never in completion order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from ppo_core.workers.errors import BlockingWaitInEventLoopError, RankLocation, describe_ranks
from ppo_core.workers.group import PendingCall
from ppo_core_monarch.errors import CallTimeout, MonarchBackendError, WorkerLost, is_supervision_error
from ppo_core_monarch.supervision import MeshWatch
from ppo_core_monarch.transport import Encoded, decode, release
from ppo_core_monarch.worker import Answer, Failed

__all__ = ["CallPart", "GroupCall"]

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class CallPart:
    """One Monarch future: its global ranks and the positions of their outputs in ``plan.calls``."""

    future: Any
    ranks: tuple[int, ...]
    positions: tuple[int, ...]
    mesh: bool
    """True when the future resolves to a ``ValueMesh`` (one value per rank, rank order)."""


class GroupCall(PendingCall):
    """Outputs of one submitted call (see the module docstring).

    Args:
        method: name shown in errors.
        parts: the futures, issued before this object exists.
        n_outputs: ``len(plan.calls)``.
        timeout_s: deadline from now.
        watch: the group's fault watch (a recorded failure raises ``WorkerLost`` at once).
        wait_slice_s: longest blocking wait before the other ranks and the watch are checked again.
        on_broken: called with the error when the call breaks the group (lost worker, deadline).
        locate: ranks named by a Monarch failure report (best effort).
        where: host and pid of ranks, for the errors (unknown ranks may be left out).
        exited: the ranks among those given whose process is known to have exited (checked with the watch; a
            rank there raises ``WorkerLost`` at once, see :class:`~ppo_core_monarch.liveness.LocalExitProbe`).
        forward: shared-memory files of the arguments with the ranks that read them.
        recycle: ``recycle(file, reusable)`` once every rank answered (reusable: all of them unmapped it).
    """

    def __init__(
        self,
        *,
        method: str,
        parts: Sequence[CallPart],
        n_outputs: int,
        timeout_s: float,
        watch: MeshWatch,
        wait_slice_s: float,
        on_broken: Callable[[BaseException], None],
        locate: Callable[[str], tuple[int, ...]],
        where: Callable[[Sequence[int]], Sequence[RankLocation]] = lambda ranks: (),
        exited: Callable[[Sequence[int]], tuple[int, ...]] = lambda ranks: (),
        forward: Sequence[tuple[Encoded, tuple[int, ...]]] = (),
        recycle: Callable[[Encoded, bool], None] = lambda enc, reusable: release(enc),
    ) -> None:
        self.method = method
        self._pending = list(parts)
        self._outputs: list[Any] = [_MISSING] * n_outputs
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._watch = watch
        self._slice = wait_slice_s
        self._forward = list(forward)
        self._recycle = recycle
        self._kept: set[int] = set()
        self._on_broken = on_broken
        self._locate = locate
        self._where = where
        self._exited = exited
        self._error: BaseException | None = None

    # ----- public -----------------------------------------------------------------------------------------
    def result(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank answered (or the first failure); outputs aligned with ``plan.calls``.

        ``timeout`` bounds this wait only (``CallTimeout(broken=False)``); the call's deadline still applies.
        """
        _refuse_inside_loop()
        limit = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
        while self._error is None and self._pending:
            self._check_watch()
            remaining = limit - time.monotonic()
            if remaining <= 0:
                self._timed_out(limit, timeout)
            part = self._pending[0]
            try:
                value = part.future.get(timeout=min(self._slice, remaining))
            except TimeoutError:
                self._sweep()
                continue
            except Exception as exc:
                self._part_failed(part, exc)
            self._pending.remove(part)
            self._absorb(part, value)
        return self._finish()

    def done(self) -> bool:
        """Whether :meth:`result` returns (or raises) without blocking."""
        if self._error is None and self._pending and not _in_loop():
            try:
                self._check_watch()
                self._sweep()
            except Exception:
                return True
        return self._error is not None or not self._pending

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.wait_async().__await__()

    async def wait_async(self, timeout: float | None = None) -> list[Any]:
        """:meth:`result` for asyncio: awaits the Monarch futures, never blocks the running loop."""
        limit = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
        waiting: dict[asyncio.Future, CallPart] = {}
        try:
            while self._error is None and self._pending:
                for part in self._pending:
                    if part not in waiting.values():
                        waiting[asyncio.ensure_future(part.future.as_asyncio())] = part
                self._check_watch()
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    self._timed_out(limit, timeout)
                done, _ = await asyncio.wait(
                    list(waiting), timeout=min(self._slice, remaining), return_when=asyncio.FIRST_COMPLETED
                )
                for fut in done:
                    part = waiting.pop(fut)
                    try:
                        value = fut.result()
                    except Exception as exc:
                        self._part_failed(part, exc)
                    self._pending.remove(part)
                    self._absorb(part, value)
        finally:
            for fut in waiting:
                fut.cancel()  # only the loop-local observer; the Monarch future is not consumed
        return self._finish()

    @property
    def pending_ranks(self) -> tuple[int, ...]:
        """Ranks that have not answered yet."""
        return tuple(sorted(r for part in self._pending for r in part.ranks))

    def settle(self, timeout: float) -> bool:
        """After a failure: take the other ranks' answers for up to ``timeout`` s; True once all came back.

        False at once when the fault watch reports a lost process (those ranks never answer).
        """
        deadline = time.monotonic() + timeout
        while not self.drain():
            if self._watch.event.is_set() or time.monotonic() >= deadline:
                return False
            time.sleep(min(0.01, self._slice))
        return True

    # ----- internals --------------------------------------------------------------------------------------
    def drain(self) -> bool:
        """After an error: take the answers that arrived since (releasing their files); True once all did.

        A call without error that is still pending belongs to its waiter and is left alone (False).
        """
        if self._error is None and self._pending:
            return False
        if _in_loop():
            return not self._pending
        for part in list(self._pending):
            try:
                value = part.future.get(timeout=0)
            except TimeoutError:
                continue
            except Exception:  # the rank is gone; nothing of it to release
                value = None
            self._pending.remove(part)
            for v in list(value.values()) if part.mesh and value is not None else [value]:
                v = v.value if isinstance(v, Answer) else v
                if isinstance(v, Encoded):
                    release(v)
        if not self._pending:
            self.release_all()
        return not self._pending

    def release_all(self) -> None:
        """Hand the argument files back (reusable only after a clean finish where every rank unmapped them)."""
        clean = self._error is None and not self._pending
        for enc, ranks in self._forward:
            self._recycle(enc, clean and not (set(ranks) & self._kept))
        self._forward.clear()

    def _finish(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        self.release_all()
        return list(self._outputs)

    def _raise(self, error: BaseException, *, breaks_group: bool) -> None:
        self._error = error
        if breaks_group:
            self._on_broken(error)
        raise error

    def _check_watch(self) -> None:
        if self._watch.event.is_set():
            report = self._watch.failure or "unknown failure"
            ranks = self._locate(report) or self.pending_ranks
            self._raise(self._lost(ranks, report), breaks_group=True)
        gone = self._exited(self.pending_ranks)
        if gone:
            report = "the process exited while the call was pending (seen on the controller's machine)"
            self._raise(self._lost(gone, report), breaks_group=True)

    def _timed_out(self, limit: float, timeout: float | None) -> None:
        ranks = self.pending_ranks
        if limit >= self._deadline:
            err = CallTimeout(
                method=self.method,
                pending_ranks=ranks,
                timeout_s=self._timeout_s,
                locations=self._where(ranks),
            )
            self._raise(err, breaks_group=True)
        raise CallTimeout(
            method=self.method,
            pending_ranks=ranks,
            timeout_s=float(timeout or 0),
            broken=False,
            locations=self._where(ranks),
        )

    def _lost(self, ranks: Sequence[int], report: str) -> WorkerLost:
        return WorkerLost(ranks=ranks, method=self.method, report=report, locations=self._where(ranks))

    def _part_failed(self, part: CallPart, exc: Exception) -> None:
        if is_supervision_error(exc):
            ranks = self._locate(str(exc)) or part.ranks
            self._raise(self._lost(ranks, str(exc)), breaks_group=True)
        where = describe_ranks(part.ranks, self._where(part.ranks))
        err = MonarchBackendError(f"{self.method}() on {where} failed in Monarch: {exc!r}")
        err.__cause__ = exc
        self._raise(err, breaks_group=True)

    def _sweep(self) -> None:
        """Collect every part that already answered (fail-fast on any error among them)."""
        for part in list(self._pending[1:]):
            try:
                value = part.future.get(timeout=0)
            except TimeoutError:
                continue
            except Exception as exc:
                self._part_failed(part, exc)
            self._pending.remove(part)
            self._absorb(part, value)

    def _absorb(self, part: CallPart, value: Any) -> None:
        values = list(value.values()) if part.mesh else [value]
        if len(values) != len(part.ranks):
            self._raise(
                MonarchBackendError(
                    f"{self.method}(): got {len(values)} answers for ranks {list(part.ranks)}"
                ),
                breaks_group=True,
            )
        failure = None
        for pos, rank, v in zip(part.positions, part.ranks, values, strict=True):
            if isinstance(v, Answer):
                if not v.released:
                    self._kept.add(rank)
                v = v.value
            if isinstance(v, Failed):
                failure = failure or v
            elif isinstance(v, Encoded):
                self._outputs[pos] = v if failure is not None else decode(v, unlink=True)
            else:
                self._outputs[pos] = v
        if failure is not None:
            for v in values:
                v = v.value if isinstance(v, Answer) else v
                if isinstance(v, Encoded):
                    release(v)
            self._raise(failure.to_exception(), breaks_group=False)


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _refuse_inside_loop() -> None:
    if not _in_loop():
        return
    raise BlockingWaitInEventLoopError(
        "a blocking result() was called inside a running event loop; use `await` on the call (or on the "
        "group's *_async methods) instead"
    )
