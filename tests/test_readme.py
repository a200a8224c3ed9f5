"""The README's usage example runs as written (on random PPO-shaped data) and its claims hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(title: str) -> str:
    text = README.read_text()
    section = text[text.index(title) :]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None, f"no python block after {title!r}"
    return match.group(1)


def test_usage_example_runs_and_backpropagates() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, length, vocab = 6, 5, 7
    logits = torch.randn(batch, length, vocab, generator=gen, requires_grad=True)
    tokens = torch.randint(0, vocab, (batch, length, 1), generator=gen)
    log_probs = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
    old_log_probs = log_probs.detach() + 0.1 * torch.randn(batch, length, generator=gen)
    ref_log_probs = log_probs.detach() + 0.1 * torch.randn(batch, length, generator=gen)
    response_mask = torch.ones(batch, length, dtype=torch.bool)
    response_mask[0, 3:] = False
    rewards = torch.zeros(batch, length)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    namespace = {
        "rewards": rewards,
        "response_mask": response_mask,
        "uids": ["a", "a", "a", "b", "b", "b"],
        "old_log_probs": old_log_probs,
        "log_probs": log_probs,
        "ref_log_probs": ref_log_probs,
    }
    exec(_python_block("## Ten lines of usage"), namespace)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    assert {"pg_clipfrac", "ppo_kl"} <= set(namespace["metrics"])


def test_ci_runs_the_readme_test_command() -> None:
    root = README.parent
    setup = README.read_text().split("## Set-up on a fresh machine")[1].split("##")[0]
    commands = re.findall(r"^(make \w+)", setup, flags=re.M)
    assert commands == ["make demo", "make test"], commands
    makefile = (root / "Makefile").read_text()
    for command in commands:
        assert re.search(rf"^{command.split()[1]}:", makefile, flags=re.M), f"Makefile lacks {command}"
    assert "make test" in (root / ".ci" / "run").read_text()


def test_each_set_up_installs_what_its_job_needs() -> None:
    """``make demo`` installs core + examples and ``make install`` the ``ppo-core`` command (hf): neither pulls in
    Monarch, megatron-core or Ray; ``make test`` installs every extra the suite imports."""
    tomllib = pytest.importorskip("tomllib")
    root = README.parent
    makefile = (root / "Makefile").read_text()
    extras = {
        name: set(value.split(","))
        for name, value in re.findall(r"^EXTRAS_(\w+) := (\S+)$", makefile, flags=re.M)
    }
    heavy = {"monarch", "megatron", "ray", "bench"}
    assert extras["demo"] == {"examples"}
    assert "hf" in extras["install"] and not extras["install"] & heavy
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert set(project["project"]["optional-dependencies"]) - {"bench"} == extras["test"]
    for target, name in (("demo", "demo"), ("install", "install"), ("test", "test"), ("lint", "test")):
        assert re.search(rf"^{target}: \$\(VENV\)/\.ppo-core-installed-{name}\b", makefile, flags=re.M), (
            target
        )
    # the SPDX license form: no setuptools deprecation warnings on install
    assert isinstance(project["project"]["license"], str) and project["project"]["license-files"] == [
        "LICENSE"
    ]
    assert not [c for c in project["project"]["classifiers"] if c.startswith("License ::")]
    assert "setuptools>=77" in project["build-system"]["requires"]
