"""A few validation completions as text: the same prompts at every validation, logged and kept in a JSONL file.

Numbers say *that* a run improves; reading what the model writes says *how* (the answer format, where it stops,
whether it ends its turn). At each validation the first response to each of ``k`` fixed prompts (indices spread
evenly over the validation set, :func:`completion_indices`) is decoded with its special tokens (so an end-of-turn
token, or its absence at the length cap, shows), logged at ``INFO`` and appended to ``{log_dir}/completions.jsonl``,
one JSON object per completion: ``step``, ``index`` (the prompt's position in the validation set),
``data_source``, ``prompt``, ``response``, ``ground_truth``, ``score`` and the reward function's extra infos
(``acc``, ``format``, ``pred``...). A fresh run starts a new file; a resumed one drops the records after its
checkpoint's step, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.keys import KEYS

__all__ = [
    "COMPLETIONS_FILE",
    "append_completions",
    "completion_indices",
    "completion_records",
    "log_completions",
    "read_completions",
    "reset_completions",
]

logger = logging.getLogger(__name__)

COMPLETIONS_FILE = "completions.jsonl"
"""File name of the completions, in the run's log directory."""


def completion_indices(num_prompts: int, k: int) -> list[int]:
    """``min(k, num_prompts)`` distinct prompt indices spread evenly over ``0..num_prompts - 1``, from 0.

    Example:
        >>> completion_indices(256, 3), completion_indices(2, 3), completion_indices(5, 0)
        ([0, 85, 170], [0, 1], [])
    """
    if num_prompts < 0 or k < 0:
        raise ValueError(f"num_prompts and k must be >= 0, got {num_prompts} and {k}")
    k = min(k, num_prompts)
    return [i * num_prompts // k for i in range(k)]


def _values(batch: TensorDictBase, key: str) -> list[Any]:
    value = batch.get(key)
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    size = int(batch.batch_size[0])
    return values if isinstance(values, list) and len(values) == size else [values] * size


def completion_records(
    batch: TensorDictBase,
    rows: Sequence[int],
    *,
    tokenizer: Any,
    step: int,
    scores: torch.Tensor,
    extra: Mapping[str, Sequence[Any]],
    indices: Sequence[int],
) -> list[dict[str, Any]]:
    """One record per row of a scored validation batch (see the module docstring).

    Args:
        batch: the generated batch: ``prompts [B, P]``, ``attention_mask [B, P + R]``, ``responses [B, R]``,
            ``response_mask [B, R]`` and, when present, the non-tensor ``data_source`` and ``ground_truth``.
        rows: the rows to record (positions in ``batch``).
        tokenizer: decodes the tokens (``tokenizer.decode(ids, skip_special_tokens=False)``).
        step: the training step of the validation.
        scores: ``[B]`` sequence scores.
        extra: the reward function's extra infos, ``{name: [B] values}``.
        indices: the prompt index in the validation set of each of ``rows``.
    """
    width = batch[KEYS.prompts].shape[-1]
    sources = _values(batch, KEYS.data_source) if KEYS.data_source in batch else [None] * len(scores)
    truths = _values(batch, KEYS.ground_truth) if KEYS.ground_truth in batch else [None] * len(scores)
    records = []
    for row, index in zip(rows, indices, strict=True):
        prompt = batch[KEYS.prompts][row][batch[KEYS.attention_mask][row, :width].bool()]
        response = batch[KEYS.responses][row][batch[KEYS.response_mask][row].bool()]
        record = {
            "step": int(step),
            "index": int(index),
            "data_source": None if sources[row] is None else str(sources[row]),
            "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=False),
            "response": tokenizer.decode(response.tolist(), skip_special_tokens=False),
            "ground_truth": truths[row],
            "score": float(scores[row]),
        }
        for name, values in extra.items():
            value = values[row]
            if isinstance(value, (bool, int, float, str)) or value is None:
                record.setdefault(name, value)
        records.append(record)
    return records


def reset_completions(path: str, resume_step: int | None) -> None:
    """Start the file of a run: remove it (a fresh run), or keep only the records of steps ``<= resume_step``."""
    if not os.path.exists(path):
        return
    if resume_step is None:
        os.remove(path)
        return
    kept = [r for r in read_completions(path) if int(r.get("step", 0)) <= resume_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def log_completions(records: Sequence[Mapping[str, Any]]) -> None:
    """Log each record at ``INFO``: the end of its prompt, its response, the ground truth and the score."""
    for r in records:
        logger.info(
            "validation completion (step %d, prompt %d, %s): ...%r -> %r; ground truth %r, score %g",
            r["step"],
            r["index"],
            r["data_source"],
            r["prompt"][-120:],
            r["response"],
            r["ground_truth"],
            r["score"],
        )


def append_completions(path: str, records: Sequence[Mapping[str, Any]]) -> None:
    """Append the records to the JSONL file ``path`` (its directory is created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(dict(r)) + "\n" for r in records)


def read_completions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``completions.jsonl`` file (or of ``path/completions.jsonl`` for a directory)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, COMPLETIONS_FILE)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
