"""``LocalWorkerGroup`` at exit: its call thread keeps nothing of a finished call, ``shutdown()`` joins it, and a
process that used a group (shut down or not) exits with status 0, never SIGABRT from a tensor freed on a daemon
thread while the interpreter finalizes."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

from ppo_core.backends.local import LocalWorkerGroup
from ppo_core.workers import Dispatch, Worker, register

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Holder(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(8, 8)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).detach()


def _call_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ppo-local-calls" and t.is_alive()]


def _eventually_none(ref: weakref.ref, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < end:
        gc.collect()  # the call's future and its callbacks form a cycle
        time.sleep(0.01)
    return ref() is None


def test_a_finished_call_leaves_nothing_on_the_call_thread():
    with LocalWorkerGroup(_Holder) as wg:
        x = torch.randn(2, 8)
        arg = weakref.ref(x)
        (out,) = wg.forward(x)
        result = weakref.ref(out)
        del x
        assert arg() is None  # the call thread let go of it before the call returned
        del out
        assert _eventually_none(result)


def test_shutdown_joins_the_call_thread_and_frees_the_workers():
    before = set(_call_threads())
    wg = LocalWorkerGroup(_Holder)
    wg.forward(torch.randn(2, 8))
    model = weakref.ref(wg.workers[0].model)
    wg.shutdown()
    assert set(_call_threads()) <= before
    gc.collect()
    assert model() is None


_SCRIPT = textwrap.dedent(
    """
    import torch
    from ppo_core.backends.local import LocalWorkerGroup
    from ppo_core.workers import Dispatch, Worker, register

    class W(Worker):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])

        @register(dispatch=Dispatch.ONE_TO_ALL)
        def step(self, x):
            out = self.model(x)
            out.sum().backward()
            return {"y": out.detach(), "grads": [p.grad.clone() for p in self.model.parameters()]}

    shut, left = LocalWorkerGroup(W), LocalWorkerGroup(W)  # one shut down, one left to the exit hook
    for _ in range(3):
        shut.step(torch.randn(64, 256))
        left.step(torch.randn(64, 256))
    shut.shutdown()
    """
)


@pytest.mark.slow
def test_processes_using_a_group_exit_with_status_0(tmp_path):
    script = tmp_path / "use_group.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
