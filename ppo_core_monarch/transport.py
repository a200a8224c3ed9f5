"""Moving arguments and results between processes: ``/dev/shm`` files on one host, compact pickles across hosts.

Pickling a tensor through Monarch copies it several times (``torch.save`` of its storage, the message, the
unpickle). Between processes of one host, :func:`encode` instead writes every large CPU tensor of an object once
into a single tmpfs file and pickles only a small skeleton that refers to it; :func:`decode` maps the file
copy-on-write (``MAP_PRIVATE``: a receiver that writes in place never affects another receiver) and rebuilds the
tensors as zero-copy views. Across hosts, :func:`compact` clones views so that a shard never ships the whole
storage it was cut from.

Example:
    >>> import tempfile
    >>> obj = {"ids": torch.arange(1 << 16), "note": "x"}
    >>> enc = encode(obj, tempfile.mkdtemp(), threshold_bytes=1024)
    >>> out = decode(enc)
    >>> bool(torch.equal(out["ids"], obj["ids"])), out["note"]
    (True, 'x')
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from tensordict import TensorDictBase

__all__ = ["Encoded", "compact", "decode", "encode", "release"]

_ALIGN = 64
_LEN = struct.Struct("<Q")  # length prefix of the header inside the skeleton


@dataclass(frozen=True)
class Encoded:
    """A pickled skeleton plus the shared-memory file (``path``, ``None`` if no tensor was large) it refers to."""

    skeleton: bytes
    """Pickle of the object with each large tensor replaced by a reference into the file."""
    path: str | None
    """The tmpfs file holding the large tensors' bytes (unlinked by the receiver of a result)."""
    nbytes: int
    """Size of the file."""


def _sharable(obj: Any, threshold: int) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.requires_grad
        and obj.nbytes >= threshold
    )


class _ShmPickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, threshold: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.threshold = threshold
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if _sharable(obj, self.threshold):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


def encode(obj: Any, directory: str, threshold_bytes: int) -> Encoded:
    """Pickle ``obj``, writing every CPU tensor of at least ``threshold_bytes`` into one file in ``directory``.

    Views are written compactly (only their elements). The caller owns the file until a receiver has decoded
    it (see :func:`release`).
    """
    buf = io.BytesIO()
    pickler = _ShmPickler(buf, threshold_bytes)
    pickler.dump(obj)
    if not pickler.tensors:
        return Encoded(skeleton=buf.getvalue(), path=None, nbytes=0)
    metas, total = [], 0
    for t in pickler.tensors:
        metas.append((total, t.dtype, tuple(t.shape)))
        total += -(-t.nbytes // _ALIGN) * _ALIGN
    path = os.path.join(directory, uuid.uuid4().hex)
    dst = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for (offset, dtype, shape), t in zip(metas, pickler.tensors):
        dst[offset : offset + t.nbytes].view(dtype).view(shape).copy_(t)
    del dst
    header = pickle.dumps(metas, protocol=pickle.HIGHEST_PROTOCOL)
    return Encoded(skeleton=_LEN.pack(len(header)) + header + buf.getvalue(), path=path, nbytes=total)


class _ShmUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, views: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.views = views

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.views[pid]


def decode(enc: Encoded, *, unlink: bool = False) -> Any:
    """Rebuild the object of :func:`encode`; tensors are copy-on-write views of the mapped file.

    With ``unlink`` the file is removed once mapped (the mapping stays valid): the receiver of a result owns it.
    """
    if enc.path is None:
        return pickle.loads(enc.skeleton)
    (n,) = _LEN.unpack_from(enc.skeleton)
    start = _LEN.size + n
    metas = pickle.loads(enc.skeleton[_LEN.size : start])
    data = torch.from_file(enc.path, shared=False, size=enc.nbytes, dtype=torch.uint8)
    if unlink:
        release(enc)
    views = []
    for offset, dtype, shape in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(data[offset : offset + nbytes].view(dtype).view(shape))
    return _ShmUnpickler(io.BytesIO(enc.skeleton[start:]), views).load()


def release(enc: Encoded) -> None:
    """Remove the file of ``enc`` if it still exists (mappings made earlier stay valid)."""
    if enc.path is not None:
        try:
            os.unlink(enc.path)
        except FileNotFoundError:
            pass


def compact(obj: Any) -> Any:
    """``obj`` with every tensor view that does not own its whole storage replaced by a compact clone.

    Pickling ships a tensor's whole storage, so a 1 MB row slice of a 100 MB tensor would send 100 MB.
    Handles tensors, TensorDicts, dicts, lists and tuples; other objects are returned unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return obj.clone() if _is_view(obj) else obj
    if isinstance(obj, TensorDictBase):
        if any(_is_view(t) for t in obj.values(include_nested=True, leaves_only=True)):
            return obj.apply(lambda t: t.clone() if _is_view(t) else t)
        return obj
    if isinstance(obj, Mapping) and type(obj) in (dict,):
        return {k: compact(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(compact(v) for v in obj)
    return obj


def _is_view(t: torch.Tensor) -> bool:
    if t.device.type != "cpu" or t.layout != torch.strided or not isinstance(t, torch.Tensor):
        return False
    return t.untyped_storage().nbytes() > t.nbytes or not t.is_contiguous()
