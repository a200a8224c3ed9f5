"""The adapter derives every size and port from the mesh: no host size, GPU count or port literal in the package."""

from __future__ import annotations

import pathlib
import re

import ppo_core_monarch

PACKAGE = pathlib.Path(ppo_core_monarch.__file__).parent

FORBIDDEN = [
    (re.compile(r"(?<![\w.\-])8(?![\w.])"), "the literal 8 (GPUs per host)"),
    (re.compile(r"\[\s*4\s*\]"), "[4] (a hard-coded pool size)"),
    (re.compile(r"//\s*8\b|%\s*8\b"), "// 8 or % 8 (rank arithmetic with a fixed host size)"),
    (re.compile(r"\b(?:2\d{4}|[3-5]\d{4}|6[0-4]\d{3})\b"), "a port number"),
    (re.compile(r"MASTER_PORT\s*=\s*['\"]?\d"), "a fixed MASTER_PORT"),
]


def test_no_hard_coded_sizes_or_ports():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in FORBIDDEN:
                if pattern.search(code):
                    offenders.append(f"{path.name}:{lineno}: {what}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
