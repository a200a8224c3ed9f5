"""``ppo-core export``: the actor of a saved training checkpoint as a Hugging Face directory.

A checkpoint (``global_step_k/``, or the checkpoint root: its newest intact checkpoint) holds the trainer's config,
whose ``actor.worker`` says how to read the actor's rank files:

- megatron workers (the worker dict has a ``model`` shape and a ``parallel`` layout): the TP shards of each
  pipeline stage are merged (:func:`ppo_core.workers.megatron.export.export_megatron_actor`); the Hugging Face config
  and tokenizer come from the worker's ``hf_checkpoint`` when the run started from one;
- torch workers: ``rank_0.pt`` is the state dict of the Hugging Face model the run started from
  (:func:`ppo_core.models.export_actor_checkpoint`), found in the ``job.yaml`` the command writes next to the
  checkpoints, or given as ``model_dir``.

:func:`export_actor_weights` does the same for any folder of rank files given the actor's worker settings (the
end of ``ppo-core train`` exports the weights its workers just wrote, without an optimizer checkpoint).

The written directory loads with ``AutoModelForCausalLM.from_pretrained`` and gives the trained actor's logits.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ppo_core.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from ppo_core_cli.tokens import SpecialTokens

__all__ = [
    "JOB_FILE",
    "export_actor_weights",
    "export_checkpoint",
    "resolve_checkpoint",
    "write_generation_ids",
]

logger = logging.getLogger(__name__)

JOB_FILE = "job.yaml"
"""Written by ``ppo-core train`` into the checkpoint root: the job, for exports of its checkpoints."""


def resolve_checkpoint(path: str | os.PathLike[str]) -> str:
    """``path`` itself when it is a ``global_step_k`` folder, else the newest checkpoint under it.

    Raises:
        FileNotFoundError: no checkpoint there.
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, ckpt.STATE_FILE)):
        return path
    latest = ckpt.find_latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path!r} is neither a checkpoint folder (global_step_k with {ckpt.STATE_FILE}) nor a directory of them"
        )
    return latest


def _job_model_dir(step_dir: str) -> str | None:
    job_file = os.path.join(os.path.dirname(os.path.normpath(step_dir)), JOB_FILE)
    if not os.path.isfile(job_file):
        return None
    from ppo_core_cli.loading import load_job_config

    return load_job_config(job_file).model.path or None


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_dir: str | None = None,
    dtype: str | None = None,
    verify: bool = True,
) -> str:
    """Export the actor of ``checkpoint`` to ``out_dir`` (see the module docstring).

    Args:
        checkpoint: a ``global_step_k`` folder or a checkpoint root.
        out_dir: the Hugging Face directory to write.
        model_dir: the checkpoint the run started from (torch workers; default: from ``job.yaml``).
        dtype: dtype of the written weights (``bfloat16``...); None: as trained.
        verify: check every file against the checkpoint's manifest first (one more read of every file).

    Returns:
        ``out_dir`` as a string.
    """
    step_dir = resolve_checkpoint(checkpoint)
    state = ckpt.open_checkpoint(step_dir) if verify else ckpt.load_trainer_state(step_dir)
    config: dict[str, Any] = state.get("config") or {}
    worker = (config.get("actor") or {}).get("worker") or {}
    out = export_actor_weights(
        os.path.join(step_dir, "actor"),
        out_dir,
        actor_worker=worker,
        # the model the run started from: named, in the job next to the checkpoint, or (torch workers) in its config
        model_dir=model_dir or _job_model_dir(step_dir) or worker.get("hf_checkpoint"),
        dtype=dtype,
    )
    logger.info("exported the actor of %s to %s", step_dir, out)
    return out


def export_actor_weights(
    actor_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    actor_worker: dict[str, Any],
    model_dir: str | None = None,
    dtype: str | None = None,
) -> str:
    """Export the rank files of an actor (``rank_<r>.pt`` with a ``model`` state dict: a worker checkpoint, or
    what ``save_weights`` writes) given the actor's worker settings.

    Args:
        actor_dir: the folder of rank files.
        out_dir: the Hugging Face directory to write.
        actor_worker: the worker dict the actor was built with (megatron: its ``model`` shape, ``parallel`` layout
            and ``hf_checkpoint``).
        model_dir: torch workers: the Hugging Face checkpoint the actor was loaded from.
        dtype: dtype of the written weights; None: as trained.
    """
    if isinstance(actor_worker.get("model"), dict):
        return _export_megatron(os.fspath(actor_dir), out_dir, actor_worker, dtype)
    if model_dir is None:
        raise ValueError(
            f"cannot tell which model {os.fspath(actor_dir)!r} was trained from: no {JOB_FILE} next to the "
            "checkpoint; pass model_dir (ppo-core export --model-dir DIR)"
        )
    from ppo_core.models import export_actor_checkpoint

    return export_actor_checkpoint(actor_dir, model_dir, out_dir, dtype=dtype)


def _export_megatron(
    actor_dir: str, out_dir: str | os.PathLike[str], worker: dict[str, Any], dtype: str | None
) -> str:
    from ppo_core.workers.megatron.config import MegatronModelConfig, ParallelConfig
    from ppo_core.workers.megatron.export import export_megatron_actor

    model = MegatronModelConfig.from_dict(worker["model"])
    parallel = ParallelConfig.from_dict(worker.get("parallel") or {})
    base = worker.get("hf_checkpoint")
    hf_config = None
    if base and os.path.isfile(os.path.join(base, "config.json")):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(base, local_files_only=True)
    return export_megatron_actor(
        actor_dir,
        out_dir,
        model_config=model,
        parallel=parallel,
        hf_config=hf_config,
        tokenizer_dir=base if hf_config is not None else None,
        dtype=dtype,
    )


def write_generation_ids(out_dir: str | os.PathLike[str], tokens: SpecialTokens) -> str:
    """Set the EOS and padding ids of ``{out_dir}/generation_config.json`` (created when missing) to ``tokens``:
    ``model.generate`` on the export then stops where the run's sampling stopped. Returns the file's path."""
    from transformers import GenerationConfig

    out = os.fspath(out_dir)
    try:
        config = GenerationConfig.from_pretrained(out, local_files_only=True)
    except OSError:
        config = GenerationConfig()
    config.eos_token_id, config.pad_token_id = tokens.eos_token_id, tokens.pad_token_id
    config.save_pretrained(out)
    return os.path.join(out, "generation_config.json")
