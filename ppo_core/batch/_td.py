"""Private helpers around ``tensordict`` for batches of rows: validation, leaf listing, NaN-safe equality.

What tensordict 0.15.3 does and does not do for us (checked by ``tests/ppo_core/test_batch_td.py``):

- ``NonTensorStack`` fields (strings, dicts, ``None``) survive integer/boolean indexing, slicing, ``torch.cat``,
  ``clone`` and pickling, including batches of size 0 and stacks whose items are all equal.
- ``keys(leaves_only=True)`` skips non-tensor fields unless ``is_leaf=is_leaf_nontensor`` is passed: every key
  listing here passes it, or a string field would silently be left out of a check.
- ``torch.cat`` silently promotes mismatched dtypes (float32 + float64 -> float64), so :func:`concat` compares
  dtypes itself before calling it.
- A slice of a batch is a view: pickling it serializes the parent's whole storage, so shards are cloned.
- ``td[key]`` returns a ``LinkedList`` for a non-tensor field; :func:`_nontensor_values` returns a plain list.
- ``clone()`` and ``clone(False)`` of a batch with a ``NonTensorStack`` field copy each row's ``NonTensorData``
  through tensorclass machinery, slowly; indexing with an integer tensor gives the same independent
  rows (tensors gathered into new storage, each row's Python object copied) several times faster, and a shallow
  copy needs no per-row work at all: :func:`_slice`, :func:`_copy` and :func:`_shallow_copy` use those.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase, is_leaf_nontensor, is_non_tensor

__all__: list[str] = []

Key = str | tuple[str, ...]


def _check_batch(name: str, batch: object) -> int:
    """Return the batch size ``B`` of a TensorDict with ``batch_size=[B]``; raise naming ``name`` otherwise."""
    if not isinstance(batch, TensorDictBase):
        raise TypeError(f"{name} must be a tensordict.TensorDict, got {type(batch).__name__}")
    if batch.batch_dims != 1:
        raise ValueError(f"{name} must have a 1-D batch_size [B], got batch_size {list(batch.batch_size)}")
    return int(batch.batch_size[0])


def _key_name(key: Key) -> str:
    return ".".join(key) if isinstance(key, tuple) else key


def _leaves(batch: TensorDictBase) -> dict[Key, object]:
    """Every leaf (tensors and non-tensor fields, nested keys as tuples), in insertion order."""
    return dict(batch.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))


def _nontensor_values(value: object, size: int) -> list:
    """The per-row Python objects of a non-tensor field (a shared ``NonTensorData`` is repeated ``size`` times)."""
    if isinstance(value, NonTensorData):
        return [value.data] * size
    return list(value.tolist())


def _field_values(batch: TensorDictBase, key: Key) -> list:
    """Per-row values of ``key`` as a list: Python objects of a non-tensor field, rows of a tensor."""
    value = batch.get(key)
    size = int(batch.batch_size[0])
    if is_non_tensor(value):
        return _nontensor_values(value, size)
    return list(value.unbind(0)) if size else []


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values, where NaN equals NaN (``torch.equal`` says NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _values_equal(a: object, b: object, _seen: dict | None = None) -> bool:
    """Deep equality of Python objects where NaN equals NaN (floats, tensors, arrays, lists, dicts).

    Cycle-safe: an object array, list or dict that contains itself (directly or through other containers) is
    compared as a graph. A pair of containers that is already being compared counts as equal where it recurs, so
    two values are equal exactly when no path through them reaches a difference; a pair compared once is not
    compared again. ``_seen`` maps ``(id(a), id(b))`` to the pair itself, which keeps both objects alive during
    the comparison so that their ids cannot be reused by temporaries.
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    containers = (np.ndarray, Mapping, list, tuple)
    if not (isinstance(a, containers) and isinstance(b, containers)):
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return False
        try:
            return bool(a == b)
        except (TypeError, ValueError):
            return a is b
    seen = {} if _seen is None else _seen
    pair = (id(a), id(b))
    if pair in seen:
        return True
    seen[pair] = (a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        # tolist() gives Python scalars for numeric arrays and the stored objects themselves for object arrays
        pairs = zip(a.ravel().tolist(), b.ravel().tolist(), strict=True)
        return all(_values_equal(x, y, seen) for x, y in pairs)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_values_equal(x, y, seen) for x, y in zip(a, b, strict=True))
        )
    return False


def _rows(batch: TensorDictBase, index: torch.Tensor) -> TensorDictBase:
    """Rows ``index`` (``[n]`` int64) of ``batch`` as a new batch with its own compact storage.

    Integer-tensor indexing already gathers every tensor into new storage, so no further clone is needed.
    """
    return batch[index]


def _slice(batch: TensorDictBase, start: int, stop: int) -> TensorDictBase:
    """Rows ``start:stop`` as a compact copy, independent of ``batch`` (a bare slice shares the parent's storage,
    which a pickle would carry whole, and its non-tensor rows, which a row assignment would change in both)."""
    return _rows(batch, torch.arange(start, stop))


def _copy(batch: TensorDictBase) -> TensorDictBase:
    """A deep copy of a batch with ``batch_size=[B]``: what ``batch.clone()`` gives, without its per-row cost for
    non-tensor fields."""
    return _rows(batch, torch.arange(int(batch.batch_size[0])))


def _shallow_copy(batch: TensorDictBase) -> TensorDictBase:
    """A new batch holding the same leaves (tensors and non-tensor fields): setting or deleting a key of the copy
    leaves ``batch`` alone, as with ``batch.clone(False)``, which instead copies every non-tensor row."""
    if type(batch) is not TensorDict:  # a lazy stack or a subclass: keep its own type
        return batch.clone(False)
    return TensorDict(_leaves(batch), batch_size=batch.batch_size, device=batch.device)
