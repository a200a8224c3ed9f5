"""Read a verl PPO config (YAML file or mapping) into a :class:`~ppo_core.trainer.PPOConfig`.

verl splits the same settings differently: clip ratios, KL loss and mini-batch sizes live on
``actor_rollout_ref.actor``, sampling on ``actor_rollout_ref.rollout``, the GPU count on ``trainer``. The converter
puts each where ppo-core reads it: the controller's sections of :class:`PPOConfig`, and the worker settings in
``actor.worker`` / ``critic.worker`` (dicts of :class:`~ppo_core.workers.torch.TorchActorConfig` /
:class:`~ppo_core.workers.torch.TorchCriticConfig` fields, or of the megatron configs when verl's ``strategy`` is
``megatron``). Keys absent from the input take verl's defaults, so a verl config and its conversion train the
same algorithm. The table of every key is in ``docs/migrating-from-verl.md`` (and in
:data:`ppo_core.compat._verl_keys.RULES`); values change on the way where the two libraries count differently
(``ppo_mini_batch_size`` is multiplied by ``rollout.n``: verl counts prompts, ppo-core responses).

Keys that ppo-core cannot honour (a feature it lacks, switched on) and keys it does not know are all reported
in one ``ValueError``; keys that do not change what is computed (engine and memory knobs, logging names, file
paths your ``init_workers()`` reads) are skipped, as listed in :data:`ppo_core.compat._verl_keys.IGNORED`.

Needs OmegaConf (``pip install ppo-core[hf]``) for YAML files and verl's ``${...}`` interpolations.

Example:
    >>> cfg = ppo_config_from_verl({
    ...     "algorithm": {"adv_estimator": "grpo"},
    ...     "data": {"train_batch_size": 32},
    ...     "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8, "use_kl_loss": True},
    ...                           "rollout": {"n": 4}},
    ...     "trainer": {"n_gpus_per_node": 2},
    ... })
    >>> cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.world_size
    ('grpo', 4, 2)
    >>> cfg.actor.worker["ppo_mini_batch_size"]  # 8 prompts x 4 responses
    32
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ppo_core._checks import _FieldError
from ppo_core.compat._verl_keys import IGNORED, RULES, SKIP, Emit, Ref, Rule, Unsupported
from ppo_core.trainer.config import PPOConfig

__all__ = ["ppo_config_from_verl"]

logger = logging.getLogger(__name__)

_RULES: dict[str, Rule] = {rule.key: rule for rule in RULES}


def ppo_config_from_verl(cfg: Mapping[str, Any] | str | os.PathLike[str]) -> PPOConfig:
    """Convert a verl PPO trainer config into a :class:`PPOConfig` with worker dicts for ppo-core's workers.

    Args:
        cfg: the path of a YAML file, or a mapping (a dict or an OmegaConf ``DictConfig``) with verl's sections
            ``actor_rollout_ref``, ``critic``, ``algorithm``, ``data``, ``trainer`` (and others, which are
            checked too). ``${...}`` interpolations are resolved, with verl's defaults available to them.

    Returns:
        The config; ``actor.worker`` and ``critic.worker`` hold the worker settings verl has an equivalent for.

    Raises:
        ValueError: one error listing every key that cannot be mapped, with its value and the reason; or naming
            the verl key whose value ppo-core's configs reject.
        TypeError: ``cfg`` is neither a mapping nor a path.
        FileNotFoundError: ``cfg`` names a file that does not exist.
    """
    user = _load(cfg)
    reader = _Reader(user)
    problems: list[str] = []
    for key in sorted(user):
        value = user[key]
        if isinstance(value, _Unresolved):
            problems.append(f"{key}: {value}")
        elif key not in _RULES and not _ignored(key) and value != {}:  # an empty section sets nothing
            problems.append(f"{key}={value!r}: no ppo-core equivalent (see docs/migrating-from-verl.md)")
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # ppo-core path -> the verl key it came from
    for rule in RULES:
        if isinstance(user.get(rule.key), _Unresolved):
            continue
        value = reader(rule.key)
        try:
            converted = rule.convert(value, reader)
        except (Unsupported, TypeError) as err:  # TypeError: a value of a type the conversion cannot use
            if reader.given(rule.key) or not isinstance(rule.default, Ref):  # else the key it follows says it
                problems.append(f"{rule.key}={value!r}: {err}")
            continue
        if converted is SKIP:
            continue
        emitted = converted.values if isinstance(converted, Emit) else dict.fromkeys(rule.targets, converted)
        for path, item in emitted.items():
            _set(out, path, item)
            source[path] = rule.key
    if problems:
        raise ValueError(
            f"cannot convert {len(problems)} verl config key(s) to ppo-core:\n  "
            + "\n  ".join(sorted(problems))
        )
    return _build(out, source, reader)


class _Unresolved(str):
    """The error of an interpolation that could not be resolved (kept so that it is reported with the rest)."""


class _Reader:
    """The effective value of a verl key: the user's, else verl's default (following verl's interpolations)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def __call__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        default = _RULES[key].default
        return self(default.key) if isinstance(default, Ref) else default

    def given(self, key: str) -> bool:
        return key in self._values


def _load(cfg: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The user's leaf keys (dotted) with their resolved values (an :class:`_Unresolved` error where that failed)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError as err:  # omegaconf is in the hf extra; a plain dict without interpolations needs none
        if isinstance(cfg, Mapping):
            return _load_plain(cfg)
        raise ImportError("reading a verl YAML file needs omegaconf: pip install 'ppo-core[hf]'") from err
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"verl config {path!r} does not exist")
        raw = OmegaConf.load(path)
    elif isinstance(cfg, Mapping):
        raw = OmegaConf.create(cfg if isinstance(cfg, DictConfig) else _plain_keys(cfg))
    else:
        raise TypeError(f"cfg must be a mapping or the path of a YAML file, got {type(cfg).__name__}")
    if not isinstance(raw, DictConfig):
        raise ValueError(f"a verl config is a mapping of sections, got a {type(raw).__name__}")
    # verl's defaults are merged under the user's keys so that interpolations may refer to keys left out
    merged = OmegaConf.merge(_defaults_tree(), raw)
    user: dict[str, Any] = {}
    tree = OmegaConf.to_container(raw, resolve=False)
    for key in _leaf_keys(tree):
        if _lookup(tree, key) == {}:  # an empty section (its merged value would hold verl's defaults)
            user[key] = {}
            continue
        try:
            value = OmegaConf.select(merged, key, throw_on_resolution_failure=True)
        except Exception as err:  # omegaconf raises several error types for a bad interpolation
            user[key] = _Unresolved(f"cannot resolve {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        user[key] = value
    return user


def _load_plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_load` without OmegaConf: the leaves as given; an interpolation cannot be resolved."""
    tree = _plain_keys(cfg)
    user: dict[str, Any] = {}
    for key in _leaf_keys(tree):
        value = _lookup(tree, key)
        interpolated = isinstance(value, str) and "${" in value
        user[key] = _Unresolved("cannot resolve ${...} without omegaconf") if interpolated else value
    return user


def _plain_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): _plain_keys(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _defaults_tree() -> dict[str, Any]:
    """verl's defaults of the keys in :data:`RULES`, as a nested dict (interpolated defaults left out)."""
    tree: dict[str, Any] = {}
    for rule in RULES:
        if not isinstance(rule.default, Ref):
            *parents, leaf = rule.key.split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node.setdefault(leaf, rule.default)  # a key that is also a section keeps its sub-keys
    return tree


def _leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a nested dict (lists and empty dicts are leaves)."""
    if isinstance(tree, dict) and (tree or not prefix):
        keys: list[str] = []
        for k, v in tree.items():
            keys += _leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))
        return keys
    return [prefix]


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _ignored(key: str) -> bool:
    parts = key.split(".")
    return any(_matches(pattern.split("."), parts) for pattern, _ in IGNORED)


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """Whether ``pattern`` matches a prefix of ``parts`` ("*": one segment, "**": any number of segments)."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and head in ("*", parts[0]) and _matches(rest, parts[1:])


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _build(out: dict[str, Any], source: dict[str, str], reader: _Reader) -> PPOConfig:
    """The :class:`PPOConfig`, and the worker dicts checked by the workers' configs; errors name the verl key."""
    from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

    def explain(err: Exception, prefix: str) -> ValueError:
        path = f"{prefix}{err.field}" if isinstance(err, _FieldError) else ""
        key = next((source[p] for p in _ancestors(path) if p in source), None)
        if key is None:
            return ValueError(f"the converted verl config is not valid for ppo-core: {err}")
        return ValueError(f"verl's {key}={reader(key)!r} is not valid for ppo-core: {err}")

    try:
        config = PPOConfig.from_dict(out)
    except (TypeError, ValueError) as err:
        raise explain(err, "") from err
    for role, cls in (("actor", TorchActorConfig), ("critic", TorchCriticConfig)):
        worker = getattr(config, role).worker
        if reader(f"{'actor_rollout_ref.actor' if role == 'actor' else 'critic'}.strategy") == "megatron":
            from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig

            cls = MegatronActorConfig if role == "actor" else MegatronCriticConfig
        try:
            cls.from_dict(worker)
        except (TypeError, ValueError) as err:
            raise explain(err, f"{role}.worker.") from err
    return config


def _ancestors(path: str) -> list[str]:
    """``a.b[0].c`` -> ``["a.b[0].c", "a.b", "a"]`` (longest first; list indices dropped)."""
    parts = path.replace("[", ".[").split(".")
    names = [p for p in parts if p and not p.startswith("[")]
    return [".".join(names[:i]) for i in range(len(names), 0, -1)]
