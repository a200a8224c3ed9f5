"""Row operations on batches: padding, concatenation, splitting, repetition, selection and union.

A batch is a ``tensordict.TensorDict`` with ``batch_size=[B]``: tensors ``[B, ...]`` (``responses: [B, T]``,
``response_mask: [B, T]``, ``scores: [B]``) and per-row Python objects as ``NonTensorStack`` fields (``uid``,
``data_source``, prompts). Every function returns a new batch with its own storage and never modifies its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase, is_non_tensor

from ppo_core._checks import check_int
from ppo_core.batch._td import (
    _check_batch,
    _copy,
    _field_values,
    _key_name,
    _leaves,
    _rows,
    _slice,
    _tensors_equal,
    _values_equal,
)

__all__ = ["concat", "pad_to_multiple", "repeat", "repeat_interleave", "select", "split", "union", "unpad"]


def pad_to_multiple(batch: TensorDictBase, k: int) -> tuple[TensorDictBase, int]:
    """Append rows so that the batch size becomes a multiple of ``k``.

    Padding rows are copies of the batch's own rows taken cyclically from the first one (rows ``0, 1, ...,
    B-1, 0, ...``), so the padding may exceed ``B`` (``B=5, k=12`` appends rows 0..4, 0, 1). Real rows stay first.
    An empty batch is already a multiple of every ``k`` and gets no padding.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        k: the divisor, ``>= 1``.

    Returns:
        ``(padded, pad_size)``: a new batch of ``B + pad_size`` rows and ``pad_size = (-B) mod k``. Undo with
        :func:`unpad`.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"x": torch.arange(5)}, batch_size=[5])
        >>> padded, pad = pad_to_multiple(b, 4)
        >>> padded["x"].tolist(), pad
        ([0, 1, 2, 3, 4, 0, 1, 2], 3)
    """
    size = _check_batch("batch", batch)
    check_int("k", k, 1)
    pad_size = (-size) % k
    index = torch.arange(size + pad_size, dtype=torch.int64) % max(size, 1)
    return _rows(batch, index), pad_size


def unpad(batch: TensorDictBase, pad_size: int) -> TensorDictBase:
    """Drop the last ``pad_size`` rows (the padding added by :func:`pad_to_multiple`).

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        pad_size: number of trailing rows to remove, ``0 <= pad_size <= B``.

    Returns:
        A new batch of ``B - pad_size`` rows.

    Example:
        >>> from tensordict import TensorDict
        >>> unpad(TensorDict({"x": torch.arange(8)}, batch_size=[8]), 3)["x"].tolist()
        [0, 1, 2, 3, 4]
    """
    size = _check_batch("batch", batch)
    check_int("pad_size", pad_size, 0)
    if pad_size > size:
        raise ValueError(f"pad_size={pad_size} is larger than the batch size {size}")
    return _rows(batch, torch.arange(size - pad_size, dtype=torch.int64))


def concat(batches: Sequence[TensorDictBase]) -> TensorDictBase:
    """Concatenate batches along the rows, in order.

    Every batch must have the same keys (nested ones included), and every tensor key the same dtype and the same
    trailing shape ``[...]`` (so ``[B_i, T]`` with one ``T``): ``torch.cat`` would otherwise silently promote
    dtypes. Non-tensor fields are concatenated as lists.

    Args:
        batches: non-empty sequence of TensorDicts with ``batch_size=[B_i]``.

    Returns:
        A batch of ``sum(B_i)`` rows.

    Raises:
        ValueError: empty sequence; missing or extra keys, or a trailing-shape mismatch (the message names the
            key and the two batches); TypeError: dtype mismatch or a key that is a tensor in one batch and a
            non-tensor field in another.

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
        >>> b = TensorDict({"x": torch.ones(1, 3)}, batch_size=[1])
        >>> concat([a, b])["x"].shape
        torch.Size([3, 3])
    """
    if isinstance(batches, TensorDictBase) or not isinstance(batches, Sequence) or not batches:
        raise ValueError("batches must be a non-empty sequence of TensorDicts")
    for i, b in enumerate(batches):
        _check_batch(f"batches[{i}]", b)
    first = _leaves(batches[0])
    for i, b in enumerate(batches[1:], start=1):
        leaves = _leaves(b)
        missing = [_key_name(k) for k in first if k not in leaves]
        extra = [_key_name(k) for k in leaves if k not in first]
        if missing or extra:
            raise ValueError(
                f"batches[{i}] has different keys from batches[0]: missing {missing}, extra {extra}"
            )
        for key, ref in first.items():
            value = leaves[key]
            name = _key_name(key)
            if is_non_tensor(ref) != is_non_tensor(value):
                kinds = ["non-tensor" if is_non_tensor(v) else "tensor" for v in (ref, value)]
                raise TypeError(
                    f"key {name!r} is a {kinds[0]} in batches[0] but a {kinds[1]} in batches[{i}]"
                )
            if is_non_tensor(ref):
                continue
            if ref.dtype != value.dtype:
                raise TypeError(
                    f"key {name!r} has dtype {ref.dtype} in batches[0] but {value.dtype} in batches[{i}]"
                )
            if ref.shape[1:] != value.shape[1:]:
                raise ValueError(
                    f"key {name!r} has shape {tuple(ref.shape)} in batches[0] but {tuple(value.shape)} in "
                    f"batches[{i}]; all dimensions after the batch dimension must match"
                )
    if len(batches) == 1:
        return _copy(batches[0])
    return torch.cat(list(batches), dim=0)


def split(batch: TensorDictBase, split_size: int) -> list[TensorDictBase]:
    """Cut a batch into consecutive chunks of ``split_size`` rows; the last chunk holds the remainder.

    The row-wise analogue of ``torch.split(tensor, split_size)``: 10 rows by 3 give chunks of 3, 3, 3 and 1 rows.
    Unlike :func:`ppo_core.batch.split_for_dp` (a fixed number of equal shards), the chunk size is fixed and
    nothing is padded. ``concat(split(batch, s))`` is ``batch`` again.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        split_size: rows per chunk, an int ``>= 1``.

    Returns:
        ``ceil(B / split_size)`` batches, each a compact clone with its own storage; every chunk has
        ``split_size`` rows except the last, which has ``B - (n - 1) * split_size`` (between 1 and
        ``split_size``). An empty batch gives one empty chunk, as ``torch.split`` does.

    Example:
        >>> from tensordict import TensorDict
        >>> chunks = split(TensorDict({"x": torch.arange(10)}, batch_size=[10]), 3)
        >>> [c["x"].tolist() for c in chunks]
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    """
    size = _check_batch("batch", batch)
    check_int("split_size", split_size, 1)
    if size == 0:
        return [_copy(batch)]
    return [_slice(batch, start, min(start + split_size, size)) for start in range(0, size, split_size)]


def repeat(batch: TensorDictBase, repeats: int) -> TensorDictBase:
    """Tile the whole batch ``repeats`` times (``a, b, c, a, b, c``); see :func:`repeat_interleave` for
    ``a, a, b, b, c, c``.

    The row-wise analogue of ``Tensor.repeat`` on the batch dimension. Non-tensor fields (``uid``...) are tiled
    with their rows.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        repeats: copies of the batch, an int ``>= 1``.

    Returns:
        A batch of ``B * repeats`` rows with its own storage: row ``i`` is row ``i % B`` of ``batch``.

    Example:
        >>> from tensordict import NonTensorStack, TensorDict
        >>> b = TensorDict({"uid": NonTensorStack("a", "b", "c")}, batch_size=[3])
        >>> repeat(b, 2).get("uid").tolist()
        ['a', 'b', 'c', 'a', 'b', 'c']
    """
    size = _check_batch("batch", batch)
    check_int("repeats", repeats, 1)
    return _rows(batch, torch.arange(size, dtype=torch.int64).repeat(repeats))


def repeat_interleave(batch: TensorDictBase, repeats: int | torch.Tensor) -> TensorDictBase:
    """Repeat every row in place (``a, a, b, b``), e.g. for ``n`` responses per prompt; :func:`repeat` tiles.

    All fields are repeated, so the ``n`` copies of a prompt keep its ``uid`` and form one group.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        repeats: an int ``n >= 1``, or a ``[B]`` integer tensor of per-row counts ``>= 0``.

    Returns:
        A batch of ``B * n`` rows (``repeats.sum()`` for a tensor).

    Example:
        >>> from tensordict import NonTensorStack, TensorDict
        >>> b = TensorDict({"uid": NonTensorStack("p", "q")}, batch_size=[2])
        >>> repeat_interleave(b, 2).get("uid").tolist()
        ['p', 'p', 'q', 'q']
    """
    size = _check_batch("batch", batch)
    if isinstance(repeats, torch.Tensor):
        if repeats.shape != (size,) or repeats.is_floating_point() or repeats.dtype == torch.bool:
            raise ValueError(
                f"repeats must be an int or a [B] integer tensor with B={size}, got dtype {repeats.dtype} "
                f"and shape {tuple(repeats.shape)}"
            )
        if size and int(repeats.min()) < 0:
            raise ValueError("repeats must be >= 0 everywhere")
        counts = repeats.to(device="cpu", dtype=torch.int64)
    else:
        counts = torch.full((size,), check_int("repeats", repeats, 1), dtype=torch.int64)
    return _rows(batch, torch.arange(size, dtype=torch.int64).repeat_interleave(counts))


def _as_index(indices: Sequence[int] | torch.Tensor, size: int) -> torch.Tensor:
    index = (
        indices if isinstance(indices, torch.Tensor) else torch.as_tensor(list(indices), dtype=torch.int64)
    )
    if index.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == torch.bool:
        if index.shape[0] != size:
            raise ValueError(f"boolean indices must have length B={size}, got {index.shape[0]}")
        return index.nonzero().squeeze(-1).cpu()
    if index.is_floating_point() or index.is_complex():
        raise TypeError(f"indices must be integers or a boolean mask, got dtype {index.dtype}")
    index = index.to(device="cpu", dtype=torch.int64)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
        bad = index[(index < 0) | (index >= size)][0].item()
        raise ValueError(f"indices must be in [0, {size}) for a batch of {size} rows, got index {bad}")
    return index


def select(batch: TensorDictBase, indices: Sequence[int] | torch.Tensor) -> TensorDictBase:
    """Rows of ``batch`` picked by integer indices (any order, repeats allowed) or by a boolean mask.

    Args:
        batch: TensorDict with ``batch_size=[B]``.
        indices: ``[n]`` integer indices in ``[0, B)`` (a list or tensor), or a ``[B]`` boolean mask.

    Returns:
        A new batch of ``n`` rows (``mask.sum()`` for a mask) with its own storage.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({"x": torch.arange(4)}, batch_size=[4])
        >>> select(b, [3, 0])["x"].tolist(), select(b, torch.tensor([True, False, True, False]))["x"].tolist()
        ([3, 0], [0, 2])
    """
    size = _check_batch("batch", batch)
    return _rows(batch, _as_index(indices, size))


def union(a: TensorDictBase, b: TensorDictBase) -> TensorDictBase:
    """All fields of ``a`` and ``b`` in one batch; a key present in both must hold equal values.

    Equality is exact (shape, dtype and values) with NaN equal to NaN, for tensors and non-tensor fields alike:
    merging a batch with a copy of itself always works, even when it holds NaN. Unlike verl's in-place
    ``DataProto.union``, neither input is modified.

    Args:
        a, b: TensorDicts with the same ``batch_size=[B]``.

    Returns:
        A new batch with the keys of ``a`` followed by the keys only in ``b``.

    Raises:
        ValueError: different batch sizes, or a shared key whose values differ (the message names the key).

    Example:
        >>> from tensordict import TensorDict
        >>> a = TensorDict({"x": torch.tensor([float("nan"), 1.0])}, batch_size=[2])
        >>> b = TensorDict({"x": torch.tensor([float("nan"), 1.0]), "y": torch.zeros(2)}, batch_size=[2])
        >>> sorted(union(a, b).keys())
        ['x', 'y']
    """
    size_a = _check_batch("a", a)
    size_b = _check_batch("b", b)
    if size_a != size_b:
        raise ValueError(f"a has batch size {size_a} but b has batch size {size_b}; they must match")
    leaves_a = _leaves(a)
    out = _copy(a)
    for key, value in _leaves(b).items():
        if key not in leaves_a:
            out.set(key, value.clone())
            continue
        mine = leaves_a[key]
        if is_non_tensor(mine) and is_non_tensor(value):
            equal = all(
                _values_equal(x, y) for x, y in zip(_field_values(a, key), _field_values(b, key), strict=True)
            )
        elif not is_non_tensor(mine) and not is_non_tensor(value):
            equal = _tensors_equal(mine, value)
        else:
            equal = False
        if not equal:
            raise ValueError(f"key {_key_name(key)!r} is in both a and b with different values; cannot union")
    return out
