"""Registry of the processes Monarch test fixtures start, checked by the session guard in conftest.py."""

from __future__ import annotations

STARTED_PIDS: list[int] = []


def remember_pids(pids: list[int]) -> None:
    """Register processes a fixture started (checked by the session guard)."""
    STARTED_PIDS.extend(pids)
