"""What :func:`ppo_core_cli.loading.load_job_config` does with OmegaConf, with PyYAML alone: read a YAML mapping,
apply dotted overrides, resolve ``${dotted.key}`` interpolations (after the overrides, recursively).

Scalars are read as OmegaConf reads them: ``1e-3`` is a float (YAML 1.1 would read a string), ``true`` a bool,
``null`` None. An interpolation that is the whole value keeps the referenced value's type; inside a longer string
it is formatted into it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ppo_core._checks import FieldValueError

__all__ = ["read"]

_FLOAT = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_REF = re.compile(r"\$\{([^${}]+)\}")


def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML 1.1 plus exponent floats without a dot (``1e-3``), as OmegaConf reads them."""

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
        list("-+0123456789."),
    )
    return Loader


def _parse(text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        raise ValueError(f"cannot read {text!r} as YAML: {exc}") from None


def _set(tree: dict, key: str, value: Any) -> None:
    node = tree
    *heads, last = key.split(".")
    for i, head in enumerate(heads):
        child = node.setdefault(head, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {key}: {'.'.join(heads[: i + 1])} is not a mapping")
        node = child
    node[last] = value


def _get(tree: dict, key: str, where: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise FieldValueError(where, f": cannot resolve an interpolation: key {key!r} not found")
        node = node[part]
    return node


def _resolve(value: Any, tree: dict, where: str, seen: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, tree, f"{where}.{k}" if where else str(k), seen) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tree, f"{where}[{i}]", seen) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(key: str) -> Any:
        if key.startswith(
            "package_dir:"
        ):  # the one resolver of a job's YAML (ppo_core_cli.loading.package_dir)
            from ppo_core_cli.loading import package_dir

            try:
                return package_dir(key.partition(":")[2].strip())
            except ValueError as exc:
                raise FieldValueError(where, f": cannot resolve an interpolation: {exc}") from None
        if key in seen:
            raise FieldValueError(where, f": cannot resolve an interpolation: {key!r} refers to itself")
        return _resolve(_get(tree, key, where), tree, key, (*seen, key))

    whole = _REF.fullmatch(value)
    if whole:
        return lookup(whole.group(1).strip())
    return _REF.sub(lambda m: str(lookup(m.group(1).strip())), value)


def read(path: str | None, overrides: list[tuple[str, str]]) -> tuple[dict, Callable[[], dict]]:
    """``(tree with the overrides applied, interpolations unresolved; resolve())`` of a YAML file (None: ``{}``)."""
    import yaml

    tree: Any = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            try:
                tree = yaml.load(f, Loader=_loader()) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"cannot read the config {path}: {exc}") from None
            except UnicodeDecodeError:
                raise ValueError(f"cannot read the config {path}: not a text (YAML) file") from None
    if not isinstance(tree, dict):
        raise TypeError(f"the config must be a mapping of sections, got a list ({path})")
    for key, text in overrides:
        _set(tree, key, _parse(text))
    return tree, lambda: _resolve(tree, tree, "", ())
