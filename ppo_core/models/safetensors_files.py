"""A safetensors weight file's header checked against its size before anything loads it.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON header (each tensor's
dtype, shape and ``data_offsets`` ``[begin, end)`` into the data that follows), then the data. A copy or download
cut short leaves a file shorter than its header says; the ``safetensors`` reader then fails with
``SafetensorError: Error while deserializing header: ...`` and no file name, which in a sharded checkpoint or a
worker process leaves the user guessing. :func:`check_safetensors_file` reads the header only (kilobytes) and
raises ``ValueError`` naming the file and the sizes. Corrupted bytes inside the data are not detected (the format
has no checksum).
"""

from __future__ import annotations

import json
import os

__all__ = ["check_safetensors_file", "hf_weight_files"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def check_safetensors_file(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` naming ``path`` if it is shorter than its header says, or its header is not one.

    Example:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file({"w": torch.zeros(4)}, path)
        >>> check_safetensors_file(path)
        >>> with open(path, "r+b") as f:
        ...     _ = f.truncate(os.path.getsize(path) - 1)
        >>> check_safetensors_file(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: weights file ... is truncated: it holds ... bytes, its header describes ... (an interrupted ...
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"weights file {path} is truncated or empty: it holds {size} bytes, fewer than the 8-byte header "
                "length of a safetensors file (an interrupted download or copy?)"
            )
        header_len = int.from_bytes(head, "little")
        if 8 + header_len > size:
            raise ValueError(
                f"weights file {path} is truncated or not a safetensors file: it holds {size} bytes, its header "
                f"length field says {header_len} header bytes follow (an interrupted download or copy?)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        described = 8 + header_len + max((int(end) for end in ends), default=0)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"weights file {path} has a corrupted header (not safetensors JSON: {exc}); re-download or re-copy it"
        ) from exc
    if described > size:
        raise ValueError(
            f"weights file {path} is truncated: it holds {size} bytes, its header describes {described} "
            "(an interrupted download or copy?); re-download or re-copy it"
        )


def hf_weight_files(folder: str | os.PathLike[str]) -> list[str]:
    """The safetensors files ``from_pretrained`` reads from a Hugging Face checkpoint ``folder``: the shards its
    ``model.safetensors.index.json`` names (those present), else ``model.safetensors``, else none."""
    folder = os.fspath(folder)
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        return [p for p in (os.path.join(folder, s) for s in shards) if os.path.isfile(p)]
    single = os.path.join(folder, _SINGLE)
    return [single] if os.path.isfile(single) else []
