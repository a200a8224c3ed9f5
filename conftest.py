"""Doctests of the packages run with the suite: give them ``torch`` and skip what this machine cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Optional extras: their modules are only collected (for doctests) when the extra is installed.
collect_ignore_glob: list[str] = []
if importlib.util.find_spec("megatron") is None:
    collect_ignore_glob += ["ppo_core/workers/megatron/*", "ppo_core_cli/_megatron_workers.py"]
if importlib.util.find_spec("monarch") is None:
    collect_ignore_glob.append("ppo_core_monarch/*")
collect_ignore_glob += ["examples/*", "benchmarks/*"]

if importlib.util.find_spec("monarch") is not None:
    # Monarch reads its supervision poll at import: ppo_core_monarch must set it before any test imports monarch,
    # or a dead worker is detected only after Monarch's 10 s default.
    import ppo_core_monarch  # noqa: F401


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="the example runs on a CUDA device")
    for item in items:
        if isinstance(item, pytest.DoctestItem) and any('"cuda"' in ex.source for ex in item.dtest.examples):
            item.add_marker(needs_cuda)
