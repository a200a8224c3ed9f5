"""Checkpoint folders of the trainer: layout, atomic publication, integrity, rotation, RNG capture.

Layout under the checkpoint root (verl's, plus the controller state and the manifest verl does not write)::

    root/global_step_{k}/actor/            written by the actor workers' save_checkpoint
    root/global_step_{k}/critic/           written by the critic workers (if any)
    root/global_step_{k}/trainer_state.pt  step, dataloader position, KL controller, RNG states, config
    root/global_step_{k}/manifest.json     size and SHA-256 of every other file (see ppo_core.trainer.manifest)
    root/latest_checkpointed_iteration.txt k

A checkpoint is written into ``global_step_{k}.tmp``, its manifest last, and renamed when complete; the ``latest``
file is replaced atomically afterwards, so a crash mid-save never damages the previous checkpoint. Leftovers of an
interrupted save (``*.tmp`` folders) are removed by :func:`remove_stale_saves` when the trainer resumes or saves,
and :func:`prune_checkpoints` keeps the newest ``k``.

Resuming opens a checkpoint with :func:`open_checkpoint` (manifest first, then the trainer state; every error names
the file); :func:`find_intact_checkpoint` falls back to the newest intact one when the latest is damaged.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ppo_core.trainer.manifest import MANIFEST_FILE, CheckpointCorruptError, verify_manifest, write_manifest

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "CheckpointCorruptError",
    "capture_rng_state",
    "checkpoint_dir",
    "find_intact_checkpoint",
    "find_latest_checkpoint",
    "load_trainer_state",
    "open_checkpoint",
    "prune_checkpoints",
    "publish_checkpoint",
    "remove_stale_saves",
    "restore_rng_state",
    "save_trainer_state",
    "step_of_checkpoint",
]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER = re.compile(r"^global_step_(\d+)\.(tmp|old)$")
_STATE_KEYS = ("global_steps", "dataloader", "rng")


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> str:
    """``root/global_step_{step}``.

    Example:
        >>> checkpoint_dir("ckpt", 7)
        'ckpt/global_step_7'
    """
    return os.path.join(os.fspath(root), f"global_step_{int(step)}")


def step_of_checkpoint(path: str | os.PathLike[str]) -> int:
    """The step encoded in a ``global_step_{k}`` folder name; ``ValueError`` naming ``path`` otherwise.

    Example:
        >>> step_of_checkpoint("/x/global_step_12/")
        12
    """
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    match = _STEP_DIR.match(name)
    if match is None:
        raise ValueError(f"path must be a 'global_step_<k>' checkpoint folder, got {os.fspath(path)!r}")
    return int(match.group(1))


def find_latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The folder named by ``root/latest_checkpointed_iteration.txt`` if it exists, else the highest complete
    ``global_step_{k}`` folder with a trainer state, else None."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    latest = os.path.join(root, LATEST_FILE)
    if os.path.exists(latest):
        with open(latest, encoding="utf-8") as f:
            text = f.read().strip()
        if text.isdigit():
            path = checkpoint_dir(root, int(text))
            if os.path.exists(os.path.join(path, STATE_FILE)):
                return path
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.exists(os.path.join(root, name, STATE_FILE)):
            steps.append(int(match.group(1)))
    return checkpoint_dir(root, max(steps)) if steps else None


def capture_rng_state() -> dict[str, Any]:
    """The controller's global RNG states: torch (CPU and CUDA), numpy and python ``random``."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write the controller state into the (temporary) checkpoint folder ``path``."""
    os.makedirs(path, exist_ok=True)
    torch.save(dict(state), os.path.join(os.fspath(path), STATE_FILE))


def load_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the controller state of the checkpoint folder ``path``.

    Raises:
        FileNotFoundError: no ``trainer_state.pt`` (names the file).
        CheckpointCorruptError: the file is empty, truncated or not a pickled dict (names the file).
    """
    folder = os.fspath(path)
    file = os.path.join(folder, STATE_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: {folder!r} is not a complete checkpoint")
    # RNG states hold numpy arrays and tuples, so the full unpickler is needed; only load your own checkpoints.
    # Damage surfaces as EOFError, RuntimeError, UnpicklingError... depending on where the bytes went wrong.
    try:
        state = torch.load(file, weights_only=False)
    except Exception as exc:
        raise CheckpointCorruptError(
            f"cannot read the trainer state {file} ({os.path.getsize(file)} bytes): {type(exc).__name__}: {exc}",
            checkpoint=folder,
            file=file,
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointCorruptError(
            f"{file} holds a {type(state).__name__}, not the trainer state dict", checkpoint=folder, file=file
        )
    return state


def open_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify a ``global_step_{k}`` folder against its manifest, then read and check its trainer state.

    Nothing is loaded into a model before this returns, so a damaged checkpoint is refused whole.

    Returns:
        The trainer state (``global_steps``, ``dataloader``, ``rng``, ``kl_ctrl``, ``config``).

    Raises:
        CheckpointCorruptError: a file differs from the manifest, the state is unreadable, lacks a key, or holds
            another step than the folder's name (each message names the file and the checkpoint).
        FileNotFoundError: no ``trainer_state.pt`` in a checkpoint without manifest.
    """
    folder = os.fspath(path)
    step = step_of_checkpoint(folder)
    verify_manifest(folder)
    state = load_trainer_state(folder)
    file = os.path.join(folder, STATE_FILE)
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise CheckpointCorruptError(f"{file} lacks the key(s) {missing}", checkpoint=folder, file=file)
    if not isinstance(state["global_steps"], int) or state["global_steps"] != step:
        raise CheckpointCorruptError(
            f"{file} holds the state of step {state['global_steps']}, not {step}",
            checkpoint=folder,
            file=file,
        )
    return state


def _steps(root: str) -> list[int]:
    matches = (_STEP_DIR.match(name) for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))
    return sorted(int(m.group(1)) for m in matches if m is not None)


def _latest_step(root: str) -> int | None:
    latest = os.path.join(root, LATEST_FILE)
    if not os.path.exists(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        text = f.read().strip()
    return int(text) if text.isdigit() else None


def find_intact_checkpoint(root: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that opens cleanly (:func:`open_checkpoint`), with its state.

    Candidates, in order: the step named by ``latest_checkpointed_iteration.txt``, then the older steps, newest
    first (a folder of a higher step than the ``latest`` file names belongs to a run that was rewound, so it is
    not a fallback). Without a ``latest`` file every ``global_step_{k}`` folder is a candidate, newest first.
    Damaged candidates are skipped, and one warning names each with the reason.

    Returns:
        ``(path, state)``, or None when ``root`` holds no checkpoint.

    Raises:
        CheckpointCorruptError: every candidate is damaged (the message lists each and why).
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    steps = _steps(root)
    latest = _latest_step(root)
    if latest is not None and any(s <= latest for s in steps):
        candidates = sorted((s for s in steps if s <= latest), reverse=True)
    else:
        candidates = sorted(steps, reverse=True)
    skipped: list[str] = []
    if latest is not None and latest not in steps and candidates:
        skipped.append(f"{checkpoint_dir(root, latest)} is named by {LATEST_FILE} but does not exist")
    for step in candidates:
        path = checkpoint_dir(root, step)
        try:
            state = open_checkpoint(path)
        except (CheckpointCorruptError, FileNotFoundError) as exc:
            skipped.append(str(exc))  # every message names the checkpoint and the file
            continue
        if skipped:
            logger.warning(
                "resuming from %s, the newest intact checkpoint; skipped: %s", path, "; ".join(skipped)
            )
        return path, state
    if not candidates:
        return None
    raise CheckpointCorruptError(
        f"no intact checkpoint under {root}; tried, newest first:\n  "
        + "\n  ".join(skipped)
        + "\nRemove or repair them, resume from a good one (trainer.resume_mode=path trainer.resume_from_path=DIR), "
        "or start again without resuming (trainer.resume_mode=disable)",
        checkpoint=root,
    )


def publish_checkpoint(tmp_path: str, root: str | os.PathLike[str], step: int) -> str:
    """Write the manifest of a finished ``tmp_path``, rename it to ``root/global_step_{step}`` and point the
    ``latest`` file at it."""
    write_manifest(tmp_path)
    final = checkpoint_dir(root, step)
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp_path, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_path, final)
    latest = os.path.join(os.fspath(root), LATEST_FILE)
    with open(latest + ".tmp", "w", encoding="utf-8") as f:
        f.write(str(int(step)))
    os.replace(latest + ".tmp", latest)
    return final


def remove_stale_saves(root: str | os.PathLike[str]) -> list[str]:
    """Remove what interrupted saves left under ``root``; returns the removed paths.

    ``global_step_{k}.tmp`` folders (never published) are deleted. A ``global_step_{k}.old`` folder is the
    previous copy of a step being re-published: deleted when ``global_step_{k}`` exists, renamed back when the
    save died between the two renames. Nothing else under ``root`` is touched.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        match = _LEFTOVER.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path):
            continue
        final = checkpoint_dir(root, int(match.group(1)))
        if match.group(2) == "old" and not os.path.exists(final):
            os.replace(path, final)
            logger.warning("restored %s from %s (a save was interrupted while replacing it)", final, path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    stale_latest = os.path.join(root, LATEST_FILE + ".tmp")
    if os.path.exists(stale_latest):
        os.remove(stale_latest)
        removed.append(stale_latest)
    if removed:
        logger.info("removed leftovers of interrupted saves: %s", removed)
    return removed


def prune_checkpoints(root: str | os.PathLike[str], keep: int | None, newest: int) -> list[str]:
    """Delete old ``global_step_{k}`` folders so that the ``keep`` newest up to step ``newest`` remain.

    ``newest`` (the checkpoint just published) is always kept, and so is every step above it (those belong to a
    run that was rewound to an earlier checkpoint and are not this run's to delete). Returns the deleted folders;
    ``keep=None`` deletes nothing.
    """
    if keep is None:
        return []
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    root = os.fspath(root)
    older = [s for s in _steps(root) if s < newest]
    doomed = older[: max(0, len(older) - (keep - 1))]
    paths = [checkpoint_dir(root, s) for s in doomed]
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if paths:
        logger.info("removed checkpoints beyond max_ckpt_to_keep=%d: %s", keep, paths)
    return paths
