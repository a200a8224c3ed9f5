"""Reading a :class:`~ppo_core_cli.config.JobConfig`: a YAML file, Hydra-style dotted overrides, ``${...}``
interpolations, every unknown key named by its dotted path.

:func:`load_job_config` reads the file with OmegaConf (the ``hf`` extra) and applies ``key=value`` overrides the way
Hydra does (``trainer.total_training_steps=5``, ``data.train_files=[a.parquet,b.parquet]``); interpolations are
resolved after the overrides (``${vars.root}`` picks up ``vars.root=/tmp/x``). Where OmegaConf is not installed (a
machine with only ``transformers``' dependencies), :mod:`ppo_core_cli._plain_yaml` does the same with PyYAML: the
same files, overrides and ``${dotted.key}`` interpolations give the same job (OmegaConf's resolvers such as
``${oc.env:...}`` are not available there).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_core._checks import FieldValueError
from ppo_core._config_base import ConfigBase
from ppo_core.trainer.presets import PRESETS, apply_preset, preset_overridden
from ppo_core_cli.config import JobConfig, worker_config_classes

__all__ = ["dump_job_config", "load_job_config", "parse_overrides"]

logger = logging.getLogger(__name__)


def _config_class(tp: Any) -> type[ConfigBase] | None:
    """The ConfigBase class an annotation holds (``X`` or ``X | None``), else None."""
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _config_class(arg)
            if found is not None:
                return found
    return None


def _dict_value_class(tp: Any) -> type[ConfigBase] | None:
    """``X`` for a ``dict[str, X]`` annotation whose values are configs, else None."""
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        return _config_class(args[1]) if len(args) == 2 else None
    return None


def _check_keys(cls: type[ConfigBase], data: Mapping[str, Any], prefix: str, workers: str) -> None:
    """Raise ``ValueError`` naming the first key of ``data`` (at any depth) that ``cls`` has no field for."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            where = f" under {prefix[:-1]}" if prefix else ""
            raise FieldValueError(
                path, f"; valid keys{where}: {', '.join(sorted(fields))}", before="unknown config key "
            )
        if not isinstance(value, Mapping):
            continue
        if path in ("actor.worker", "critic.worker"):
            actor_cls, critic_cls = worker_config_classes(workers)
            _check_keys(actor_cls if path == "actor.worker" else critic_cls, value, path + ".", workers)
        elif (sub := _config_class(hints[key])) is not None:
            _check_keys(sub, value, path + ".", workers)
        elif (item := _dict_value_class(hints[key])) is not None:
            for name, spec in value.items():
                if isinstance(spec, Mapping):
                    _check_keys(item, spec, f"{path}.{name}.", workers)


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """``(dotted key, value text)`` of each ``key=value`` override; a leading ``+`` (Hydra's "add") is dropped.

    Example:
        >>> parse_overrides(["trainer.seed=3", "+data.train_files=[a,b]"])
        [('trainer.seed', '3'), ('data.train_files', '[a,b]')]
    """
    out = []
    for text in overrides:
        key, sep, value = text.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ValueError(
                f"override {text!r} must be a dotted key, '=' and a YAML value, e.g. trainer.total_training_steps=5"
            )
        out.append((key, value))
    return out


def _have_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True


def _read_with_omegaconf(path: str | None, overrides: list[tuple[str, str]]) -> tuple[dict, Any]:
    """``(merged tree with interpolations unresolved, resolve())``."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    where = path if path is not None else "overrides"
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the config {where}: {exc}") from None
    if not OmegaConf.is_dict(base):
        raise TypeError(f"the config must be a mapping of sections, got a list ({where})")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides]))
    except OmegaConfBaseException as exc:
        raise ValueError(f"cannot apply the overrides {[f'{k}={v}' for k, v in overrides]}: {exc}") from None

    def resolve() -> dict:
        try:
            return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            raise FieldValueError(str(key), f": cannot resolve an interpolation: {exc.msg}") from None  # type: ignore[attr-defined]

    return OmegaConf.to_container(merged, resolve=False), resolve  # type: ignore[return-value]


def load_job_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job from a YAML file (or from the defaults when ``path`` is None) and ``key=value`` overrides.

    Args:
        path: the YAML file.
        overrides: Hydra-style ``dotted.key=value`` strings; values are parsed as YAML (``5``, ``1e-3``,
            ``true``, ``null``, ``[a,b]``); a leading ``+`` is accepted and ignored.

    Raises:
        ValueError / TypeError: naming the dotted key (unknown keys, wrong types, bad values, interpolations that
            do not resolve, an unknown ``preset``) or the malformed override.

    A ``preset`` (``ppo``, ``grpo``, ``rloo``: :mod:`ppo_core.trainer.presets`) fills in the algorithm's keys that
    the file and the overrides leave out.
        FileNotFoundError: ``path`` does not exist.
    """
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"config file {os.fspath(path)!r} does not exist")
    pairs = parse_overrides(overrides)
    file = os.fspath(path) if path is not None else None
    if _have_omegaconf():
        raw, resolve = _read_with_omegaconf(file, pairs)
    else:
        from ppo_core_cli import _plain_yaml

        raw, resolve = _plain_yaml.read(file, pairs)
    workers = raw.get("workers", "torch")
    if workers not in ("torch", "megatron"):
        raise FieldValueError("workers", f" {workers!r}; valid values: megatron, torch", before="unknown ")
    _check_keys(JobConfig, raw, "", workers)
    return JobConfig.from_dict(_with_preset(resolve()))


def _with_preset(tree: dict[str, Any]) -> dict[str, Any]:
    """The job's keys over its ``preset``'s (:mod:`ppo_core.trainer.presets`); the preset keys it overrides are
    logged."""
    name = tree.get("preset")
    if name is None:
        return tree
    if not isinstance(name, str) or name not in PRESETS:
        raise FieldValueError(
            "preset", f" {name!r}; valid values: {', '.join(sorted(PRESETS))}", before="unknown "
        )
    for key, preset_value, value in preset_overridden(name, tree):
        logger.info("preset %s: the job's %s=%r replaces the preset's %r", name, key, value, preset_value)
    return apply_preset(name, tree)


def dump_job_config(job: JobConfig, path: str | os.PathLike[str]) -> str:
    """Write ``job`` as YAML (every field, interpolations resolved) and return the path."""
    import yaml

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(_plain(job.to_dict()), f, sort_keys=False)
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
