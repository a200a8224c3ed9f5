"""The ``wandb`` logger: one run per tracker in its log directory, every flushed step logged at its step, finished
on close; skipped with a warning when the package is missing."""

from __future__ import annotations

import logging
import sys
import types

from ppo_core.trainer import Tracker, read_metrics_jsonl


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, values, step):
        self.logged.append((dict(values), step))

    def finish(self):
        self.finished = True


def test_steps_go_to_a_wandb_run(tmp_path, monkeypatch):
    runs: list[_FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(_FakeRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    log_dir = tmp_path / "my_run"
    t = Tracker(("jsonl", "wandb"), log_dir)
    t.log({"a": 1.0}, step=1)
    t.log({"b": 2.0}, step=1)
    t.log({"a": 3.0}, step=2)
    t.close()
    (run,) = runs
    assert run.init["project"] == "proj" and run.init["name"] == "my_run" and run.init["dir"] == str(log_dir)
    assert run.init["resume"] is None
    assert run.logged == [({"a": 1.0, "b": 2.0}, 1), ({"a": 3.0}, 2)]
    assert run.finished
    assert [r["step"] for r in read_metrics_jsonl(log_dir)] == [1, 2]  # the other sinks are unchanged
    Tracker(("wandb",), log_dir, resume_step=2).close()
    assert runs[-1].init["resume"] == "allow"


def test_missing_wandb_warns_and_logs_elsewhere(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.tracking"):
        t = Tracker(("jsonl", "wandb"), tmp_path)
    assert "wandb is not installed" in caplog.text
    t.log({"a": 1.0}, step=1)
    t.close()
    assert read_metrics_jsonl(tmp_path) == [{"step": 1, "a": 1.0}]
