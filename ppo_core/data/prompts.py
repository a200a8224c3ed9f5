"""Prompt datasets: read verl-schema files, apply the chat template once, enforce a maximum prompt length.

:func:`load_prompt_dataset` returns a :class:`PromptDataset`, a sequence of the prompt mappings
``BasePPOTrainer(train_dataset=...)`` consumes: ``input_ids`` (a 1-D int64 tensor) plus the non-tensor fields
``data_source``, ``ground_truth`` and ``extra_info`` (and ``raw_prompt``, the messages, on request) that
:func:`ppo_core.trainer.data.collate_prompts` carries into the batch and the reward function reads.

Tokenisation happens here, once, not per epoch: each prompt is
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``, so the ids are exactly
what the checkpoint's tokenizer produces (the template's own special tokens, no extra BOS).

Prompts longer than ``max_prompt_length`` tokens follow ``truncation``:

- ``"error"``: raise ``ValueError`` naming the first such row and its length,
- ``"filter"``: drop the row,
- ``"left"``: keep the last ``max_prompt_length`` tokens (the generation prompt at the end survives),
- ``"right"``: keep the first ``max_prompt_length`` tokens.

The counts are logged and kept in :attr:`PromptDataset.stats` (``to_metrics()`` for the trainer's logger).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch

from ppo_core._config_base import ConfigBase
from ppo_core.data.readers import PathLike, RowOrigin, iter_prompt_rows, normalize_paths
from ppo_core.data.schema import PromptRecord, parse_prompt_row

__all__ = [
    "TRUNCATION_POLICIES",
    "PromptDataset",
    "PromptDatasetConfig",
    "PromptDatasetStats",
    "load_prompt_dataset",
    "tokenize_chat",
]

logger = logging.getLogger(__name__)

TRUNCATION_POLICIES = ("error", "filter", "left", "right")
"""Values of ``truncation``: what to do with a prompt longer than ``max_prompt_length`` tokens."""

Truncation = Literal["error", "filter", "left", "right"]


@dataclass(kw_only=True)
class PromptDatasetStats:
    """What loading did to the rows of a prompt dataset."""

    num_rows: int = 0
    """Rows read from the files."""
    num_kept: int = 0
    """Prompts in the dataset (rows minus filtered)."""
    num_filtered: int = 0
    """Rows dropped because their prompt was longer than ``max_prompt_length`` (``truncation="filter"``)."""
    num_truncated: int = 0
    """Prompts cut to ``max_prompt_length`` tokens (``truncation="left"`` or ``"right"``)."""
    max_length: int = 0
    """Longest prompt before truncation, in tokens (0 for an empty dataset)."""
    mean_length: float = 0.0
    """Mean prompt length of the kept prompts after truncation, in tokens."""

    def to_metrics(self, prefix: str = "data/") -> dict[str, float]:
        """The stats as ``{prefix + name: float}``, ready for a metrics logger.

        Example:
            >>> PromptDatasetStats(num_rows=3, num_kept=2, num_filtered=1).to_metrics("train_data/")["train_data/num_filtered"]
            1.0
        """
        return {
            f"{prefix}{name}": float(getattr(self, name))
            for name in ("num_rows", "num_kept", "num_filtered", "num_truncated", "max_length", "mean_length")
        }


class PromptDataset(Sequence[dict[str, Any]]):
    """The prompts of one or more files, tokenised; item ``i`` is a fresh dict (callers may not mutate ours).

    Attributes:
        stats: a :class:`PromptDatasetStats` of the load.
        origins: the :class:`~ppo_core.data.readers.RowOrigin` of each kept prompt.
    """

    def __init__(
        self,
        items: list[dict[str, Any]],
        stats: PromptDatasetStats,
        origins: list[RowOrigin] | None = None,
    ) -> None:
        self._items = items
        self.stats = stats
        self.origins = origins if origins is not None else []

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [dict(item) for item in self._items[index]]
        return dict(self._items[index])

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts, stats={self.stats})"


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, ending with the generation prompt.

    Exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` (as a plain
    list, whichever ``transformers`` version).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        chat_template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).
    """
    ids = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **dict(chat_template_kwargs or {}),
    )
    if isinstance(ids, Mapping):  # a transformers version that ignores return_dict=False
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _check_options(max_prompt_length: int, truncation: str, prompt_key: str) -> None:
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be an int >= 1, got {max_prompt_length!r}")
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
    if not isinstance(prompt_key, str) or not prompt_key:
        raise ValueError(f"prompt_key must be a non-empty string, got {prompt_key!r}")


def load_prompt_dataset(
    paths: PathLike | Sequence[PathLike],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    truncation: Truncation = "error",
    prompt_key: str = "prompt",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    require_ground_truth: bool = True,
    keep_raw_prompt: bool = False,
) -> PromptDataset:
    """Read, validate and tokenise the prompts of parquet / JSON Lines files in verl's schema.

    Args:
        paths: a ``.parquet``, ``.jsonl`` or ``.json`` (JSON Lines) file, or a sequence of them (concatenated).
        tokenizer: the checkpoint's Hugging Face tokenizer (it must have a chat template).
        max_prompt_length: longest prompt, in tokens, after the chat template.
        truncation: ``"error"``, ``"filter"``, ``"left"`` or ``"right"`` (see the module docstring).
        prompt_key: the column holding the chat messages.
        chat_template_kwargs: extra variables for the chat template.
        require_ground_truth: a row without ``reward_model.ground_truth`` is an error (True) or gets None.
        keep_raw_prompt: also keep the messages as ``raw_prompt`` in each item.

    Returns:
        A :class:`PromptDataset` of ``{"input_ids": [L] int64, "data_source": str, "ground_truth": ...,
        "extra_info": dict}`` items, in file order, with its :class:`PromptDatasetStats`.

    Raises:
        ValueError: a bad option, a file that is empty or unreadable (naming it, and the line of a JSON Lines
            file; see :func:`~ppo_core.data.readers.iter_prompt_rows`), a schema error (naming the file, row and
            field), or a prompt longer than ``max_prompt_length`` with ``truncation="error"``.
    """
    _check_options(max_prompt_length, truncation, prompt_key)
    files = normalize_paths(paths)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "tokenizer has no chat_template; prompts are chat messages and need one "
            "(set tokenizer.chat_template or use a checkpoint that ships a template)"
        )
    stats = PromptDatasetStats()
    items: list[dict[str, Any]] = []
    origins: list[RowOrigin] = []
    total_length = 0
    too_long: list[tuple[RowOrigin, int]] = []
    for origin, row in iter_prompt_rows(files):
        stats.num_rows += 1
        record: PromptRecord = parse_prompt_row(
            origin, row, prompt_key=prompt_key, require_ground_truth=require_ground_truth
        )
        ids = tokenize_chat(tokenizer, record.messages, chat_template_kwargs)
        if not ids:
            raise ValueError(f"{origin}: the chat template rendered {prompt_key} to zero tokens")
        stats.max_length = max(stats.max_length, len(ids))
        if len(ids) > max_prompt_length:
            if truncation == "error":  # go on: the error names the first such row, how many, and the longest
                too_long.append((origin, len(ids)))
                continue
            if truncation == "filter":
                stats.num_filtered += 1
                continue
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            stats.num_truncated += 1
        item: dict[str, Any] = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "data_source": record.data_source,
            "ground_truth": record.ground_truth,
            "extra_info": record.extra_info,
        }
        if keep_raw_prompt:
            item["raw_prompt"] = record.messages
        items.append(item)
        origins.append(origin)
        total_length += len(ids)
    if too_long:
        origin, length = too_long[0]
        raise ValueError(
            f"{origin}: {prompt_key} is {length} tokens after the chat template, more than "
            f"max_prompt_length={max_prompt_length}; {len(too_long)} of {stats.num_rows} prompts are longer, the "
            f"longest {stats.max_length} tokens (raise max_prompt_length to {stats.max_length}, or set truncation "
            "to 'filter', 'left' or 'right')"
        )
    stats.num_kept = len(items)
    stats.mean_length = total_length / len(items) if items else 0.0
    logger.info(
        "loaded %d prompts from %s: %d filtered, %d truncated (%s) at max_prompt_length=%d; "
        "longest %d tokens, mean %.1f after truncation",
        stats.num_kept,
        ", ".join(files),
        stats.num_filtered,
        stats.num_truncated,
        truncation,
        max_prompt_length,
        stats.max_length,
        stats.mean_length,
    )
    if not items:  # the files hold rows (an empty one raised): every row was longer than max_prompt_length
        logger.warning(
            "no prompt of %s is left: all %d rows are longer than max_prompt_length=%d tokens (truncation=filter)",
            ", ".join(files),
            stats.num_rows,
            max_prompt_length,
        )
    return PromptDataset(items, stats, origins)


@dataclass(kw_only=True)
class PromptDatasetConfig(ConfigBase):
    """Where a prompt dataset lives and how to tokenise it (the keywords of :func:`load_prompt_dataset`)."""

    files: str | list[str] = field(default_factory=list)
    """Parquet / JSON Lines files, concatenated in order."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, after the chat template."""
    truncation: str = "error"
    """What to do with a longer prompt: ``error``, ``filter``, ``left`` (keep the end) or ``right`` (keep the start)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables passed to the chat template."""
    require_ground_truth: bool = True
    """A row without ``reward_model.ground_truth`` is an error (else its ground truth is None)."""
    keep_raw_prompt: bool = False
    """Keep the messages as ``raw_prompt`` in each item (for reward functions that read them)."""

    def __post_init__(self) -> None:
        if isinstance(self.files, str):
            self.files = [self.files]
        self.files = [str(f) for f in self.files]
        _check_options(self.max_prompt_length, self.truncation, self.prompt_key)

    def load(self, tokenizer: Any) -> PromptDataset:
        """:func:`load_prompt_dataset` of :attr:`files` with these settings."""
        return load_prompt_dataset(
            self.files,
            tokenizer,
            max_prompt_length=self.max_prompt_length,
            truncation=self.truncation,  # type: ignore[arg-type]
            prompt_key=self.prompt_key,
            chat_template_kwargs=self.chat_template_kwargs,
            require_ground_truth=self.require_ground_truth,
            keep_raw_prompt=self.keep_raw_prompt,
        )
