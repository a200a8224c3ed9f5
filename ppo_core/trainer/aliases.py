"""Deprecated config keys, accepted for one release as aliases of their canonical key.

A config has one key per setting. The sampling moved out of the actor worker into the one ``rollout`` section, next
to ``rollout.n``:

================================== =========================== ===============================================
old key (deprecated)               canonical key               why
================================== =========================== ===============================================
``actor.worker.rollout.<key>``     ``rollout.<key>``           one ``rollout`` section: ``n`` and the sampling
                                                               (``temperature``, ``max_new_tokens``, ``engine``...)
================================== =========================== ===============================================

:func:`canonical_tree` moves an old key onto its canonical one, logging a warning once per old key and process; a
config that sets both to different values is refused with a ``ValueError`` naming both dotted keys (the same value
twice is accepted). :meth:`ppo_core.trainer.PPOConfig.from_dict` applies :data:`ALIASES`; the ``ppo-core`` command
adds its own (``ppo_core_cli.aliases``).

Example:
    >>> canonical_tree({"actor": {"worker": {"rollout": {"temperature": 0.7}}}}, warn=False)
    {'actor': {'worker': {}}, 'rollout': {'temperature': 0.7}}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ppo_core._checks import FieldTypeError, FieldValueError, describe
from ppo_core._config_base import _plain

__all__ = ["ALIASES", "canonical_tree"]

logger = logging.getLogger(__name__)

ALIASES: dict[str, str] = {"actor.worker.rollout": "rollout"}
"""``{old dotted key: canonical dotted key}`` of a trainer config (:class:`~ppo_core.trainer.PPOConfig`); an old
section maps each key below it to the same key below the canonical section."""

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
    if isinstance(value, Mapping) and isinstance(
        target.get(last), Mapping
    ):  # two sections: merged key by key
        for key, item in value.items():
            _move(tree, f"{old}.{key}", f"{new}.{key}", item, warn)
        return
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


def canonical_tree(
    tree: Mapping[str, Any],
    *,
    aliases: Mapping[str, str] = ALIASES,
    warn: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """``tree`` (a config as nested mappings) with every deprecated key of ``aliases`` moved onto its canonical key.

    Args:
        tree: the config's keys; not modified (an OmegaConf mapping is read as plain dicts and lists).
        aliases: ``{old dotted key: canonical dotted key}``; :data:`ALIASES` by default.
        warn: log a warning the first time each old key is seen in this process.
        strict: raise when a section on the way to an old key is not a mapping; False leaves it as it is (for the
            config's own type check, whose message lists the types it accepts).

    Raises:
        ValueError: an old key and its canonical key both set, to different values (naming both).
        TypeError: a section on the way is not a mapping (with ``strict``).
    """
    out = _plain(dict(tree))
    for old, new in aliases.items():
        *head, last = old.split(".")
        try:
            parent = _section(out, head, create=False)
        except TypeError:
            if strict:
                raise
            continue
        if parent is None or last not in parent:
            continue
        value = parent.pop(last)
        if isinstance(value, Mapping):  # a section: each key below it
            for key, item in value.items():
                _move(out, f"{old}.{key}", f"{new}.{key}", item, warn)
        elif value is not None:
            _move(out, old, new, value, warn)
    return out
