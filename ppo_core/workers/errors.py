"""Typed failures of a worker group call, the same for every backend, each naming where the ranks run.

A trainer catches these whatever runs its workers (local, Monarch, Ray...); backends raise them or subclass them
(``ppo_core_monarch.RemoteWorkerError`` is a :class:`WorkerCallError`, ``WorkerLost`` a :class:`WorkerLostError`,
``CallTimeout`` a :class:`CallTimeoutError`, ``GroupBroken`` a :class:`GroupBrokenError`), so one ``except``
works for all of them:

- :class:`WorkerCallError`: a worker method raised on a rank (rank, host, pid, method, remote traceback);
- :class:`WorkerLostError`: a rank's process or host is gone;
- :class:`CallTimeoutError`: a call passed its deadline (``broken``) or a shorter wait expired (not broken);
- :class:`GroupBrokenError`: the group failed earlier (``__cause__``) and refuses further calls;
- :class:`BlockingWaitInEventLoopError`: a blocking ``result()`` was asked for inside a running event loop (a usage
  error, refused before waiting: it neither fails a rank nor breaks the group; ``await`` the call instead).

Every error names its ranks with a :class:`RankLocation` (rank, host, pid): mesh coordinates or rank numbers
alone do not tell an operator which machine and process to look at.

Example:
    >>> err = CallTimeoutError(method="update_actor", pending_ranks=(1,), timeout_s=60.0,
    ...                        locations=(RankLocation(1, "node3", 4242),))
    >>> print(err)
    update_actor() did not finish within 60 s on rank 1 (host node3, pid 4242); the group is now broken
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "BlockingWaitInEventLoopError",
    "CallTimeoutError",
    "GroupBrokenError",
    "RankLocation",
    "WorkerCallError",
    "WorkerGroupError",
    "WorkerLostError",
    "describe_ranks",
]


@dataclasses.dataclass(frozen=True)
class RankLocation:
    """Where one rank runs: its process's host name and pid (None where the backend does not know them).

    Example:
        >>> str(RankLocation(3, "node1", 811)), str(RankLocation(0))
        ('rank 3 (host node1, pid 811)', 'rank 0 (host ?, pid ?)')
    """

    rank: int
    host: str | None = None
    pid: int | None = None

    @property
    def place(self) -> str:
        """``"host <name>, pid <pid>"`` (``?`` for what is unknown)."""
        host = self.host if self.host is not None else "?"
        pid = self.pid if self.pid is not None else "?"
        return f"host {host}, pid {pid}"

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.place})"


def describe_ranks(ranks: Sequence[int], locations: Sequence[RankLocation] = ()) -> str:
    """``"rank 1 (host h, pid 7)"`` / ``"ranks 0 (host h, pid 6), 1 (host h, pid 7)"``; unknown places as ``?``.

    Example:
        >>> describe_ranks([0, 1], [RankLocation(1, "h", 7)])
        'ranks 0 (host ?, pid ?), 1 (host h, pid 7)'
        >>> describe_ranks([])
        'no rank'
    """
    places = _locations_for(ranks, locations)
    if not places:
        return "no rank"
    if len(places) == 1:
        return str(places[0])
    return "ranks " + ", ".join(f"{loc.rank} ({loc.place})" for loc in places)


def _locations_for(ranks: Sequence[int], locations: Sequence[RankLocation]) -> tuple[RankLocation, ...]:
    where = {loc.rank: loc for loc in locations}
    return tuple(where.get(r, RankLocation(r)) for r in ranks)


class WorkerGroupError(RuntimeError):
    """Base class of every failure of a worker group call, whatever the backend."""


class WorkerCallError(WorkerGroupError):
    """A worker method raised on one rank. The original exception is ``__cause__`` where it could be kept.

    Args:
        rank: the failing rank.
        method: the method called (``"actor.update_actor"`` for a colocated role).
        message: ``"<ExceptionType>: <message>"`` of the original exception.
        host, pid: where the rank runs (None if unknown).
        remote_traceback: the traceback formatted on the rank, for backends that cannot chain the original
            exception as ``__cause__`` across processes ("" when ``__cause__`` carries it); shown in the message.

    ``group_broken`` becomes True when other ranks of the same call had not answered within the group's
    ``failure_grace_s`` of this failure (they may be blocked in a collective with the failed rank forever);
    ``unanswered`` then names them, and the group refuses further calls.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        message: str,
        *,
        host: str | None = None,
        pid: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        self.rank, self.method, self.message = rank, method, message
        self.host, self.pid, self.remote_traceback = host, pid, remote_traceback
        self.group_broken = False
        self.unanswered: tuple[RankLocation, ...] = ()
        super().__init__(self._text())

    @property
    def location(self) -> RankLocation:
        """Where the failing rank runs."""
        return RankLocation(self.rank, self.host, self.pid)

    def mark_group_broken(self, unanswered: Sequence[RankLocation], grace_s: float) -> None:
        """Record that ``unanswered`` ranks did not answer within ``grace_s`` of this failure (the group broke)."""
        self.group_broken = True
        self.unanswered = tuple(unanswered)
        self._grace_s = grace_s
        self.args = (self._text(),)

    def _text(self) -> str:
        text = f"rank {self.rank} failed in {self.method!r}: {self.message}"
        if self.host is not None or self.pid is not None:
            text += f" (on {self.location.place})"
        text += self._broken_tail()
        if self.remote_traceback:
            text += f"\n--- remote traceback (rank {self.rank}) ---\n{self.remote_traceback}"
        return text

    def _broken_tail(self) -> str:
        if not self.group_broken:
            return ""
        ranks = [loc.rank for loc in self.unanswered]
        return (
            f"; {describe_ranks(ranks, self.unanswered)} had not answered {self._grace_s:.3g} s later (they may "
            "be blocked in a collective with it): the group is now broken"
        )

    def __reduce__(self):  # keyword arguments need an explicit pickle recipe (process backends ship errors)
        return (
            _rebuild_call_error,
            (self.rank, self.method, self.message, self.host, self.pid, self.remote_traceback),
        )


def _rebuild_call_error(rank, method, message, host, pid, remote_traceback) -> WorkerCallError:
    return WorkerCallError(rank, method, message, host=host, pid=pid, remote_traceback=remote_traceback)


class WorkerLostError(WorkerGroupError):
    """Worker processes or their hosts are gone (crash, kill, lost host); the group is broken.

    Args:
        ranks: the lost ranks (or, when the backend cannot tell, the ranks that had not answered).
        method: the call that noticed.
        report: the backend's failure report.
        locations: where those ranks ran.
    """

    def __init__(
        self, *, ranks: Sequence[int], method: str, report: str, locations: Sequence[RankLocation] = ()
    ) -> None:
        self.ranks, self.method, self.report = tuple(ranks), method, report
        self.locations = _locations_for(self.ranks, locations)
        self.batches: tuple[str, ...] = ()
        """Ids of the resident batches the lost ranks held (set by the group; their rows are gone)."""
        super().__init__(
            f"worker(s) lost during {method}(): {describe_ranks(self.ranks, self.locations)} (the group is now "
            f"broken; shut it down and start a new one): {report}"
        )

    def __reduce__(self):
        return (_rebuild_keywords, (type(self), self._keywords()))

    def _keywords(self) -> dict:
        return {
            "ranks": self.ranks,
            "method": self.method,
            "report": self.report,
            "locations": self.locations,
        }


class CallTimeoutError(WorkerGroupError, TimeoutError):
    """A wait passed its deadline; names the ranks that had not answered and where they run.

    ``broken`` is True when the call's own deadline passed: its work may still be running (or blocked in a
    collective), so the group refuses further calls. It is False when only a shorter ``result(timeout=...)``
    expired: the call keeps running and can be waited on again.
    """

    def __init__(
        self,
        *,
        method: str,
        pending_ranks: Sequence[int],
        timeout_s: float,
        broken: bool = True,
        locations: Sequence[RankLocation] = (),
    ) -> None:
        self.method, self.pending_ranks, self.timeout_s = method, tuple(pending_ranks), timeout_s
        self.broken = broken
        self.locations = _locations_for(self.pending_ranks, locations)
        tail = "the group is now broken" if broken else "the call is still running and can be waited on again"
        ranks = describe_ranks(self.pending_ranks, self.locations) if self.pending_ranks else "some ranks"
        super().__init__(f"{method}() did not finish within {timeout_s:.3g} s on {ranks}; {tail}")

    def __reduce__(self):
        return (_rebuild_keywords, (type(self), self._keywords()))

    def _keywords(self) -> dict:
        return {
            "method": self.method,
            "pending_ranks": self.pending_ranks,
            "timeout_s": self.timeout_s,
            "broken": self.broken,
            "locations": self.locations,
        }


class GroupBrokenError(WorkerGroupError):
    """The group lost a worker, passed a deadline or left ranks stuck after a failure (``__cause__``); it
    refuses further calls. Shut it down and start a new one."""


class BlockingWaitInEventLoopError(RuntimeError):
    """A blocking ``result()`` was called inside a running event loop, where it would stall every other task; the
    call was not waited on and goes on running (``await`` it). Not a failure of any rank: the group stays usable."""


def _rebuild_keywords(cls: type, kwargs: dict) -> BaseException:
    return cls(**kwargs)
