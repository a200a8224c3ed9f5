"""Deprecated job keys, accepted for one release as aliases of their canonical key.

A job has one key per setting. Two settings moved:

================================== =========================== ===============================================
old key (deprecated)               canonical key               why
================================== =========================== ===============================================
``actor.worker.rollout.<key>``     ``rollout.<key>``           one ``rollout`` section: ``n`` and the sampling
                                                               (``temperature``, ``max_new_tokens``, ``engine``...)
``actor.worker.use_kl_loss``       ``actor.use_kl_loss``       the worker's switch follows the trainer's
================================== =========================== ===============================================

:func:`canonical_job_tree` moves an old key onto its canonical one, logging a warning once per old key and
process. A job that sets both to different values is refused with a ``ValueError`` naming both dotted keys (the
same value twice is accepted).

Example:
    >>> canonical_job_tree({"actor": {"worker": {"rollout": {"temperature": 0.7}}}}, warn=False)
    {'actor': {'worker': {}}, 'rollout': {'temperature': 0.7}}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ppo_core._checks import FieldTypeError, FieldValueError, describe
from ppo_core._config_base import _plain

__all__ = ["ALIASES", "canonical_job_tree"]

logger = logging.getLogger(__name__)

ALIASES: dict[str, str] = {
    "actor.worker.rollout": "rollout",
    "actor.worker.use_kl_loss": "actor.use_kl_loss",
}
"""``{old dotted key: canonical dotted key}``; an old section maps each key below it to the same key below the
canonical section."""

_warned: set[str] = set()


def _section(tree: dict[str, Any], path: list[str], create: bool) -> dict[str, Any] | None:
    node: Any = tree
    for i, part in enumerate(path):
        child = node.get(part)
        if child is None and create:
            child = node[part] = {}
        if not isinstance(child, dict):
            if child is None:
                return None
            where = ".".join(path[: i + 1])
            raise FieldTypeError(where, f" must be a mapping, got {describe(child)}")
        node = child
    return node


def _move(tree: dict[str, Any], old: str, new: str, value: Any, warn: bool) -> None:
    *head, last = new.split(".")
    target = _section(tree, head, create=True)
    assert target is not None
    if last in target and target[last] != value:
        raise FieldValueError(
            old,
            f"={value!r} (deprecated) and {new}={target[last]!r} are both set and differ; keep only {new}",
        )
    target[last] = value
    if warn and old not in _warned:
        _warned.add(old)
        logger.warning(
            "%s is deprecated: write %s (the old key is read as an alias for one release)", old, new
        )


def canonical_job_tree(tree: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """``tree`` (a job as nested dicts) with every deprecated key (:data:`ALIASES`) moved onto its canonical key.

    Args:
        tree: the job's keys; not modified.
        warn: log a warning the first time each old key is seen in this process.

    Raises:
        ValueError: an old key and its canonical key both set, to different values (naming both).
        TypeError: a section on the way is not a mapping.
    """
    # new plain dicts and lists (an OmegaConf mapping too): the caller's are not touched
    out = _plain(dict(tree))
    for old, new in ALIASES.items():
        *head, last = old.split(".")
        parent = _section(out, head, create=False)
        if parent is None or last not in parent:
            continue
        value = parent.pop(last)
        if isinstance(value, Mapping):  # a section: each key below it
            for key, item in value.items():
                _move(out, f"{old}.{key}", f"{new}.{key}", item, warn)
        elif value is not None:
            _move(out, old, new, value, warn)
    return out
