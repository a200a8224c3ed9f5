"""Compare the config a checkpoint was written with to the config of the run that resumes it.

A resumed run continues the same experiment only if the settings that define it are unchanged. Every difference is
reported, by dotted key (``algorithm.adv_estimator``, ``actor.worker.optim.lr``), in two classes:

**Keys that change what the run means** (:data:`MEANING_KEYS`) raise :class:`ResumeConfigError`, listing each
differing key with both values, unless ``trainer.resume_allow_changes`` names the key (or a section above it):

- ``algorithm.adv_estimator``: another estimator optimises another objective;
- ``data.train_batch_size``: the batch size, and the unit of the saved data-loader position (batches), so another
  size would skip or repeat prompts;
- ``data.seed``, ``data.shuffle``: the prompt order, which the saved position indexes into;
- ``rollout.n``: responses per prompt (the group size of GRPO-like estimators, and the batch size);
- ``actor.worker.ppo_mini_batch_size``, ``critic.worker.ppo_mini_batch_size``: the update's batch size;
- ``actor.worker.model``, ``critic.worker.model`` (every key below them) and ``*.worker.hf_checkpoint``: the model,
  which the saved weights must fit (``hf_checkpoint``, the run's ``model.path`` / ``model.critic_path``, with any
  workers: the frozen KL reference is loaded from it again).

The torch workers' ``hf_checkpoint`` absent from a checkpoint written by an earlier release (:data:`LATER_KEYS`) is
listed with the other changes, not refused: there is nothing to compare it with.

**Every other difference** (learning rates, KL coefficients, clip ratios, epochs, logging...) is listed in one
warning and the run continues. :data:`IGNORED_KEYS` (how to resume and how to display progress) are not compared.

When a ``data.train_batch_size`` change is allowed, the saved data-loader position is rescaled to the new batch size
so that the run continues after the prompts already seen (rounding down: at most one batch is seen twice).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_core._config_base import ConfigBase
from ppo_core.trainer.aliases import canonical_tree

__all__ = [
    "IGNORED_KEYS",
    "LATER_KEYS",
    "MEANING_KEYS",
    "ResumeConfigError",
    "check_resume_config",
    "config_differences",
    "rescale_loader_state",
]

logger = logging.getLogger(__name__)

MEANING_KEYS: tuple[str, ...] = (
    "algorithm.adv_estimator",
    "data.train_batch_size",
    "data.seed",
    "data.shuffle",
    "rollout.n",
    "actor.worker.ppo_mini_batch_size",
    "critic.worker.ppo_mini_batch_size",
    "actor.worker.model",
    "critic.worker.model",
    "actor.worker.hf_checkpoint",
    "critic.worker.hf_checkpoint",
)
"""Dotted keys (with every key below them) whose change on resume raises unless allowed."""

IGNORED_KEYS: tuple[str, ...] = (
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.resume_allow_changes",
    "trainer.progress_bar",
    "trainer.console_every",
    "trainer.log_val_generations",
)
"""Dotted keys that are not compared: they say how to resume and how to show progress, not what to train."""

_NOT_SET = object()


class ResumeConfigError(ValueError):
    """The resumed config changes keys that change what the run means.

    Attributes:
        checkpoint: the checkpoint folder.
        differences: ``{dotted_key: (value in the checkpoint, value now)}`` of the refused keys (a key absent on
            one side shows as the string ``"(not set)"``).
    """

    def __init__(self, message: str, *, checkpoint: str, differences: dict[str, tuple[Any, Any]]) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.differences = differences


def _under(key: str, patterns: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in patterns)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, ConfigBase):
        value = value.to_dict()
    if isinstance(value, Mapping):
        # an empty mapping adds no key: a worker dict {} and one that sets keys differ only in those keys
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def _normalized(value: Any) -> Any:
    # YAML and dict round trips turn tuples into lists; they mean the same setting
    if isinstance(value, (list, tuple)):
        return tuple(_normalized(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    a, b = _normalized(a), _normalized(b)
    try:
        return bool(a == b)
    except Exception:  # objects whose == fails or is ambiguous (arrays): compare their text
        return repr(a) == repr(b)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted_key: (saved value, current value)}`` for every leaf that differs, sorted by key.

    Nested mappings (and config dataclasses) are flattened to dotted keys; a key missing on one side is reported
    with the string ``"(not set)"``; lists and tuples with equal items are equal; :data:`IGNORED_KEYS` are skipped.

    Example:
        >>> config_differences({"a": {"lr": 0.1, "n": 2}}, {"a": {"lr": 0.2, "n": 2, "new": True}})
        {'a.lr': (0.1, 0.2), 'a.new': ('(not set)', True)}
    """
    old: dict[str, Any] = {}
    new: dict[str, Any] = {}
    _flatten(saved, "", old)
    _flatten(current, "", new)
    out = {}
    for key in sorted(old.keys() | new.keys()):
        if _under(key, IGNORED_KEYS):
            continue
        a, b = old.get(key, _NOT_SET), new.get(key, _NOT_SET)
        if a is _NOT_SET or b is _NOT_SET or not _same(a, b):
            out[key] = tuple("(not set)" if v is _NOT_SET else v for v in (a, b))
    return out


def _at_default(config: Any, key: str, value: Any) -> bool:
    """Whether ``value`` is the default of the dataclass field at dotted ``key`` of ``config``. A checkpoint of an
    earlier version lacks the keys its job left out (a worker's dict) or that did not exist yet: its run took their
    defaults, so a key it lacks is no change while the resuming run keeps the default."""
    *head, last = key.split(".")
    for name in head:
        if not dataclasses.is_dataclass(config):
            return False
        config = getattr(config, name, None)
    fields = {f.name: f for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else {}
    f = fields.get(last)
    if f is None:
        return False
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    return _same(default, value)


def _lines(differences: Mapping[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"  {key}: {a!r} in the checkpoint, {b!r} now" for key, (a, b) in differences.items())


def check_resume_config(
    saved: Mapping[str, Any] | None,
    current: ConfigBase | Mapping[str, Any],
    *,
    checkpoint: str,
    allow: Sequence[str] = (),
) -> dict[str, tuple[Any, Any]]:
    """Refuse a resume that changes what the run means; warn once about every other change.

    Args:
        saved: the config stored in the checkpoint (``trainer_state["config"]``); None for a checkpoint written
            without one (logged as a warning, nothing compared). Its deprecated keys are read as their canonical
            ones (:mod:`~ppo_core.trainer.aliases`: ``actor.worker.rollout.<key>`` is ``rollout.<key>``).
        current: the resuming run's config (a :class:`ppo_core.trainer.PPOConfig` or its dict).
        checkpoint: the checkpoint folder, for the messages.
        allow: dotted keys the user changes on purpose (``trainer.resume_allow_changes``); a key also allows every
            key below it (``"actor.worker.model"``).

    Returns:
        Every difference, ``{dotted_key: (saved, current)}`` (empty when the configs agree).

    Raises:
        ResumeConfigError: a key of :data:`MEANING_KEYS` differs and is not in ``allow``; the message lists each
            such key with both values, and how to allow it.

    Example:
        >>> saved = {"algorithm": {"adv_estimator": "gae"}, "actor": {"worker": {"optim": {"lr": 1e-6}}}}
        >>> now = {"algorithm": {"adv_estimator": "grpo"}, "actor": {"worker": {"optim": {"lr": 1e-6}}}}
        >>> try:
        ...     check_resume_config(saved, now, checkpoint="ckpt/global_step_3")
        ... except ResumeConfigError as e:
        ...     print(e.differences)
        {'algorithm.adv_estimator': ('gae', 'grpo')}
        >>> check_resume_config(saved, now, checkpoint="ckpt/global_step_3", allow=["algorithm.adv_estimator"])
        {'algorithm.adv_estimator': ('gae', 'grpo')}
    """
    if saved is None:
        logger.warning(
            "checkpoint %s holds no config: the resumed config cannot be compared with it", checkpoint
        )
        return {}
    # a checkpoint written before the sampling moved to ``rollout`` is read in today's layout
    saved = canonical_tree(saved, warn=False, strict=False)
    differences = {
        key: (a, b)
        for key, (a, b) in config_differences(saved, current).items()
        if not (isinstance(a, str) and a == "(not set)" and _at_default(current, key, b))
    }
    refused = {
        k: v
        for k, v in differences.items()
        if _under(k, MEANING_KEYS) and not _under(k, tuple(allow)) and not _predates(k, v[0])
    }
    if refused:
        keys = ", ".join(f'"{k}"' for k in refused)
        raise ResumeConfigError(
            f"resuming from {checkpoint} with a config that changes what the run means:\n{_lines(refused)}\n"
            f"List the keys you change on purpose in trainer.resume_allow_changes (e.g. resume_allow_changes: "
            f"[{keys}]), or start a new run in another trainer.default_local_dir.",
            checkpoint=checkpoint,
            differences=refused,
        )
    if differences:
        logger.warning(
            "resuming from %s with %d config change(s) from the checkpoint's:\n%s",
            checkpoint,
            len(differences),
            _lines(differences),
        )
    return differences


LATER_KEYS: tuple[str, ...] = ("actor.worker.hf_checkpoint", "critic.worker.hf_checkpoint")
"""Meaning keys that checkpoints of earlier releases may lack (the torch workers' configs record their model's
checkpoint since this release): absent from the saved config, they cannot be compared, and are listed with the other
changes instead of refused."""


def _predates(key: str, saved: Any) -> bool:
    return key in LATER_KEYS and isinstance(saved, str) and saved == "(not set)"


def rescale_loader_state(
    loader_state: Mapping[str, int], saved_batch_size: int, batch_size: int
) -> dict[str, int]:
    """The data-loader position in batches of ``batch_size`` that has consumed as many prompts of the epoch as
    ``loader_state`` had in batches of ``saved_batch_size``, rounded down: no prompt is skipped, and fewer than
    ``batch_size`` are seen twice.

    Example:
        >>> rescale_loader_state({"epoch": 1, "position": 3}, saved_batch_size=4, batch_size=8)
        {'epoch': 1, 'position': 1}
    """
    state = dict(loader_state)
    state["position"] = int(state["position"]) * int(saved_batch_size) // int(batch_size)
    return state
