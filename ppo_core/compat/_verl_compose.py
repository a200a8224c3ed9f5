"""Read a verl config file the way verl's Hydra entry point does, without Hydra: the ``defaults:`` list, then the
command-line overrides.

verl's ``ppo_trainer.yaml`` is not a config on its own: its ``defaults:`` list pulls in the actor, critic, rollout,
data... files, and ``python -m verl.trainer.main_ppo key=value ...`` applies the user's overrides on top. Hydra is
not a dependency of ppo-core, so :func:`load_verl_tree` composes the subset of Hydra's defaults lists that verl's
trainer configs use:

- ``_self_`` (the file's own keys; placed last when absent, as Hydra >= 1.1 does);
- ``name``: another config in the same folder, merged at the including file's package;
- ``group: option``, ``group@package: option``, ``../group@package: option``: ``<folder>/<group>/<option>.yaml``,
  the folder relative to the including file's, merged at ``package`` (relative to the including file's package;
  default: the group's name);
- ``override group: option`` and a ``group=option`` command-line override choose another option for a group;
- ``${group}`` inside an option: the option chosen for that group (``${model_engine}_actor``);
- a ``# @package _global_`` header: the file's keys are merged at the root.

Overrides follow Hydra's spelling: ``key=value`` (the value is YAML), ``+key=value`` and ``++key=value`` (add or
force a key), ``~key`` (delete it). Interpolations (``${...}``) are left for the converter to resolve.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["apply_overrides", "load_verl_tree"]

_GLOBAL_HEADER = re.compile(r"^#\s*@package\s+(\S+)", re.MULTILINE)
_CHOICE = re.compile(r"\$\{([^}]+)\}")


def load_verl_tree(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Any:
    """The verl config of ``path`` (composed through its ``defaults:`` list, if any) with ``overrides`` applied.

    Args:
        path: a verl YAML file: a composed config (``--cfg job`` output, ``_generated_ppo_trainer.yaml``), a
            primary config with a ``defaults:`` list (``ppo_trainer.yaml``) or a file of overrides.
        overrides: Hydra-style ``key=value`` strings, as given to ``verl.trainer.main_ppo``.

    Returns:
        An OmegaConf ``DictConfig``, interpolations unresolved.

    Raises:
        FileNotFoundError: ``path``, or a file its defaults list names, does not exist.
        ValueError: a defaults entry or an override that cannot be read, naming it and the file.
    """
    from omegaconf import OmegaConf

    path = os.fspath(path)
    if os.path.isdir(path):
        raise FileNotFoundError(
            f"verl config {path!r} is a folder; name the YAML file (e.g. ppo_trainer.yaml)"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"verl config {path!r} does not exist")
    choices: dict[str, str] = {}
    edits: list[str] = []
    for text in overrides:
        key, sep, value = text.partition("=")
        bare = key.lstrip("+~")
        if sep and "." not in bare and not key.startswith(("+", "~")) and _is_group(path, bare):
            choices[bare] = value  # a group choice (model_engine=megatron), not a key
        else:
            edits.append(text)
    tree = _compose(path, "", choices, top=True)
    apply_overrides(tree, edits)
    return tree if tree is not None else OmegaConf.create({})


def apply_overrides(tree: Any, overrides: Sequence[str]) -> None:
    """Apply Hydra-style ``key=value`` / ``+key=value`` / ``~key`` overrides to a ``DictConfig``, in place."""
    for text in overrides:
        _apply_override(tree, text)


def _is_group(path: str, name: str) -> bool:
    return os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(path)), name))


def _compose(path: str, package: str, choices: dict[str, str], *, top: bool = False) -> Any:
    """The config of ``path`` placed at ``package``, its defaults list applied (a root-level ``DictConfig``)."""
    import yaml
    from omegaconf import DictConfig, OmegaConf

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"verl config {path!r} (named in a defaults list) does not exist: keep the file in verl's config folder "
            "(verl/trainer/config), or pass the composed config (python -m verl.trainer.main_ppo --cfg job)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"cannot read the verl config {str(path)!r}: not a text (YAML) file") from None
    header = _GLOBAL_HEADER.search(text)
    if header and not top:
        package = "" if header.group(1) == "_global_" else header.group(1)
    try:
        own = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.YAMLError as exc:
        raise ValueError(f"cannot read the verl config {str(path)!r}: {exc}") from exc
    if not isinstance(own, DictConfig):
        raise ValueError(f"verl config {path!r} is not a mapping of sections")
    entries = own.pop("defaults", None)
    entries = list(OmegaConf.to_container(entries)) if entries is not None else []
    folder = os.path.dirname(os.path.abspath(path))
    for entry in entries:  # `override` entries choose before anything is loaded
        if isinstance(entry, dict) and len(entry) == 1:
            ((key, value),) = entry.items()
            if str(key).startswith("override "):
                choices.setdefault(_group_name(folder, str(key)[len("override ") :].strip()), str(value))
    if "_self_" not in entries:
        entries.append("_self_")
    out = OmegaConf.create({})
    for entry in entries:
        if entry == "_self_":
            out = OmegaConf.merge(out, _placed(own, package))
        elif isinstance(entry, str):
            out = OmegaConf.merge(out, _compose(os.path.join(folder, f"{entry}.yaml"), package, choices))
        elif isinstance(entry, dict) and len(entry) == 1:
            ((key, option),) = entry.items()
            key = str(key)
            if key.startswith("override ") or option is None:
                continue
            group, _, sub_package = key.removeprefix("optional ").strip().partition("@")
            name = _group_name(folder, group)
            chosen = choices.setdefault(name, str(option))
            chosen = _CHOICE.sub(lambda m: _choice(m.group(1), choices, path), chosen)
            child = os.path.join(folder, group, f"{chosen}.yaml")
            where = ".".join(p for p in (package, sub_package or name) if p)
            out = OmegaConf.merge(out, _compose(child, where, choices))
        else:
            raise ValueError(f"cannot read the defaults entry {entry!r} of {path}")
    return out


def _group_name(folder: str, group: str) -> str:
    """The group's name as a choice key: its last folder (``../optim`` -> ``optim``)."""
    return os.path.basename(os.path.normpath(os.path.join(folder, group)))


def _choice(name: str, choices: dict[str, str], path: str) -> str:
    if name not in choices:
        raise ValueError(f"the defaults list of {path} refers to ${{{name}}}, which no earlier entry chose")
    return choices[name]


def _placed(config: Any, package: str) -> Any:
    from omegaconf import OmegaConf

    for part in reversed([p for p in package.split(".") if p]):
        config = OmegaConf.create({part: config})
    return config


def _apply_override(tree: Any, text: str) -> None:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if text.startswith("~"):
        key = text[1:].partition("=")[0]
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(tree, parent) if parent else tree
        if node is None or leaf not in node:
            raise ValueError(f"override {text!r}: {key} is not in the config")
        node.pop(leaf)
        return
    key, sep, value = text.lstrip("+").partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r} must be key=value (e.g. data.train_batch_size=256)")
    try:
        parsed = OmegaConf.from_dotlist([f"{key}={value}"])
        OmegaConf.update(tree, key, OmegaConf.select(parsed, key), merge=True, force_add=True)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ValueError(f"cannot apply the override {text!r}: {str(err).splitlines()[0]}") from None
