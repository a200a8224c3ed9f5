"""Checkpoint folders of the trainer: layout, atomic publication, controller state and RNG capture.

Layout under the checkpoint root (verl's, plus the controller state verl does not save)::

    root/global_step_{k}/actor/            written by the actor workers' save_checkpoint
    root/global_step_{k}/critic/           written by the critic workers (if any)
    root/global_step_{k}/trainer_state.pt  step, dataloader position, KL controller, RNG states, config
    root/latest_checkpointed_iteration.txt k

A checkpoint is written into ``global_step_{k}.tmp`` and renamed when complete, and the ``latest`` file is
replaced atomically afterwards, so a crash mid-save never damages the previous checkpoint.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "LATEST_FILE",
    "capture_rng_state",
    "checkpoint_dir",
    "find_latest_checkpoint",
    "load_trainer_state",
    "publish_checkpoint",
    "restore_rng_state",
    "save_trainer_state",
    "step_of_checkpoint",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


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
    """Read the controller state of the checkpoint folder ``path``."""
    file = os.path.join(os.fspath(path), STATE_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: {os.fspath(path)!r} is not a complete checkpoint")
    # RNG states hold numpy arrays and tuples, so the full unpickler is needed; only load your own checkpoints.
    return torch.load(file, weights_only=False)


def publish_checkpoint(tmp_path: str, root: str | os.PathLike[str], step: int) -> str:
    """Rename a finished ``tmp_path`` to ``root/global_step_{step}`` and point the ``latest`` file at it."""
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
