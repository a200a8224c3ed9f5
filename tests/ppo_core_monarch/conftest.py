"""Fixtures for the Monarch tests: shared meshes, simulated hosts, and guards against hangs and stray processes.

- Every test runs under a watchdog (``faulthandler.dump_traceback_later``): a test that blocks longer than
  ``_TEST_LIMIT_S`` prints every thread's stack and ends the run instead of hanging CI.
- Meshes are module-scoped so that the few seconds a mesh needs to start are paid once per module.
- At the end of the session no process started by these tests may remain: neither children of the pytest
  process (local Monarch procs) nor the worker-loop processes of the simulated hosts.
"""

from __future__ import annotations

import faulthandler
import os
import time

import pytest
from _procs import STARTED_PIDS

import ppo_core_monarch  # noqa: F401  (must precede any monarch import: it sets the supervision poll)

# Worker processes import the test worker classes by name: put this directory on their PYTHONPATH.
_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH", "")) if p)

_TEST_LIMIT_S = 240.0


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (read from /proc; psutil is not a dependency)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(_TEST_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind():
    before = _children(os.getpid())
    yield
    deadline = time.monotonic() + 20.0
    while True:
        left = sorted((_children(os.getpid()) - before) | {p for p in STARTED_PIDS if _alive(p)})
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left behind by the Monarch tests: {left}"
