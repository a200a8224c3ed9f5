"""The stamp every benchmark JSON carries: commit, date and device first, the benchmark's own keys kept."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import _meta


def test_stamp_puts_commit_date_device_first_and_keeps_the_results_keys() -> None:
    stamped = _meta.stamp({"rows": 64, "device": "NVIDIA H200"})
    assert list(stamped)[:3] == ["commit", "date", "device"]
    assert stamped["device"] == "NVIDIA H200"  # the benchmark's own device name wins
    assert stamped["rows"] == 64
    when = datetime.datetime.fromisoformat(stamped["date"])
    assert (
        when.tzinfo is not None
        and abs(datetime.datetime.now(datetime.timezone.utc) - when).total_seconds() < 60
    )


def test_stamp_names_the_device_when_the_result_does_not() -> None:
    assert _meta.stamp({})["device"] == _meta.device()
    assert _meta.stamp({}, device_name="cpu x 2")["device"] == "cpu x 2"


def test_commit_is_head_with_dirty_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    monkeypatch.setattr(_meta, "ROOT", tmp_path)
    assert _meta.commit() == head
    (tmp_path / "untracked.txt").write_text("b")
    assert _meta.commit() == head  # untracked files are not the measured tree
    (tmp_path / "f.txt").write_text("changed")
    assert _meta.commit() == f"{head}-dirty"


def test_commit_outside_git_is_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_meta, "ROOT", tmp_path / "not_a_repo")
    assert _meta.commit() == "unknown"


def test_emit_prints_and_writes_the_same_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "x.json"
    stamped = _meta.emit({"speedup": 1.5}, out)
    printed = json.loads(capsys.readouterr().out)
    assert printed == stamped == json.loads(out.read_text())
    assert stamped["speedup"] == 1.5


def test_emit_quiet_writes_without_printing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "partial.json"
    _meta.emit({"done": 1}, out, quiet=True)
    assert capsys.readouterr().out == ""
    assert json.loads(out.read_text())["done"] == 1
