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

import contextlib
import functools
import io
import math
import mmap
import os
import pickle
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch
from tensordict import TensorDictBase

__all__ = ["Encoded", "Lease", "ShmPool", "compact", "decode", "decode_borrowed", "encode", "release"]

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


def _fresh_file(directory: str, nbytes: int) -> tuple[str, torch.Tensor]:
    path = os.path.join(directory, uuid.uuid4().hex)
    return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def encode(
    obj: Any,
    directory: str,
    threshold_bytes: int,
    allocate: Callable[[int], tuple[str, torch.Tensor]] | None = None,
) -> Encoded:
    """Pickle ``obj``, writing every CPU tensor of at least ``threshold_bytes`` into one file in ``directory``.

    Views are written compactly (only their elements). ``allocate(nbytes) -> (path, uint8 mapping)`` supplies
    the file (default: a new one; :class:`ShmPool` reuses warm ones). The caller owns the file until a receiver
    has decoded it (see :func:`release`).
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
    path, dst = (allocate or functools.partial(_fresh_file, directory))(total)
    for (offset, dtype, shape), t in zip(metas, pickler.tensors, strict=True):
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
    data = torch.from_file(enc.path, shared=False, size=enc.nbytes, dtype=torch.uint8)
    if unlink:
        release(enc)
    return _rebuild(enc, data)


class Lease:
    """The private mapping behind :func:`decode_borrowed`; :meth:`release` unmaps it if nothing else uses it."""

    def __init__(self, mapping: mmap.mmap | None) -> None:
        self._mapping = mapping

    def release(self) -> bool:
        """Unmap; False when tensors still refer to the mapping (then the file must not be rewritten)."""
        if self._mapping is None:
            return True
        try:
            self._mapping.close()
        except BufferError:
            return False
        self._mapping = None
        return True


def decode_borrowed(enc: Encoded) -> tuple[Any, Lease]:
    """:func:`decode` for arguments whose file the sender may rewrite later: call ``lease.release()`` after use.

    The mapping is private (copy-on-write). If the receiver keeps any tensor past the call, ``release`` returns
    False and the sender must not reuse the file (the kept tensors would see its next contents).
    """
    if enc.path is None:
        return pickle.loads(enc.skeleton), Lease(None)
    with open(enc.path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), enc.nbytes, access=mmap.ACCESS_COPY)
    # numpy holds the buffer export for as long as any tensor view lives, so close() can tell (torch.frombuffer
    # does not, and closing under it would leave dangling tensors)
    data = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    return _rebuild(enc, data), Lease(mapping)


def _rebuild(enc: Encoded, data: torch.Tensor) -> Any:
    (n,) = _LEN.unpack_from(enc.skeleton)
    start = _LEN.size + n
    metas = pickle.loads(enc.skeleton[_LEN.size : start])
    views = []
    for offset, dtype, shape in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(data[offset : offset + nbytes].view(dtype).view(shape))
    return _ShmUnpickler(io.BytesIO(enc.skeleton[start:]), views).load()


def release(enc: Encoded) -> None:
    """Remove the file of ``enc`` if it still exists (mappings made earlier stay valid)."""
    if enc.path is not None:
        _unlink(enc.path)


class ShmPool:
    """Reusable, already-faulted tmpfs files for argument payloads (writing fresh tmpfs pages costs more than
    the copy itself). A file comes back with :meth:`give_back` only when every receiver released its lease.

    Example:
        >>> import tempfile
        >>> pool = ShmPool(tempfile.mkdtemp(), max_bytes=1 << 24)
        >>> path, buf = pool.allocate(1000)
        >>> pool.give_back(path); pool.allocate(900)[0] == path
        True
        >>> pool.close()
    """

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self._free: dict[str, torch.Tensor] = {}
        self._busy: dict[str, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> tuple[str, torch.Tensor]:
        """A file of at least ``nbytes`` (best fit among the free ones, else a new one), mapped shared."""
        fits = [(buf.numel(), path) for path, buf in self._free.items() if buf.numel() >= nbytes]
        if fits:
            _, path = min(fits)
            buf = self._free.pop(path)
        else:
            path, buf = _fresh_file(self.directory, -(-nbytes // _GRAIN) * _GRAIN)
        self._busy[path] = buf
        return path, buf[:nbytes]

    def give_back(self, path: str) -> None:
        """Every receiver released the file: keep it warm for a later payload (within ``max_bytes``)."""
        buf = self._busy.pop(path, None)
        if buf is None:
            return
        if sum(b.numel() for b in self._free.values()) + buf.numel() > self.max_bytes:
            _unlink(path)
        else:
            self._free[path] = buf

    def discard(self, path: str) -> None:
        """A receiver may still use the file (or the call failed): never reuse it; remove its name."""
        self._busy.pop(path, None)
        self._free.pop(path, None)
        _unlink(path)

    def close(self) -> None:
        """Remove every file of the pool."""
        for path in [*self._free, *self._busy]:
            _unlink(path)
        self._free.clear()
        self._busy.clear()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_GRAIN = 1 << 20  # pool files grow in MiB steps so that similar payloads reuse them


def compact(obj: Any, *, threshold_bytes: int | None = None) -> Any:
    """``obj`` with every tensor view that does not own its whole storage replaced by a compact clone.

    Pickling ships a tensor's whole storage, so a 1 MB row slice of a 100 MB tensor would send 100 MB.
    Handles tensors, TensorDicts, dicts, lists and tuples; other objects are returned unchanged. With
    ``threshold_bytes``, only the views that :func:`encode` with that threshold would pickle are cloned: the
    ones it writes to shared memory are written compactly anyway, and cloning them would copy them twice.

    Example:
        >>> rows = torch.zeros(100, 10)[:5]
        >>> compact(rows).untyped_storage().nbytes(), compact(rows, threshold_bytes=0) is rows
        (200, True)
    """
    if threshold_bytes is None:
        needs_clone = _is_view
    else:

        def needs_clone(t: torch.Tensor) -> bool:
            return _is_view(t) and not _sharable(t, threshold_bytes)

    return _compact(obj, needs_clone)


def _compact(obj: Any, needs_clone: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone() if needs_clone(obj) else obj
    if isinstance(obj, TensorDictBase):
        if any(needs_clone(t) for t in obj.values(include_nested=True, leaves_only=True)):
            return obj.apply(lambda t: t.clone() if needs_clone(t) else t)
        return obj
    if isinstance(obj, Mapping) and type(obj) in (dict,):
        return {k: _compact(v, needs_clone) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_compact(v, needs_clone) for v in obj)
    return obj


def _is_view(t: torch.Tensor) -> bool:
    if t.device.type != "cpu" or t.layout != torch.strided or not isinstance(t, torch.Tensor):
        return False
    return t.untyped_storage().nbytes() > t.nbytes or not t.is_contiguous()
