"""The prompt-row schema (verl's): chat messages, a data source, a ground truth and free-form extra info.

A row is a mapping with

- ``prompt`` (the key is configurable): a non-empty list of chat messages, each a mapping with string ``role``
  and ``content`` (other message keys, e.g. ``name``, are kept for the chat template), or a plain non-empty string,
  read as the user's one message (``[{"role": "user", "content": prompt}]``; text already templated, or a JSON
  list of messages stored as text, is refused: it would be templated twice),
- ``data_source``: a non-empty string; the rule-based reward picks its scorer by it,
- ``reward_model``: a mapping whose ``ground_truth`` is the reference answer (any non-null value; a number must be
  finite: a NaN, as a null in a float column reads, is an error),
- ``extra_info`` (optional): a mapping or null, passed through untouched.

Other columns (``ability``...) are ignored. Errors name the file, the row and the dotted field, e.g.
``train.parquet row 17: prompt[1].role missing``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ppo_core.data.readers import RowOrigin

__all__ = ["PromptRecord", "PromptSchemaError", "parse_prompt_row"]


class PromptSchemaError(ValueError):
    """A row does not follow the prompt schema; the message names the file, the row and the field."""

    def __init__(self, origin: RowOrigin, field_path: str, problem: str) -> None:
        super().__init__(f"{origin}: {field_path} {problem}")
        self.origin = origin
        self.field_path = field_path


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """A validated row."""

    messages: list[dict[str, Any]]
    """The chat messages, in order."""
    data_source: str
    """Name of the dataset the row comes from (selects the reward's scorer)."""
    ground_truth: Any
    """Reference answer (``reward_model.ground_truth``); None only when it was not required."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """``extra_info`` (``{}`` when missing or null)."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _missing(origin: RowOrigin, row: Mapping[str, Any], key: str, hint: str = "") -> PromptSchemaError:
    """``key`` missing: null in the row, or (``hint`` added) no such column, the row's columns listed."""
    if key in row:
        return PromptSchemaError(origin, key, "missing")
    columns = ", ".join(sorted(map(str, row))) or "none"
    return PromptSchemaError(
        origin, key, f"missing: the row has no such column (its columns: {columns}){hint}"
    )


_TEMPLATE_MARKERS = ("<|im_start|>", "<|start_header_id|>", "<|begin_of_text|>", "[INST]", "<start_of_turn>")
"""Chat-template markers (ChatML, Llama 3, Mistral, Gemma) a plain-string prompt must not hold: it would be
templated twice."""


def _messages(origin: RowOrigin, row: Mapping[str, Any], key: str, key_name: str) -> list[dict[str, Any]]:
    value = row.get(key)
    if value is None:
        raise _missing(origin, row, key, f"; {key_name} names the column of chat messages")
    if isinstance(value, str):  # a plain prompt: the user's one message
        if not value:
            raise PromptSchemaError(origin, key, "must be a non-empty prompt, got an empty string")
        text = value.strip()
        if text.startswith("[") and text.endswith("]") and '"role"' in text:
            raise PromptSchemaError(
                origin,
                key,
                "is text that looks like a JSON list of chat messages: store the messages as a list",
            )
        marker = next((m for m in _TEMPLATE_MARKERS if m in text), None)
        if marker is not None:
            raise PromptSchemaError(
                origin,
                key,
                f"is text that holds the chat-template marker {marker!r}, as an already templated prompt does: the "
                "tokenizer's chat template is applied to every prompt, so give the user's text (or the messages)",
            )
        return [{"role": "user", "content": value}]
    if isinstance(value, (bytes, Mapping)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise PromptSchemaError(
            origin, key, f"must be a list of chat messages ({{'role', 'content'}}), got {_type_name(value)}"
        )
    messages = list(value)
    if not messages:
        raise PromptSchemaError(origin, key, "must hold at least one message, got an empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(message, Mapping):
            raise PromptSchemaError(
                origin, where, f"must be a mapping with 'role' and 'content', got {_type_name(message)}"
            )
        for name in ("role", "content"):
            if message.get(name) is None:
                raise PromptSchemaError(origin, f"{where}.{name}", "missing")
            if not isinstance(message[name], str):
                raise PromptSchemaError(
                    origin, f"{where}.{name}", f"must be a string, got {_type_name(message[name])}"
                )
        # parquet structs carry every field of the column's type; drop the ones this message does not set
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def parse_prompt_row(
    origin: RowOrigin,
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    require_ground_truth: bool = True,
    prompt_key_name: str = "data.prompt_key",
    default_data_source: str | None = None,
) -> PromptRecord:
    """Validate ``row`` and return its :class:`PromptRecord`.

    Args:
        origin: where the row comes from (named in errors).
        row: the row as read from the file.
        prompt_key: the column holding the chat messages.
        require_ground_truth: a missing ``reward_model.ground_truth`` is an error (True) or None (False).
        prompt_key_name: the setting that names the prompt column, in the error for a row without it.
        default_data_source: the data source of a row without one (None: such a row is an error).

    Raises:
        PromptSchemaError: (a ``ValueError``) naming the row and the dotted field.

    Example:
        >>> rec = parse_prompt_row(RowOrigin("a.jsonl", 0), {"prompt": [{"role": "user", "content": "1+1?"}],
        ...     "data_source": "toy", "reward_model": {"ground_truth": "2"}})
        >>> rec.messages, rec.ground_truth
        ([{'role': 'user', 'content': '1+1?'}], '2')
        >>> parse_prompt_row(RowOrigin("a.jsonl", 3), {"prompt": [{"content": "hi"}]})
        Traceback (most recent call last):
        ...
        ppo_core.data.schema.PromptSchemaError: a.jsonl row 3: prompt[0].role missing
    """
    messages = _messages(origin, row, prompt_key, prompt_key_name)
    source = row.get("data_source")
    if source is None:
        source = default_data_source
    if source is None:
        raise _missing(origin, row, "data_source")
    if not isinstance(source, str) or not source:
        raise PromptSchemaError(origin, "data_source", f"must be a non-empty string, got {source!r}")
    reward_model = row.get("reward_model")
    ground_truth = None
    if reward_model is not None and not isinstance(reward_model, Mapping):
        raise PromptSchemaError(
            origin, "reward_model", f"must be a mapping with 'ground_truth', got {_type_name(reward_model)}"
        )
    if reward_model is not None:
        ground_truth = reward_model.get("ground_truth")
    if ground_truth is None and require_ground_truth:
        if reward_model is None:
            raise _missing(origin, row, "reward_model")
        raise PromptSchemaError(origin, "reward_model.ground_truth", "missing")
    if isinstance(ground_truth, numbers.Real) and not math.isfinite(float(ground_truth)):
        # a null in a float column reads as NaN: no reference answer, which no scorer can compare with
        raise PromptSchemaError(
            origin, "reward_model.ground_truth", f"is {ground_truth!r}; a ground truth must be finite"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise PromptSchemaError(origin, "extra_info", f"must be a mapping or null, got {_type_name(extra)}")
    return PromptRecord(
        messages=messages, data_source=source, ground_truth=ground_truth, extra_info=dict(extra or {})
    )
