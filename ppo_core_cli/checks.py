"""What ``ppo-core train``, ``eval`` and ``sft`` check before anything loads: every named file and folder exists
(a model is a Hugging Face checkpoint directory, a GGUF file or a directory holding one), and the job's rules that the workers' defaults can still break (:meth:`~ppo_core_cli.config.JobConfig.check_before_run`).

Each failure is a ``FileNotFoundError`` or ``ValueError`` naming the dotted key and its value, which the command
prints as one ``ppo-core: error:`` line.
"""

from __future__ import annotations

import os

from ppo_core_cli.config import JobConfig
from ppo_core_cli.worker_kinds import worker_kind

__all__ = ["check_eval_inputs", "check_output_file", "check_sft_inputs", "check_train_inputs"]


def _checkpoint_dir(key: str, path: str) -> None:
    if os.path.isfile(path):  # a GGUF file was tried first (_model_source)
        raise FileNotFoundError(
            f"{key}={path!r} is a file, not a Hugging Face checkpoint directory (with its config.json) nor a GGUF "
            "file"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}={path!r}: no such directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = ""
        if os.path.isfile(os.path.join(path, "export", "config.json")):  # a run's folder
            hint = f"; it looks like a run's folder: its exported model is {os.path.join(path, 'export')!r}"
        elif os.path.isdir(os.path.join(path, "actor")):  # a training checkpoint (global_step_N) or its root
            hint = (
                "; it looks like a training checkpoint: `ppo-core export CHECKPOINT_DIR OUT_DIR` writes its actor "
                "as a Hugging Face directory (a run's {run_dir}/export already is one)"
            )
        raise FileNotFoundError(
            f"{key}={path!r} is not a Hugging Face checkpoint directory (no config.json in it) nor a GGUF file"
            f"{hint}"
        )


def _model_source(key: str, path: str) -> None:
    """A Hugging Face checkpoint directory, or a GGUF file (or a directory holding one: converted later)."""
    from ppo_core_cli.convert import find_gguf_file

    try:
        gguf_file = find_gguf_file(path)
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"{key}: {exc}") from None
    if gguf_file is None:
        _checkpoint_dir(key, path)


def _files(key: str, paths: list[str]) -> None:
    for i, path in enumerate(paths):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{key}[{i}]={path!r}: no such file")


def _model_inputs(job: JobConfig) -> None:
    model = job.model
    if not model.path:
        raise ValueError("model.path must name a Hugging Face checkpoint directory or a GGUF file")
    if model.init_shape is None:
        _model_source("model.path", model.path)
    elif not os.path.isfile(os.path.join(model.path, "config.json")) and not model.tokenizer_path:
        raise ValueError("model.init_shape needs model.tokenizer_path (where the tokenizer files are)")
    if model.tokenizer_path and not os.path.isdir(model.tokenizer_path):
        raise FileNotFoundError(f"model.tokenizer_path={model.tokenizer_path!r}: no such directory")


def _device(job: JobConfig) -> None:
    """A kind of workers that trains on CUDA only (:attr:`WorkerKind.needs_cuda`) has CUDA here."""
    if not worker_kind(job.workers).needs_cuda:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"workers={job.workers} needs CUDA (its training engine allocates its buffers on the GPU), and "
            "torch.cuda.is_available() is False here; use workers=torch on this machine"
        )


def _cuda_settings(job: JobConfig) -> None:
    """Settings that need CUDA (the rollout engine's ``cuda_graphs=true``) have it here: said before anything loads,
    not at the first generation inside a worker."""
    settings = job.rollout.engine_config
    if getattr(settings, "cuda_graphs", None) is not True:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "rollout.engine_config.cuda_graphs=true captures the decode steps as CUDA graphs, and "
            "torch.cuda.is_available() is False here; leave it unset (graphs wherever CUDA runs) or false"
        )


def _attention(job: JobConfig) -> None:
    """``model.attn_implementation`` is one ``transformers`` knows (``eager`` or a registered attention function),
    and a FlashAttention one has its package installed: said before anything loads, not by ``transformers`` inside a
    worker."""
    name = job.model.attn_implementation
    if name is None or not worker_kind(job.workers).loads_with_attn_implementation:
        return
    try:
        from transformers import AttentionInterface
    except ImportError:  # the model cannot load anyway: transformers says so there
        return
    known = sorted({"eager", *AttentionInterface._global_mapping.keys()})
    base = name.removeprefix("paged|")  # transformers' paged variants of the same functions
    if "/" in base:  # a hub kernel (org/repo[:function]): transformers fetches and checks it
        return
    if name not in known and base not in known:
        raise ValueError(
            f"unknown model.attn_implementation {name!r}; valid values: {', '.join(known)} (or a hub kernel, "
            "org/repo)"
        )
    version = {"flash_attention_2": 2, "flash_attention_3": 3, "flash_attention_4": 4}.get(base)
    if version is not None:
        import transformers.utils as tf_utils

        available = getattr(tf_utils, f"is_flash_attn_{version}_available", lambda: True)
        if not available():
            raise ValueError(
                f"model.attn_implementation={name} needs the FlashAttention {version} package (and a CUDA GPU), not "
                "available here; use sdpa (the default) or eager"
            )


def _resume_path(job: JobConfig) -> None:
    """With ``trainer.resume_mode=path``, ``trainer.resume_from_path`` is a checkpoint folder (``global_step_<k>``
    holding the trainer's state): said before anything loads (whether its files are intact is checked when the run
    opens it)."""
    t = job.trainer
    if t.resume_mode != "path":
        return
    path = t.resume_from_path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trainer.resume_from_path {path!r} does not exist (or is not a folder)")
    from ppo_core.trainer.checkpoint import STATE_FILE

    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise ValueError(
            f"trainer.resume_from_path {path!r} is not a checkpoint folder (no {STATE_FILE}); name a "
            "global_step_<k> folder under the run's checkpoints"
        )


def check_train_inputs(job: JobConfig) -> None:
    """The model, tokenizer and critic directories and the prompt files of ``job`` exist; the mini-batch rules
    hold with the workers' defaults; a checkpoint named to resume from is one; settings that need CUDA have it.
    Raises naming the key (see the module docstring)."""
    _model_inputs(job)
    if job.model.critic_path and job.use_critic:
        _model_source("model.critic_path", job.model.critic_path)
    if not job.data.train_files:
        raise ValueError("data.train_files must name at least one prompt file")
    _files("data.train_files", job.data.train_files)
    _files("data.val_files", job.data.val_files)
    job.check_before_run()
    _device(job)
    _attention(job)
    _cuda_settings(job)
    _resume_path(job)


def check_eval_inputs(job: JobConfig) -> None:
    """The model and tokenizer directories and the validation prompt files of ``job`` exist (the critic and the
    training prompts are not used); the mini-batch rules hold with the workers' defaults."""
    _model_inputs(job)
    if not job.data.val_files:
        raise ValueError("data.val_files must name the prompts to evaluate on (none given)")
    _files("data.val_files", job.data.val_files)
    job.check_before_run()
    _device(job)
    _attention(job)


def check_output_file(option: str, path: str | None) -> None:
    """A file the command writes at its end (``--json``, ``--timings-json``) can be written there: not an existing
    folder, and its parent (created when missing) not a file. Checked first, so a run is not lost to a bad path."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a directory; name the file to write")
    _check_parent(option, path)


def check_output_dir(name: str, path: str) -> None:
    """A folder the command writes (``export``'s ``OUT_DIR``) can be made there: not an existing file, and no file
    on the way to it. Checked first, so nothing loads for a bad path."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a file, not a folder")
    _check_parent(name, path)


def _check_parent(name: str, path: str) -> None:
    """The nearest existing folder above ``path`` (the command creates the rest) is a folder, not a file."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{name} {path!r}: {parent!r} is a file, not a folder")


def check_sft_inputs(job: JobConfig) -> None:
    """The warm-up's starting checkpoint (a Hugging Face directory or a GGUF file) and pair files exist."""
    sft = job.sft
    if not sft.model_path:
        raise ValueError("sft.model_path must name a Hugging Face checkpoint directory or a GGUF file")
    _model_source("sft.model_path", sft.model_path)
    if not sft.files:
        raise ValueError("sft.files must name at least one file of prompt/response pairs")
    _files("sft.files", sft.files)
