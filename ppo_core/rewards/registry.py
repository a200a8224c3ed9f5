"""Scorers by ``data_source``: the rule-based reward picks one per response from the prompt's data source.

A scorer is called as ``scorer(solution_str, ground_truth, extra_info)`` and returns a float score or a mapping
with a ``"score"`` float and any other per-response values (``"acc"``, ``"pred"``...). It must be picklable (a
module-level function or a ``functools.partial`` of one) to run in a process pool.

Patterns are matched case-insensitively; a pattern with ``*``, ``?`` or ``[`` is a shell-style glob
(``fnmatch``). A name registered as an exact pattern always beats a glob; among matching globs the one registered
last wins, so a user's ``"*gsm8k*"``-like pattern can refine the built-in ones. Registering a taken pattern
again raises unless ``replace=True``.

Example:
    >>> reg = ScorerRegistry()
    >>> @reg.register("my/task", "my/task-*")
    ... def exact(solution_str, ground_truth, extra_info=None):
    ...     return float(solution_str.strip() == ground_truth)
    >>> reg.get("My/Task-hard") is exact, reg.get("my/task")("42", "42")
    (True, 1.0)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["Scorer", "ScorerRegistry", "get_scorer", "global_registry", "register_scorer", "scorer_patterns"]

Scorer = Callable[..., "float | Mapping[str, Any]"]
F = TypeVar("F", bound=Scorer)

_GLOB_CHARS = frozenset("*?[")


def _is_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


class ScorerRegistry:
    """Patterns of data sources mapped to scorers (see the module docstring for the matching rules).

    Args:
        fallback: a registry consulted when no pattern of this one matches (e.g. the global registry).
    """

    def __init__(self, fallback: ScorerRegistry | None = None) -> None:
        self._exact: dict[str, Scorer] = {}
        self._globs: dict[str, Scorer] = {}  # insertion order = registration order
        self.fallback = fallback

    def add(self, pattern: str, scorer: Scorer, *, replace: bool = False) -> None:
        """Map ``pattern`` to ``scorer``; a taken pattern raises ``ValueError`` unless ``replace``."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"a scorer pattern must be a non-empty string, got {pattern!r}")
        if not callable(scorer):
            raise TypeError(f"the scorer for {pattern!r} must be callable, got {type(scorer).__name__}")
        key = pattern.lower()
        table = self._globs if _is_glob(key) else self._exact
        if key in table and table[key] is not scorer and not replace:
            raise ValueError(
                f"data_source pattern {pattern!r} already has a scorer; pass replace=True to change it"
            )
        table.pop(key, None)  # a replaced glob moves to the end: it is now the latest registration
        table[key] = scorer

    def register(self, *patterns: str, replace: bool = False) -> Callable[[F], F]:
        """Decorator form of :meth:`add` for one or more patterns."""
        if not patterns:
            raise ValueError("register() needs at least one data_source pattern")

        def decorator(fn: F) -> F:
            for pattern in patterns:
                self.add(pattern, fn, replace=replace)
            return fn

        return decorator

    def find(self, data_source: str) -> Scorer | None:
        """The scorer for ``data_source``, or None when no pattern matches (here or in the fallback)."""
        key = str(data_source).lower()
        if key in self._exact:
            return self._exact[key]
        for pattern in reversed(self._globs):
            if fnmatch.fnmatchcase(key, pattern):
                return self._globs[pattern]
        return None if self.fallback is None else self.fallback.find(data_source)

    def get(self, data_source: str) -> Scorer:
        """The scorer for ``data_source``; ``ValueError`` listing the known patterns when none matches."""
        scorer = self.find(data_source)
        if scorer is None:
            raise ValueError(
                f"no scorer is registered for data_source {data_source!r}; known patterns: "
                f"{', '.join(self.patterns()) or '(none)'} (add one with register_scorer)"
            )
        return scorer

    def patterns(self) -> list[str]:
        """Every pattern known here and in the fallback, sorted."""
        own: Iterable[str] = [*self._exact, *self._globs]
        rest = self.fallback.patterns() if self.fallback is not None else []
        return sorted(set(own) | set(rest))


_REGISTRY = ScorerRegistry()


def register_scorer(*patterns: str, replace: bool = False) -> Callable[[F], F]:
    """Register the decorated scorer for data sources matching any of ``patterns`` (global registry)."""
    return _REGISTRY.register(*patterns, replace=replace)


def get_scorer(data_source: str) -> Scorer:
    """The globally registered scorer for ``data_source`` (``ValueError`` when none matches)."""
    return _REGISTRY.get(data_source)


def scorer_patterns() -> list[str]:
    """The patterns of the global registry, sorted."""
    return _REGISTRY.patterns()


def global_registry() -> ScorerRegistry:
    """The registry behind :func:`register_scorer` / :func:`get_scorer`."""
    return _REGISTRY
