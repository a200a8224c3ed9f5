"""Deprecated job keys, accepted for one release as aliases of their canonical key.

A job has one key per setting. Two settings moved:

================================== =========================== ===============================================
old key (deprecated)               canonical key               why
================================== =========================== ===============================================
``actor.worker.rollout.<key>``     ``rollout.<key>``           one ``rollout`` section: ``n`` and the sampling
                                                               (``temperature``, ``max_new_tokens``, ``engine``...)
``actor.worker.use_kl_loss``       ``actor.use_kl_loss``       the worker's switch follows the trainer's
================================== =========================== ===============================================

The first is the trainer config's own alias (:mod:`ppo_core.trainer.aliases`, whose :func:`canonical_tree` does
the work, so a library user's :class:`~ppo_core.trainer.PPOConfig` and a job share one layout); the second is the
job's (a trainer config hands ``actor.worker`` to the worker as it is). :func:`canonical_job_tree` moves an old key
onto its canonical one, logging a warning once per old key and process. A job that sets both to different values
is refused with a ``ValueError`` naming both dotted keys (the same value twice is accepted).

Example:
    >>> canonical_job_tree({"actor": {"worker": {"rollout": {"temperature": 0.7}}}}, warn=False)
    {'actor': {'worker': {}}, 'rollout': {'temperature': 0.7}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_core.trainer import aliases as trainer_aliases

__all__ = ["ALIASES", "canonical_job_tree"]

ALIASES: dict[str, str] = {
    **trainer_aliases.ALIASES,
    "actor.worker.use_kl_loss": "actor.use_kl_loss",
}
"""``{old dotted key: canonical dotted key}``; an old section maps each key below it to the same key below the
canonical section."""


def canonical_job_tree(tree: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """``tree`` (a job as nested dicts) with every deprecated key (:data:`ALIASES`) moved onto its canonical key
    (:func:`ppo_core.trainer.aliases.canonical_tree`).

    Raises:
        ValueError: an old key and its canonical key both set, to different values (naming both).
        TypeError: a section on the way is not a mapping.
    """
    return trainer_aliases.canonical_tree(tree, aliases=ALIASES, warn=warn)
