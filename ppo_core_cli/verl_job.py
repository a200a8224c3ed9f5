"""``ppo-core convert-verl``: a verl config in, a runnable ``ppo-core`` job out.

verl users keep what they have: verl's composed config (``python -m verl.trainer.main_ppo --cfg job`` output,
``_generated_ppo_trainer.yaml``), verl's ``ppo_trainer.yaml`` with its ``defaults:`` list, or a file of overrides,
plus the ``key=value`` overrides of their launch script. :func:`job_from_verl` converts them with
:func:`ppo_core.compat.convert_verl` and completes the job around the trainer's settings: the prompt files,
``max_prompt_length`` and model paths, the backend (``monarch`` for more than one GPU) and the workers
(``megatron`` for verl's megatron strategy). :func:`write_job` writes the job as YAML with a comment block that
counts the keys and lists every dropped one with its reason.

:func:`verl_sections` tells a verl config from a job, so that ``ppo-core train verl.yaml`` can say how to convert.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppo_core.compat import VerlConversion, convert_verl
from ppo_core_cli.aliases import canonical_job_tree
from ppo_core_cli.config import JobConfig

__all__ = ["ConvertedJob", "job_from_verl", "verl_sections", "write_job"]

_VERL_ONLY_SECTIONS = (
    "actor_rollout_ref",
    "reward_model",
    "custom_reward_function",
    "ray_kwargs",
    "global_profiler",
    "distillation",
    "transfer_queue",
)
"""Top-level sections of verl's config that a ``ppo-core`` job does not have."""

_ORDER = ("backend", "workers", "model", "data", "rollout", "algorithm", "actor", "critic", "trainer")


@dataclass(frozen=True)
class ConvertedJob:
    """A verl config as a ``ppo-core`` job."""

    settings: dict[str, Any]
    """The job as a nested dict (what :func:`write_job` writes; ``JobConfig.from_dict`` reads it)."""
    job: JobConfig
    """The checked job."""
    conversion: VerlConversion
    """Where each verl key went (mapped, quiet, dropped)."""
    notes: tuple[str, ...] = ()
    """Things to do before ``ppo-core train`` (a model path that is not a local folder, a missing prompt file)."""


def verl_sections(raw: Mapping[str, Any]) -> list[str]:
    """The top-level sections of ``raw`` that only a verl config has (empty for a ppo-core job)."""
    return [name for name in _VERL_ONLY_SECTIONS if name in raw]


def job_from_verl(
    cfg: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = ()
) -> ConvertedJob:
    """Convert a verl config (file or mapping) and verl-style ``key=value`` overrides into a ``ppo-core`` job.

    Raises:
        ValueError: the keys ppo-core cannot honour, each with its reason (see :func:`convert_verl`), or a value the
            job rejects, named by its key.
        FileNotFoundError: the file, or one its ``defaults:`` list names, does not exist.
    """
    conversion = convert_verl(cfg, overrides)
    settings = _job_settings(conversion)
    try:
        job = JobConfig.from_dict(settings)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the converted verl config is not a valid ppo-core job: {err}") from err
    return ConvertedJob(settings=settings, job=job, conversion=conversion, notes=tuple(_notes(job)))


def _job_settings(conversion: VerlConversion) -> dict[str, Any]:
    # the trainer's settings as a job's (the worker's use_kl_loss is actor.use_kl_loss alone)
    tree = canonical_job_tree(_plain(conversion.settings), warn=False)
    workers = "megatron" if conversion.strategy == "megatron" else "torch"
    for role in ("actor", "critic"):  # the command sets the checkpoint from model.path / model.critic_path
        tree.get(role, {}).get("worker", {}).pop("hf_checkpoint", None)
    world = max(tree.get("actor", {}).get("world_size", 1), tree.get("critic", {}).get("world_size", 1))
    tree["backend"] = "monarch" if world > 1 else "local"
    tree["workers"] = workers
    return {key: tree[key] for key in (*_ORDER, *sorted(set(tree) - set(_ORDER))) if key in tree}


def _notes(job: JobConfig) -> list[str]:
    notes = []
    if not os.path.isdir(job.model.path):
        notes.append(
            f"model.path {job.model.path!r} is not a local folder: ppo-core loads local checkpoints only; download "
            "the model and set model.path"
        )
    for name in ("train_files", "val_files"):
        missing = [f for f in getattr(job.data, name) if not os.path.exists(f)]
        if missing:
            notes.append(f"data.{name}: {', '.join(missing)} not found")
    if job.backend == "monarch":
        notes.append(
            f"{job.actor.world_size} GPUs (trainer.nnodes x trainer.n_gpus_per_node): backend monarch; for one "
            "process set actor.world_size=1 critic.world_size=1 backend=local"
        )
    return notes


def write_job(converted: ConvertedJob, path: str | os.PathLike[str] | None, source: str) -> str:
    """The job as YAML, headed by a comment block (the counts and every dropped key); written to ``path`` if
    given. ``source`` is how the input is named in the header (the file and its overrides)."""
    import yaml

    c = converted.conversion
    lines = [
        "# ppo-core job converted from a verl config by `ppo-core convert-verl`",
        f"#   from: {source}",
        f"#   {c.total} verl keys: {len(c.mapped)} mapped, {len(c.quiet)} at verl's defaults or switched off, "
        f"{len(c.dropped)} dropped",
    ]
    if c.dropped:
        lines.append("#   dropped (they do not change what is computed):")
        lines += [f"#     {key}: {reason}" for key, reason in c.dropped.items()]
    for note in converted.notes:
        lines.append(f"#   note: {note}")
    lines.append("")
    text = "\n".join(lines) + "\n" + yaml.safe_dump(converted.settings, sort_keys=False)
    if path is not None:
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
