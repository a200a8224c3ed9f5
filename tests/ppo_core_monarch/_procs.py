"""Registry of the processes Monarch test fixtures start, checked by the session guard in conftest.py."""

from __future__ import annotations

import os

STARTED_PIDS: list[int] = []


def remember_pids(pids: list[int]) -> None:
    """Register processes a fixture started (checked by the session guard)."""
    STARTED_PIDS.extend(pids)


def pids_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still exist."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive
