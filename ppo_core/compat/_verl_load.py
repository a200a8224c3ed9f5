"""The user's verl config as dotted keys, and verl's defaults to compare them with (for :mod:`ppo_core.compat.verl`).

:func:`load_user_keys` reads a file (composed through its ``defaults:`` list, see
:mod:`ppo_core.compat._verl_compose`) or a mapping, applies the overrides and resolves each leaf; an interpolation is
resolved against the config merged over verl's defaults (:data:`~ppo_core.compat._verl_defaults.DEFAULTS`), so that
it may refer to keys left out. :func:`at_default` tells whether a value is verl's default of its key, resolving an
interpolated default against the rest of the config.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_core.compat._verl_defaults import DEFAULTS, MEGATRON_DEFAULTS, nested
from ppo_core.compat._verl_keys import RULES, Ref

__all__ = ["MergedTree", "Unresolved", "at_default", "known_key", "leaf_keys", "load_user_keys", "lookup"]

VerlInput = Mapping[str, Any] | str | os.PathLike[str]

_RULE_KEYS: dict[str, Any] = {rule.key: rule.default for rule in RULES}


class Unresolved(str):
    """The error of an interpolation that could not be resolved (kept so that it is reported with the rest)."""


def load_user_keys(cfg: VerlInput, overrides: Sequence[str]) -> tuple[dict[str, Any], MergedTree | None]:
    """The user's leaf keys (dotted) with their resolved values (an :class:`Unresolved` error where that failed),
    and the config merged over verl's defaults (None without OmegaConf)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError as err:  # omegaconf is in the hf extra; a plain dict without interpolations needs none
        if isinstance(cfg, Mapping) and not overrides:
            return _load_plain(cfg), None
        raise ImportError("reading a verl YAML file needs omegaconf: pip install 'ppo-core[hf]'") from err
    from ppo_core.compat._verl_compose import apply_overrides, load_verl_tree

    if isinstance(cfg, (str, os.PathLike)):
        raw = load_verl_tree(cfg, overrides)
    elif isinstance(cfg, Mapping):
        raw = OmegaConf.create(cfg if isinstance(cfg, DictConfig) else _plain_keys(cfg))
        if isinstance(raw, DictConfig):
            apply_overrides(raw, overrides)
    else:
        raise TypeError(f"cfg must be a mapping or the path of a YAML file, got {type(cfg).__name__}")
    if not isinstance(raw, DictConfig):
        raise ValueError(f"a verl config is a mapping of sections, got a {type(raw).__name__}")
    # verl's defaults are merged under the user's keys so that interpolations may refer to keys left out (as plain
    # dicts: one OmegaConf tree is built, not two merged)
    tree = OmegaConf.to_container(raw, resolve=False)
    merged = MergedTree(tree)
    user: dict[str, Any] = {}
    for key in leaf_keys(tree):
        given = lookup(tree, key)
        if given == {}:  # an empty section (its merged value would hold verl's defaults)
            user[key] = {}
            continue
        if given == "???":  # OmegaConf's missing value
            user[key] = None
            continue
        if not _interpolated(given):
            user[key] = given
            continue
        try:
            value = OmegaConf.select(merged.config(), key, throw_on_resolution_failure=True)
        except Exception as err:  # omegaconf raises several error types for a bad interpolation
            user[key] = Unresolved(f"cannot resolve {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        user[key] = value
    return user, merged


class MergedTree:
    """The user's config over verl's defaults, as an OmegaConf tree built when first needed (to resolve an
    interpolation): a config without interpolations is read without one."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree
        self._config: Any = None

    def config(self) -> Any:
        if self._config is None:
            from omegaconf import OmegaConf

            self._config = OmegaConf.create(_merged(_defaults_tree(), self.tree))
        return self._config

    def given(self, key: str) -> Any:
        """The user's value of ``key`` as written (an interpolation unresolved)."""
        try:
            return lookup(self.tree, key)
        except (KeyError, TypeError):
            return _NOT_RESOLVED


def _interpolated(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_interpolated(v) for v in value.values())
    if isinstance(value, list):
        return any(_interpolated(v) for v in value)
    return False


def _load_plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_load` without OmegaConf: the leaves as given; an interpolation cannot be resolved."""
    tree = _plain_keys(cfg)
    user: dict[str, Any] = {}
    for key in leaf_keys(tree):
        value = lookup(tree, key)
        interpolated = isinstance(value, str) and "${" in value
        user[key] = Unresolved("cannot resolve ${...} without omegaconf") if interpolated else value
    return user


def _plain_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): _plain_keys(v) if isinstance(v, Mapping) else v for k, v in data.items()}


@functools.cache
def _defaults_tree() -> dict[str, Any]:
    """verl's default config as a nested dict: :data:`DEFAULTS` (and the megatron-only keys), plus the defaults of
    the older keys in :data:`RULES` (interpolated rule defaults left out)."""
    items = [*DEFAULTS.items(), *((k, v) for k, v in MEGATRON_DEFAULTS.items() if k not in DEFAULTS)]
    items += [(rule.key, rule.default) for rule in RULES if not isinstance(rule.default, Ref)]
    return nested(items)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` as OmegaConf merges: sections recursively, any other value replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def known_key(key: str) -> bool:
    """Whether verl's config has ``key``, or a free-form section above it (``model.override_config``)."""
    parts = key.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(p in DEFAULTS or p in MEGATRON_DEFAULTS or p in _RULE_KEYS for p in prefixes)


def _default_of(key: str, megatron: bool) -> tuple[bool, Any]:
    """``(known, default)``: whether verl's config has ``key``, and its default as written."""
    if megatron and key in MEGATRON_DEFAULTS:
        return True, MEGATRON_DEFAULTS[key]
    if key in DEFAULTS:
        return True, DEFAULTS[key]
    if key in _RULE_KEYS and not isinstance(_RULE_KEYS[key], Ref):
        return True, _RULE_KEYS[key]
    return False, None


def at_default(key: str, value: Any, merged: MergedTree | None, megatron: bool) -> bool:
    """Whether ``value`` (resolved) is verl's default of ``key``; an interpolated default is resolved in place."""
    if value == {}:  # an empty section sets nothing
        return True
    known, default = _default_of(key, megatron)
    if not known:
        return False
    if default == "???":  # a key verl requires (OmegaConf's missing value, read as None)
        return value is None
    if isinstance(default, str) and "${" in default and merged is not None:
        if merged.given(key) == default:  # the default as written (verl's composed config)
            return True
        default = _resolved_default(merged.config(), key, default)
    return _same(value, default)


def _resolved_default(merged: Any, key: str, default: str) -> Any:
    """The value ``key`` would have with its interpolated default, the rest of the config as given."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node_parent, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(merged, node_parent) if node_parent else merged
    if not isinstance(parent, DictConfig):
        return _NOT_RESOLVED
    saved = parent._get_node(leaf)  # the node as given (possibly an interpolation), restored below
    try:
        parent[leaf] = default
        value = OmegaConf.select(merged, key, throw_on_resolution_failure=True)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        return value
    except Exception:  # an interpolation that does not resolve is no default the value could equal
        return _NOT_RESOLVED
    finally:
        parent[leaf] = saved


_NOT_RESOLVED = object()


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same kind (``True`` is not ``1``; ``1`` is ``1.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of a nested dict (lists and empty dicts are leaves)."""
    if isinstance(tree, dict) and (tree or not prefix):
        keys: list[str] = []
        for k, v in tree.items():
            keys += leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))
        return keys
    return [prefix]


def lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree
