"""``start_worker_loops``: loops started together, a loop whose port was taken retried in its place, and loops that
never outlive the process that started them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _procs import pids_alive, remember_pids

from ppo_core_monarch import launch, start_worker_loops

pytestmark = pytest.mark.monarch


def test_a_loop_whose_port_is_taken_is_retried_and_the_order_kept(monkeypatch) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([launch._free_port("127.0.0.1"), busy])  # loop 0 gets a free port, loop 1 the taken one
    real = launch._free_port
    monkeypatch.setattr(launch, "_free_port", lambda host: next(ports, None) or real(host))
    try:
        loops = start_worker_loops(2, retries=2)
    finally:
        taken.close()
    remember_pids(loops.pids)
    try:
        assert len(loops.addresses) == len(loops.processes) == 2
        assert f":{busy}" not in " ".join(loops.addresses)
        assert all(p.poll() is None for p in loops.processes)
    finally:
        loops.stop()
    assert pids_alive(loops.pids) == []


def test_loops_end_when_the_process_that_started_them_dies() -> None:
    script = (
        "import os, signal\n"
        "from ppo_core_monarch import start_worker_loops\n"
        "loops = start_worker_loops(2)\n"
        "print(*loops.pids, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    # the loops' stderr is not ours to wait on: a loop that outlived the child would hold the pipe open
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    pids = [int(p) for p in child.stdout.readline().split()]
    remember_pids(pids)
    try:
        assert child.wait(timeout=60) == -signal.SIGKILL and len(pids) == 2
        deadline = time.monotonic() + 20.0
        while pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_alive(pids) == []
    finally:
        for pid in pids_alive(pids):  # never leave them behind, whatever failed
            os.killpg(pid, signal.SIGKILL)
