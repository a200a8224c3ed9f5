"""Rows of prompt files: parquet through pyarrow, JSON Lines through the standard library.

Each row comes back as a plain ``dict`` with its origin (file and 0-based row number), so schema errors can name
the row. Parquet struct columns become dicts and list columns lists (``pyarrow.Table.to_pylist``), which is how
verl's ``prompt`` (a list of ``{"role", "content"}`` structs) and ``reward_model`` (a struct) arrive.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["PROMPT_FILE_SUFFIXES", "RowOrigin", "iter_prompt_rows", "normalize_paths"]

PathLike = Union[str, "os.PathLike[str]"]

PROMPT_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
"""File name endings :func:`iter_prompt_rows` reads (``.json`` files must hold one JSON object per line)."""


@dataclass(frozen=True)
class RowOrigin:
    """Where a row comes from: ``path`` and its 0-based ``row`` number in that file."""

    path: str
    row: int

    def __str__(self) -> str:
        return f"{self.path} row {self.row}"


def normalize_paths(paths: PathLike | Sequence[PathLike]) -> list[str]:
    """One path or a sequence of paths as a list of strings; ``ValueError`` for an empty list or a bad suffix."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [os.fspath(p) for p in paths]
    if not out:
        raise ValueError("paths must name at least one prompt file")
    for path in out:
        if not path.endswith(PROMPT_FILE_SUFFIXES):
            raise ValueError(f"prompt file {path!r} must end with one of {', '.join(PROMPT_FILE_SUFFIXES)}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt file {path!r} does not exist")
    return out


def _parquet_rows(path: str) -> Iterator[dict[str, Any]]:
    """The rows of a parquet file; a file pyarrow cannot read (empty, truncated, corrupted, not parquet) raises
    ``ValueError`` naming it (pyarrow's own errors name no file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    read = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
        while (batch := next(batches, None)) is not None:
            rows = batch.to_pylist()
            read += len(rows)
            yield from rows
    except (pa.ArrowException, OSError) as exc:
        after = f" after row {read - 1}" if read else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"prompt file {path} is not a readable parquet file (truncated or corrupted?){after}: {reason}"
        ) from exc


def _jsonl_rows(path: str) -> Iterator[dict[str, Any]]:
    """The rows of a JSON Lines file (one object a line, blank lines skipped), decoded as UTF-8 line by line so that
    an error names its line."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path} line {line_number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1}: {exc.reason}); JSON Lines files must be UTF-8"
                ) from exc
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {line_number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path} line {line_number}: each line must be a JSON object, got {type(row).__name__}"
                )
            yield row


def iter_prompt_rows(paths: PathLike | Sequence[PathLike]) -> Iterator[tuple[RowOrigin, dict[str, Any]]]:
    """``(origin, row)`` for every row of every file, in file order.

    JSON Lines files skip blank lines; ``row`` counts the rows actually read (so it matches the parquet row number
    of the same data written both ways).

    Args:
        paths: a ``.parquet``, ``.jsonl`` or ``.json`` (JSON Lines) file, or a sequence of them.

    Raises:
        ValueError: naming the file (and the line of a JSON Lines file): a file that holds no row (empty, blank
            lines only, a parquet table of 0 rows: a file named as prompts and holding none is a mistake), an
            unreadable parquet file, a JSON Lines line that is not UTF-8, not JSON or not an object.
    """
    for path in normalize_paths(paths):
        if os.path.getsize(path) == 0:
            raise ValueError(f"prompt file {path} is empty (0 bytes)")
        parquet = path.endswith(".parquet")
        i = -1
        for i, row in enumerate(_parquet_rows(path) if parquet else _jsonl_rows(path)):
            yield RowOrigin(path, i), row
        if i < 0:
            what = "a parquet table of 0 rows" if parquet else "blank lines only"
            raise ValueError(f"prompt file {path} is empty: it holds no row ({what})")
