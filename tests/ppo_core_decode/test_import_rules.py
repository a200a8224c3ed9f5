"""``ppo_core_decode`` imports only torch, triton, the model libraries, ppo-core's core math and the leaf modules of
``ppo_core.rollout``: never the workers, the trainer or the backends (docs/architecture.md, import rules)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ppo_core_decode

PACKAGE = pathlib.Path(ppo_core_decode.__file__).parent
ALLOWED_PPO_CORE = (
    "ppo_core._checks",
    "ppo_core.keys",
    "ppo_core.kernels",
    "ppo_core.rollout.sampling",
    "ppo_core.rollout.layout",
    "ppo_core.rollout.prompt_checks",
    "ppo_core.rollout.registry",
    "ppo_core.rollout.engine_config",
)


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names if node.module == "ppo_core"]
    return names


def _allowed(name: str) -> bool:
    if not (name == "ppo_core" or name.startswith("ppo_core.")):
        return True
    return any(name == a or name.startswith(a + ".") for a in ALLOWED_PPO_CORE)


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_decode_package_imports_no_worker_trainer_or_backend(path: pathlib.Path) -> None:
    bad = [name for name in _imports(path) if not _allowed(name)]
    assert bad == [], f"{path.name} imports {bad}"


def test_the_rule_can_fail() -> None:
    assert not _allowed("ppo_core.workers.megatron.model") and not _allowed("ppo_core.trainer")
    assert (
        not _allowed("ppo_core.rollout.generate")
        and _allowed("ppo_core.rollout.layout")
        and _allowed("torch")
    )
