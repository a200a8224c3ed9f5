"""The job's config reference, built from the config dataclasses themselves so that it cannot go stale.

Every key of a :class:`~ppo_core_cli.config.JobConfig` (nested sections, the worker configs ``actor.worker`` and
``critic.worker`` through the chosen workers' config class, the ``reward.scorers`` entries) with its type, value and
help: the field's docstring, read from the class's source with :mod:`ast` (once per class). The actor worker's
``rollout`` and ``use_kl_loss`` are shown where the job sets them (``rollout``, ``actor.use_kl_loss``).

- :func:`render_yaml`: a job as YAML with every default filled in and a ``#`` comment of help above each key
  (``ppo-core config JOB.yaml [overrides]``, ``ppo-core config --defaults``). Keys the run sets itself (the worker
  config's ``RUN_KEYS``, e.g. the megatron model shape from ``model.path``) appear as comments, so the output is
  itself a job that ``ppo-core train`` runs the same way.
- :func:`render_markdown`: the reference page ``docs/config-reference.md`` (``ppo-core config --markdown``), with
  the worker keys of each kind of workers.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ppo_core._config_base import ConfigBase
from ppo_core.rollout.registry import rollout_engine_config
from ppo_core_cli.config import JobConfig
from ppo_core_cli.worker_kinds import worker_kind, worker_kind_names

__all__ = ["ConfigKey", "config_keys", "field_help", "render_markdown", "render_yaml"]

REGENERATE = "ppo-core config --markdown > docs/config-reference.md"
"""The command that writes the reference page."""

_WORKER_SECTIONS = ("actor.worker", "critic.worker")
_WIDTH = 110


@dataclass(frozen=True)
class ConfigKey:
    """One key of a job: a value (a leaf) or a section (a nested config)."""

    path: str
    """Dotted key, e.g. ``trainer.total_training_steps``."""
    name: str
    """The last part of the key (a ``reward.scorers`` pattern may hold dots)."""
    depth: int
    """Sections above the key (0: top level)."""
    type: str
    """The annotation, as text (``int``, ``"a" | "b"``, ``str | None``...)."""
    value: Any
    """The value (for a section: None)."""
    help: str
    """The field's docstring on one line."""
    section: bool = False
    """Whether this is a nested config whose keys follow."""
    comment: str = ""
    """Why the key is shown as a comment in :func:`render_yaml` (the command sets it, or writing the default would
    change the job), or empty."""
    value_known: bool = True
    """Whether ``value`` is what the run uses (False where the command sets it)."""


# ----- help text from the source ------------------------------------------------------------------------------------
@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of the annotated assignments in ``cls``'s own body that a string literal follows."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    docs = {}
    for stmt, after in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = after.value.value
    return docs


def field_help(cls: type, name: str) -> str:
    """The docstring of field ``name`` of ``cls`` (from the class that declares it last), on one line; '' if none.

    Example:
        >>> from ppo_core.trainer.config import TrainerConfig
        >>> field_help(TrainerConfig, "total_epochs")[:6]
        'Passes'
    """
    for klass in cls.__mro__:
        doc = _own_field_docs(klass).get(name)
        if doc is not None:
            return _one_line(doc)
    return ""


_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def _one_line(doc: str) -> str:
    """A docstring as one line of Markdown: whitespace collapsed, reST roles and literals as code spans."""
    text = " ".join(doc.split())
    text = _ROLE.sub(
        lambda m: f"`{m.group(1).rpartition('.')[2] if '~' in m.group(0) else m.group(1)}`", text
    )
    return text.replace("``", "`")


# ----- the keys of a job --------------------------------------------------------------------------------------------
def _config_class(tp: Any) -> type[ConfigBase] | None:
    if isinstance(tp, type) and issubclass(tp, ConfigBase):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if (found := _config_class(arg)) is not None:
                return found
    return None


def _type_text(tp: Any) -> str:
    """An annotation as short text: ``int``, ``str | None``, ``"a" | "b"``, ``list[str]``, ``dict[str, Any]``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else _type_text(a) for a in args)
        return f"{name}[{inner}]"
    return getattr(tp, "__name__", str(tp))


_RUN_SOURCES = {
    "model.dtype": "model.dtype",
    "value_head_init_std": "model.value_head_init_std",
    "value_head_seed": "model.init_seed",
}
_FOLLOWS = {"rollout": "rollout", "use_kl_loss": "actor.use_kl_loss"}
"""The actor worker's keys that follow a canonical key of the job: not shown under the worker."""


def _worker_notes(job: JobConfig, role: str) -> dict[str, tuple[str, bool]]:
    """``{key under the worker section: (why it is a comment, whether its value is known)}``."""
    worker = getattr(job, role).worker
    notes = {
        key: ("set by the run from " + _RUN_SOURCES.get(key, "model.path's config.json"), False)
        for key in worker.RUN_KEYS
    }
    if not job._gives(role, "ppo_mini_batch_size"):  # written out, the default would have to divide the rows
        notes["ppo_mini_batch_size"] = (
            "not set: the worker's default; it must divide data.train_batch_size x rollout.n to run",
            True,
        )
    return notes


def _keys(
    cls: type[ConfigBase],
    value: ConfigBase,
    prefix: str,
    notes: Mapping[str, tuple[str, bool]],
    job: JobConfig | None,
    depth: int = 0,
) -> Iterator[ConfigKey]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path, tp, v = f"{prefix}{f.name}", hints[f.name], getattr(value, f.name)
        text, doc = _type_text(tp), field_help(cls, f.name)
        relative = path.split(".", 2)[2] if path.startswith(_WORKER_SECTIONS) and path.count(".") >= 2 else ""
        if path == "actor.worker." + f.name and f.name in _FOLLOWS:
            continue  # shown at its canonical key
        sub = _config_class(tp)
        if job is not None and path in _WORKER_SECTIONS:
            role = path.partition(".")[0]
            yield ConfigKey(path, f.name, depth, type(v).__name__, None, doc, section=True)
            yield from _keys(type(v), v, path + ".", _worker_notes(job, role), None, depth + 1)
        elif sub is not None and v is not None:
            sub = type(v) if isinstance(v, sub) else sub  # a subclass's keys (the named engine's settings)
            yield ConfigKey(path, f.name, depth, sub.__name__, None, doc, section=True)
            yield from _keys(sub, v, path + ".", notes, job, depth + 1)
        elif (
            typing.get_origin(tp) is dict
            and (item := _config_class(typing.get_args(tp)[1])) is not None
            and isinstance(v, Mapping)
            and v
        ):
            yield ConfigKey(path, f.name, depth, text, None, doc, section=True)
            for name, spec in v.items():
                yield ConfigKey(f"{path}.{name}", name, depth + 1, item.__name__, None, "", section=True)
                yield from _keys(item, spec, f"{path}.{name}.", notes, job, depth + 2)
        else:
            comment, known = notes.get(relative, ("", True))
            yield ConfigKey(path, f.name, depth, text, v, doc, comment=comment, value_known=known)


def config_keys(job: JobConfig) -> list[ConfigKey]:
    """Every key of ``job`` in field order, sections before their keys; the worker sections expanded through the
    job's workers' config classes (every worker default filled in)."""
    return list(_keys(JobConfig, job, "", {}, job))


# ----- YAML ---------------------------------------------------------------------------------------------------------
def _yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (flow style for lists and mappings)."""
    import yaml

    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=float("inf"), sort_keys=False).strip()
    return text.removesuffix("\n...").strip()


def _plain(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return _plain(value.to_dict())
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _comment(text: str, indent: str) -> list[str]:
    plain = text.replace("`", "")
    return textwrap.wrap(
        plain, _WIDTH - len(indent) - 2, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "
    )


def render_yaml(job: JobConfig, *, help: bool = True) -> str:
    """``job`` as YAML: every key with its value (defaults included) and, with ``help``, its help as a comment above
    it. Keys the command sets itself are comments saying so. Loading the text back gives the same job."""
    lines: list[str] = []
    for key in config_keys(job):
        indent = "  " * key.depth
        if help and key.help:
            lines.extend(_comment(key.help, indent))
        name = _yaml_value(key.name)  # quoted where YAML needs it (a scorer pattern such as *gsm8k*)
        if key.section:
            lines.append(f"{indent}{name}:")
        elif key.comment:  # the command sets it, or writing the value down would change the job
            shown = f"{_yaml_value(key.value)} " if key.value_known else ""
            lines.append(f"{indent}# {name}: {shown}({key.comment})")
        else:
            lines.append(f"{indent}{name}: {_yaml_value(key.value)}")
    return "\n".join(_close_empty_sections(lines)) + "\n"


def _close_empty_sections(lines: list[str]) -> list[str]:
    """A section whose keys are all comments needs ``{}`` to stay a mapping when read back."""
    out = list(lines)
    for i, line in enumerate(out):
        if not line.endswith(":") or line.lstrip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        children = [other for other in _block(out, i + 1, depth) if not other.lstrip().startswith("#")]
        if not children:
            out[i] = line + " {}"
    return out


def _block(lines: list[str], start: int, depth: int) -> Iterator[str]:
    for line in lines[start:]:
        if len(line) - len(line.lstrip()) <= depth:
            return
        yield line


# ----- Markdown -----------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(keys: list[ConfigKey], strip: str) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in keys:
        if key.section:
            continue
        name = key.path.removeprefix(strip)
        default = f"`{_yaml_value(key.value)}`" if key.value_known else f"*{key.comment}*"
        rows.append(f"| `{name}` | `{_cell(key.type)}` | {_cell(default)} | {_cell(key.help)} |")
    return rows


def render_markdown() -> str:
    """The reference page: one table per section of a default job, the worker sections once per kind of workers."""
    defaults = JobConfig.from_dict({})
    keys = config_keys(defaults)
    top = [k for k in keys if k.depth == 0]
    out = [
        "# Config reference",
        "",
        f"<!-- generated by `{REGENERATE}` from the config classes' field docstrings; do not edit -->",
        "",
        "Every key of a `ppo-core` job (`ppo-core train JOB.yaml [key=value ...]`) with its type, default and help.",
        "`ppo-core config JOB.yaml [key=value ...]` prints a job with every default filled in and this help as",
        "comments; `ppo-core config --defaults` prints the defaults. Keys are dotted paths: `trainer.seed: 1` in",
        "the YAML file is `trainer.seed=1` on the command line.",
        "",
        "## Top-level keys",
        "",
        *_table([k for k in top if not k.section], ""),
    ]
    for section in (k for k in top if k.section):
        out += ["", f"## `{section.path}`", "", section.help, ""]
        inner = [
            k
            for k in keys
            if k.path.startswith(section.path + ".")
            and not k.path.startswith(tuple(w + "." for w in _WORKER_SECTIONS))
        ]
        out += _table(inner, section.path + ".")
        worker = f"{section.path}.worker"
        if worker in _WORKER_SECTIONS:
            out += _worker_tables(worker, next(k for k in keys if k.path == worker).help)
        if section.path == "reward":
            out += ["", *_scorer_table()]
        if section.path == "rollout":
            out += _engine_tables()
    out += [
        "",
        "## `monarch` keys",
        "",
        "The keys of the `monarch` mapping (`backend: monarch`):",
        "",
        *_monarch_table(),
    ]
    return "\n".join(out) + "\n"


def _worker_tables(path: str, help: str) -> list[str]:
    out = [
        "",
        f"`{path}`: {help} Its keys depend on `workers` and are checked against the workers' config class when the "
        "job is read:",
    ]
    for workers in worker_kind_names():
        job = JobConfig.from_dict({"workers": workers})
        keys = [k for k in config_keys(job) if k.path.startswith(path + ".")]
        cls = next(k for k in config_keys(job) if k.path == path).type
        about = worker_kind(workers).description
        title = f"### `{path}` with `workers: {workers}` (`{cls}`{': ' + about if about else ''})"
        out += ["", title, "", *_table(keys, path + ".")]
    return out


def _engine_tables() -> list[str]:
    """The settings of each built-in rollout engine (``rollout.engine_config`` with ``rollout.engine: NAME``)."""
    out = [
        "",
        "`rollout.engine_config`: the settings of the engine `rollout.engine` names (its config class, checked when "
        "the job is read; `auto` takes none). An engine you register brings its own class "
        "(`ppo_core.rollout.registry`).",
    ]
    for name in ("reference", "hf", "megatron"):
        workers = "megatron" if name == "megatron" else "torch"
        job = JobConfig.from_dict({"rollout": {"engine": name}, "workers": workers})
        keys = [k for k in config_keys(job) if k.path.startswith("rollout.engine_config.")]
        cls = rollout_engine_config(name)
        title = f"### `rollout.engine_config` with `engine: {name}` (`{cls.__name__}`)"
        doc = _one_line(inspect.getdoc(cls) or "")
        out += ["", title, "", doc]
        out += ["", *_table(keys, "rollout.engine_config.")] if keys else []
    return out


def _scorer_table() -> list[str]:
    from ppo_core_cli.config import ScorerConfig

    job = JobConfig.from_dict({"reward": {"scorers": {"PATTERN": {}}}})
    keys = [k for k in config_keys(job) if k.path.startswith("reward.scorers.PATTERN.")]
    return [
        f"### `reward.scorers.PATTERN` (`{ScorerConfig.__name__}`, one entry per `data_source` pattern)",
        "",
        *_table(keys, "reward.scorers.PATTERN."),
    ]


def _monarch_table() -> list[str]:
    keys = list(_keys(_monarch_config_class(), _monarch_config_class()(), "", {}, None))
    return _table(keys, "")


@functools.cache
def _monarch_config_class() -> type[ConfigBase]:
    """``ppo_core_monarch.config.MonarchConfig`` (read from its file: importing the package imports Monarch, which
    the page must not need)."""
    import importlib.util
    import os
    import sys

    import ppo_core_cli

    name = "ppo_core_monarch.config"
    if name in sys.modules:
        return sys.modules[name].MonarchConfig
    path = os.path.join(os.path.dirname(os.path.dirname(ppo_core_cli.__file__)), *name.split(".")) + ".py"
    spec = importlib.util.spec_from_file_location("_ppo_core_monarch_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass machinery looks its module up
    spec.loader.exec_module(module)
    return module.MonarchConfig
