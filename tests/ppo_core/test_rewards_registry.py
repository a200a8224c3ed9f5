"""Scorer registry: exact names beat globs, the latest glob wins, case-insensitive, no silent overwrite."""

from __future__ import annotations

import pytest

from ppo_core.rewards import ScorerRegistry, get_scorer, math_score, register_scorer, scorer_patterns


def a(solution_str, ground_truth, extra_info=None):
    return 1.0


def b(solution_str, ground_truth, extra_info=None):
    return 0.0


def test_matching_rules():
    reg = ScorerRegistry()
    reg.add("task/*", a)
    reg.add("task/special", b)
    reg.add("task/s*", b)
    assert reg.get("task/other") is a
    assert reg.get("task/special") is b  # exact beats glob
    assert reg.get("TASK/Sum") is b  # the latest matching glob, case-insensitive
    assert reg.find("other") is None
    assert reg.patterns() == ["task/*", "task/s*", "task/special"]


def test_no_silent_overwrite_and_replace_moves_a_glob_last():
    reg = ScorerRegistry()
    reg.register("x*", "y")(a)
    reg.add("x*", a)  # the same function again is fine
    with pytest.raises(ValueError, match="already has a scorer; pass replace=True"):
        reg.add("X*", b)
    reg.add("x1*", b)
    assert reg.get("x12") is b
    reg.add("x*", a, replace=True)
    assert reg.get("x12") is a


def test_fallback_and_errors():
    base = ScorerRegistry()
    base.add("shared", a)
    local = ScorerRegistry(fallback=base)
    local.add("mine", b)
    assert local.get("shared") is a and local.get("mine") is b
    with pytest.raises(
        ValueError, match=r"no scorer is registered for data_source 'nope'; known patterns: mine, shared"
    ):
        local.get("nope")
    with pytest.raises(ValueError, match="non-empty string"):
        local.add("", a)
    with pytest.raises(TypeError, match="must be callable"):
        local.add("z", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        local.register()


def test_global_registry_has_the_builtin_sources():
    patterns = scorer_patterns()
    assert {"openai/gsm8k", "*gsm8k*", "lighteval/math", "huggingfaceh4/math-500"} <= set(patterns)
    assert get_scorer("DigitalLearningGmbH/MATH-lighteval") is math_score
    with pytest.raises(ValueError, match="already has a scorer"):
        register_scorer("openai/gsm8k")(a)
