"""Exits of worker processes on the controller's own machine, seen without waiting for Monarch's supervision.

Monarch reports a worker process that died (``os._exit``, a segfault, the OOM killer) through its supervision
events, usually within a poll period; under load a report has been seen to arrive only when the pending call's
message delivery timed out (30 s). For ranks that share the controller's kernel and pid namespace the answer is
also in ``/proc``: :class:`LocalExitProbe` reads the state of those ranks' processes while a call waits, so
their exit raises ``WorkerLost`` within a wait slice whatever Monarch does. Ranks on other machines (or in
other pid namespaces) are left to Monarch.

Example:
    >>> import os
    >>> process_running(os.getpid())
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

__all__ = ["LocalExitProbe", "process_namespace", "process_running"]


def process_namespace() -> str | None:
    """This process's kernel boot id and pid namespace (``"<boot_id>/pid:[<inode>]"``), None where unknown.

    Two processes with the same value see the same pids: a pid one reports is the other's to look up.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this namespace exists and has not exited (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # "pid (comm) S ...": the state follows the last ')' (comm may itself hold parentheses)
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    return state not in ("Z", "X", "x")


class LocalExitProbe:
    """Which of a set of ranks, among those whose processes share this process's namespace, have exited.

    Args:
        ranks: ``(rank, pid, namespace)`` of every rank (``namespace`` from :func:`process_namespace` in that
            rank's process; None leaves the rank to Monarch).
        interval_s: at most one look per this many seconds (a look reads one small ``/proc`` file per local rank).
    """

    def __init__(self, ranks: Sequence[tuple[int, int, str | None]], interval_s: float = 0.05) -> None:
        here = process_namespace()
        self._pids = {rank: pid for rank, pid, ns in ranks if here is not None and ns == here}
        self._interval = interval_s
        self._next = 0.0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks this probe can see."""
        return tuple(sorted(self._pids))

    def exited(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The ranks among ``ranks`` whose local process has exited (empty between two looks)."""
        now = time.monotonic()
        if not self._pids or now < self._next:
            return ()
        self._next = now + self._interval
        return tuple(r for r in ranks if r in self._pids and not process_running(self._pids[r]))
