"""The commit, date and device of a benchmark run, stamped into the JSON object the benchmark prints and writes.

A result is only comparable with another when it says which tree ran, when and on what: every script in
``benchmarks/`` prints its one JSON object through :func:`emit`, which puts ``commit`` (the short hash of ``HEAD``,
``-dirty`` when tracked files differ from it), ``date`` (UTC, ISO 8601) and ``device`` first, and writes the same
text to ``--out FILE`` when given (``benchmarks/results/<script>.json`` for the current result of each script).
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()


def commit() -> str:
    """``HEAD``'s short hash, with ``-dirty`` when a tracked file differs from it; ``unknown`` outside git."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def device() -> str:
    """The CUDA device's name when there is one, else the CPU's (with torch's thread count)."""
    try:
        import torch
    except ImportError:
        return platform.processor() or platform.machine() or "cpu"
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def stamp(result: dict[str, Any], *, device_name: str | None = None) -> dict[str, Any]:
    """``result`` with ``commit``, ``date`` and ``device`` first; a key ``result`` already has keeps its value.

    Args:
        result: the benchmark's JSON object.
        device_name: what ran it, where :func:`device` would say something else (a CPU-only run on a GPU host).
    """
    meta = {
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name or device(),
    }
    return {**meta, **result}


def emit(
    result: dict[str, Any],
    out: str | Path | None = None,
    *,
    indent: int | None = 1,
    device_name: str | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Print ``result`` stamped (:func:`stamp`) as one JSON object and write the same text to ``out`` if given.

    Returns the stamped object. ``quiet`` writes without printing (a partial result saved while a run goes on).
    """
    stamped = stamp(result, device_name=device_name)
    text = json.dumps(stamped, indent=indent)
    if not quiet:
        print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return stamped
