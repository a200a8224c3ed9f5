"""Checkpoint manifests: the size and SHA-256 of every file of a checkpoint folder, checked before loading.

``manifest.json`` is written last into the temporary folder, just before the rename that publishes the
checkpoint, and covers every file under the folder: the trainer state and whatever the workers wrote (the trainer
need not know their layout). :func:`verify_manifest` runs before anything is loaded, so a truncated, emptied or
overwritten file is reported with its path instead of loading "successfully" and failing steps later (a few
random bytes in a weight file unpickle into garbage tensors).

Files are hashed in 1 MiB chunks (constant memory), several files at a time (``hashlib`` releases the GIL): the
manifest adds one read of every file to a save and to a resume, bound by SHA-256's speed per core
(``docs/performance.md``).

Example:
    >>> import pathlib, tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> folder = pathlib.Path(tmp.name)
    >>> _ = (folder / "weights.bin").write_bytes(b"0123")
    >>> write_manifest(folder)["files"]["weights.bin"]["size"]
    4
    >>> verify_manifest(folder)
    True
    >>> _ = (folder / "weights.bin").write_bytes(b"0124")
    >>> try:
    ...     verify_manifest(folder)
    ... except CheckpointCorruptError as e:
    ...     print(os.path.basename(e.file), "SHA-256" in str(e))
    weights.bin True
    >>> tmp.cleanup()
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
from typing import Any

__all__ = ["MANIFEST_FILE", "CheckpointCorruptError", "file_sha256", "verify_manifest", "write_manifest"]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_VERSION = 1
_CHUNK = 1 << 20
_THREADS = min(8, os.cpu_count() or 1)


class CheckpointCorruptError(ValueError):
    """A checkpoint file is missing, truncated, unreadable or differs from the manifest.

    Attributes:
        checkpoint: the checkpoint folder.
        file: the offending file (None when the problem is not one file's).
    """

    def __init__(self, message: str, *, checkpoint: str, file: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (symlinks followed), as sorted ``/``-separated relative paths."""
    out = []
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def _hash_all(folder: str, files: list[str]) -> dict[str, str]:
    paths = [os.path.join(folder, *rel.split("/")) for rel in files]
    if len(paths) <= 1:
        return {rel: file_sha256(p) for rel, p in zip(files, paths, strict=True)}
    with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(paths))) as pool:
        return dict(zip(files, pool.map(file_sha256, paths), strict=True))


def write_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``folder/manifest.json`` with the size and SHA-256 of every other file under ``folder``.

    Returns:
        The manifest: ``{"version": 1, "files": {relative_path: {"size": bytes, "sha256": hex}}}``.
    """
    folder = os.fspath(folder)
    files = _files(folder)
    digests = _hash_all(folder, files)
    manifest = {
        "version": _VERSION,
        "files": {
            rel: {"size": os.path.getsize(os.path.join(folder, rel)), "sha256": digests[rel]} for rel in files
        },
    }
    tmp = os.path.join(folder, MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(folder, MANIFEST_FILE))
    return manifest


def _read_manifest(folder: str) -> dict[str, dict[str, Any]]:
    file = os.path.join(folder, MANIFEST_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
        entries = manifest["files"]
        if manifest.get("version") != _VERSION or not isinstance(entries, dict):
            raise ValueError(f"unsupported manifest version {manifest.get('version')!r}")
        for rel, entry in entries.items():
            if not (isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
                raise ValueError(f"entry {rel!r} lacks an integer size or a sha256 string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint {folder}: its manifest {file} is unreadable ({type(exc).__name__}: {exc})",
            checkpoint=folder,
            file=file,
        ) from exc
    return entries


def verify_manifest(folder: str | os.PathLike[str]) -> bool:
    """Check every file listed in ``folder/manifest.json``: present, same size, same SHA-256.

    Sizes are checked for every file before any file is hashed, so a truncated file is reported at once.

    Returns:
        True when the folder matches its manifest; False when it has no manifest (a checkpoint written before
        manifests existed), which is logged as a warning.

    Raises:
        CheckpointCorruptError: the manifest is unreadable, or a listed file is missing, has another size or
            another SHA-256; the message names the file and the checkpoint.
    """
    folder = os.fspath(folder)
    if not os.path.exists(os.path.join(folder, MANIFEST_FILE)):
        logger.warning("checkpoint %s has no %s: its files cannot be verified", folder, MANIFEST_FILE)
        return False
    entries = _read_manifest(folder)
    for rel, entry in entries.items():
        path = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(path):
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {path} is listed in its manifest but missing",
                checkpoint=folder,
                file=path,
            )
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {path} has {size} bytes but {entry['size']} were written "
                "(truncated or overwritten)",
                checkpoint=folder,
                file=path,
            )
    digests = _hash_all(folder, sorted(entries))
    for rel in sorted(entries):
        if digests[rel] != entries[rel]["sha256"]:
            path = os.path.join(folder, *rel.split("/"))
            raise CheckpointCorruptError(
                f"checkpoint {folder}: {path} has a different SHA-256 than recorded in its manifest "
                "(the file was modified or corrupted after the checkpoint was written)",
                checkpoint=folder,
                file=path,
            )
    unlisted = sorted(set(_files(folder)) - set(entries))
    if unlisted:
        logger.warning(
            "checkpoint %s holds files its manifest does not list (not verified): %s", folder, unlisted
        )
    return True
