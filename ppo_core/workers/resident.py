"""Resident batches: rows that stay in the worker processes, and the small handles the controller passes instead.

A :class:`BatchRef` names a batch that lives in the workers' :class:`ResidentStore` (one store per process; the
roles of a :class:`~ppo_core.workers.base.ColocatedWorker` share it): its id, its number of rows, the keys it holds
with their dtype and trailing shape, and its :class:`Placement` (which group holds it, that group's data-parallel
layout, and the global row range each dp rank holds). It pickles to a few hundred bytes whatever the batch size.

Row ranges follow :func:`ppo_core.batch.split_for_dp`: with ``S = ceil(B / dp_size)`` rows per shard, dp rank ``d``
holds global rows ``[min(d*S, B), min((d+1)*S, B))`` (:func:`dp_row_ranges`). Padding rows that a by-value split
adds are never kept.

Lifetime: every entry records the training step that made it; ``ResidentStore.end_step(step)`` drops them at the
end of that step (``WorkerGroup.end_resident_step``), so nothing outlives its step unless a caller keeps it on
purpose under a later step.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> store = ResidentStore()
    >>> store.put("b0", TensorDict({"x": torch.zeros(3, 4)}, batch_size=[3]), step=1)
    >>> store.get("b0", ("x",))["x"].shape, store.ids()
    (torch.Size([3, 4]), ('b0',))
    >>> store.end_step(1), store.ids()
    (('b0',), ())
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.workers.dispatch import DPLayout

__all__ = [
    "BatchRef",
    "Keep",
    "KeySpec",
    "Placement",
    "ResidentBatchMissingError",
    "ResidentStore",
    "ShardInfo",
    "describe_keys",
    "dp_row_ranges",
]


class ResidentBatchMissingError(LookupError):
    """A worker was asked for a resident batch (or keys of it) that its store does not hold."""


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One key of a resident batch: its dtype and the shape of one row (``[B, *shape]`` in total)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def row_nbytes(self) -> int:
        """Bytes of one row of this key."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def dp_row_ranges(rows: int, dp_size: int) -> tuple[tuple[int, int], ...]:
    """``[dp_size]`` half-open global row ranges, contiguous in dp order, as :func:`split_for_dp` cuts them.

    Example:
        >>> dp_row_ranges(5, 2), dp_row_ranges(5, 4), dp_row_ranges(0, 2)
        (((0, 3), (3, 5)), ((0, 2), (2, 4), (4, 5), (5, 5)), ((0, 0), (0, 0)))
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shard = -(-rows // dp_size)
    return tuple((min(d * shard, rows), min((d + 1) * shard, rows)) for d in range(dp_size))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a resident batch lives: the holding group's id, its dp layout, each dp rank's global row range.

    Every rank of dp rank ``d`` (its TP/PP replicas included) holds rows ``row_ranges[d]``.
    """

    group: str
    layout: DPLayout
    row_ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.row_ranges) != self.layout.dp_size:
            raise ValueError(
                f"row_ranges has {len(self.row_ranges)} entries for dp_size {self.layout.dp_size}; they must match"
            )
        at = 0
        for d, (lo, hi) in enumerate(self.row_ranges):
            if lo != at or hi < lo:
                raise ValueError(f"row_ranges must be contiguous in dp order; dp rank {d} has {(lo, hi)}")
            at = hi

    @property
    def rows(self) -> int:
        """Total rows held."""
        return self.row_ranges[-1][1]

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards."""
        return self.layout.dp_size

    def rows_of_rank(self, rank: int) -> tuple[int, int]:
        """The global row range global rank ``rank`` holds."""
        return self.row_ranges[self.layout.dp_ranks[rank]]


@dataclasses.dataclass(frozen=True)
class BatchRef:
    """A handle on a resident batch (see the module docstring); what the controller passes instead of rows.

    ``keys`` is a tuple of ``(name, KeySpec)`` pairs in insertion order; ``step`` is the training step whose end
    drops it.
    """

    id: str
    rows: int
    keys: tuple[tuple[str, KeySpec], ...]
    placement: Placement
    step: int = 0

    @property
    def key_names(self) -> tuple[str, ...]:
        """The names of the keys held."""
        return tuple(k for k, _ in self.keys)

    def spec(self, key: str) -> KeySpec:
        """The :class:`KeySpec` of ``key`` (``ValueError`` naming the held keys when absent)."""
        for name, spec in self.keys:
            if name == key:
                return spec
        raise ValueError(f"resident batch {self.id} has no key {key!r}; it holds {list(self.key_names)}")

    def nbytes(self, keys: Iterable[str] | None = None) -> int:
        """Bytes of ``keys`` (default: all) over all rows: what shipping them by value would move once."""
        names = self.key_names if keys is None else tuple(keys)
        return sum(self.rows * self.spec(k).row_nbytes() for k in names)


@dataclasses.dataclass(frozen=True)
class Keep:
    """The controller's request to a rank: keep the method's output under ``id`` instead of returning it.

    The same object goes to every rank (one broadcast): ``rows_by_dp[d]`` real rows of dp rank ``d`` are kept
    (padding dropped); ``update`` adds the output's keys to the existing entry ``id``; ``columns`` are returned.
    """

    id: str
    step: int
    rows_by_dp: tuple[int, ...]
    columns: tuple[str, ...] = ()
    update: bool = False


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a rank answers to a :class:`Keep`: its kept rows, the keys now held, and the requested columns."""

    rows: int
    keys: tuple[tuple[str, KeySpec], ...]
    columns: TensorDictBase | None


def describe_keys(td: TensorDictBase) -> tuple[tuple[str, KeySpec], ...]:
    """``(name, KeySpec)`` of every tensor of a ``[B]`` TensorDict (nested keys and non-tensors are refused)."""
    out = []
    for key in list(td.keys()):
        value = td.get(key)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"resident batches hold tensors only; key {key!r} is a {type(value).__name__} (flatten it)"
            )
        out.append((key, KeySpec(dtype=value.dtype, shape=tuple(value.shape[1:]))))
    return tuple(out)


@dataclasses.dataclass
class _Entry:
    data: TensorDictBase
    step: int


class ResidentStore:
    """The resident batches of one process (one per worker; colocated roles share their worker's store).

    Entries are ``[rows]`` TensorDicts of this rank's shard. ``get`` returns the stored tensors themselves (no
    copy): a method that writes into them in place writes into the store.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def put(self, batch_id: str, data: TensorDictBase, step: int) -> None:
        """Keep ``data`` (a ``[rows]`` TensorDict) under ``batch_id`` until the end of ``step``."""
        if not isinstance(data, TensorDictBase) or data.batch_dims != 1:
            raise TypeError(
                f"resident batch {batch_id}: expected a [rows] TensorDict, got {type(data).__name__}"
            )
        describe_keys(data)
        if batch_id in self._entries:
            raise ValueError(f"resident batch {batch_id} is already held; drop it first or update it")
        self._entries[batch_id] = _Entry(data=data, step=int(step))

    def update(self, batch_id: str, data: TensorDictBase) -> None:
        """Add (or replace) the keys of ``data`` in the entry ``batch_id``; rows must match."""
        entry = self._entry(batch_id)
        describe_keys(data)
        if data.batch_size != entry.data.batch_size:
            raise ValueError(
                f"resident batch {batch_id} holds {entry.data.batch_size[0]} rows here; the update has "
                f"{data.batch_size[0] if data.batch_dims else data.batch_size}"
            )
        for key in list(data.keys()):
            entry.data.set(key, data.get(key))

    def get(
        self, batch_id: str, keys: Sequence[str] | None = None, optional: Sequence[str] = ()
    ) -> TensorDictBase:
        """The entry's ``keys`` (default: all) plus those of ``optional`` it holds, as a TensorDict (no copy)."""
        data = self._entry(batch_id).data
        if keys is None:
            return data.select(*data.keys())
        held = set(data.keys())
        missing = [k for k in keys if k not in held]
        if missing:
            raise ResidentBatchMissingError(
                f"resident batch {batch_id} has no key(s) {missing}; it holds {sorted(data.keys())}"
            )
        wanted = list(dict.fromkeys([*keys, *(k for k in optional if k in held)]))
        return data.select(*wanted)

    def drop(self, batch_id: str) -> bool:
        """Forget ``batch_id``; whether it was held."""
        return self._entries.pop(batch_id, None) is not None

    def end_step(self, step: int) -> tuple[str, ...]:
        """Drop every entry made at ``step`` or earlier; the ids dropped."""
        gone = tuple(k for k, e in self._entries.items() if e.step <= step)
        for k in gone:
            del self._entries[k]
        return gone

    def ids(self) -> tuple[str, ...]:
        """The ids held, oldest first."""
        return tuple(self._entries)

    def nbytes(self) -> int:
        """Bytes of every tensor held."""
        return sum(t.nbytes for e in self._entries.values() for t in e.data.values())

    def _entry(self, batch_id: str) -> _Entry:
        entry = self._entries.get(batch_id)
        if entry is None:
            raise ResidentBatchMissingError(
                f"this process holds no resident batch {batch_id} (held: {list(self._entries) or 'none'}); it "
                "was dropped at the end of its step, or belongs to another group (reshard it)"
            )
        return entry


def keep_output(store: ResidentStore, keep: Keep, dp_rank: int, out: Any) -> ShardInfo:
    """Worker side of a :class:`Keep`: store ``out``'s real rows and answer with their description."""
    if out is None:
        raise TypeError(
            "a resident call returned None on this rank (a TP/PP rank that is not collected?); every rank of a dp "
            "group must return its rows to keep them (the replicas read them in later calls)"
        )
    if not isinstance(out, TensorDictBase) or out.batch_dims != 1:
        raise TypeError(f"a resident call must return a [rows] TensorDict, got {type(out).__name__}")
    rows = keep.rows_by_dp[dp_rank]
    if out.batch_size[0] < rows:
        raise ValueError(f"the method returned {out.batch_size[0]} rows; dp rank {dp_rank} must keep {rows}")
    kept = out[:rows] if out.batch_size[0] != rows else out
    if keep.update:
        store.update(keep.id, kept)
    else:
        store.put(keep.id, kept, keep.step)
    held = store.get(keep.id)
    columns = held.select(*keep.columns).clone() if keep.columns else None
    return ShardInfo(rows=rows, keys=describe_keys(held), columns=columns)


def resolve_refs(store: ResidentStore | None, rank: int, reads: Any, args: tuple, kwargs: dict) -> tuple:
    """Worker side of a call with :class:`BatchRef` arguments: each becomes this rank's shard of the declared keys.

    ``reads`` is ``(keys, optional)`` or None (every key). TensorDict arguments arrive already cut to the rows of
    this rank (the dispatch splits them by the reference's row ranges).
    """

    def one(value: Any) -> Any:
        if not isinstance(value, BatchRef):
            return value
        if store is None:
            raise TypeError(f"resident batch {value.id} passed to a worker without a resident store")
        keys, optional = reads if reads is not None else (None, ())
        data = store.get(value.id, keys, optional)
        lo, hi = value.placement.rows_of_rank(rank)
        if data.batch_size[0] != hi - lo:
            raise ValueError(
                f"resident batch {value.id}: rank {rank} holds {data.batch_size[0]} rows, the handle says {hi - lo}"
            )
        return data

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def merge_shard_infos(
    batch_id: str, group: str, layout: DPLayout, step: int, infos: Sequence[ShardInfo]
) -> tuple[BatchRef, TensorDictBase | None]:
    """Controller side of a :class:`Keep`: the :class:`BatchRef` (and merged columns) from the collect ranks' answers."""
    ranges, at = [], 0
    for info in infos:
        ranges.append((at, at + info.rows))
        at += info.rows
    keys = infos[0].keys
    for d, info in enumerate(infos):
        if info.keys != keys:
            raise ValueError(
                f"resident batch {batch_id}: dp rank {d} holds keys {info.keys}, dp rank 0 {keys}; the shards "
                "must agree on keys, dtypes and trailing shapes"
            )
    ref = BatchRef(
        id=batch_id,
        rows=at,
        keys=keys,
        placement=Placement(group=group, layout=layout, row_ranges=tuple(ranges)),
        step=step,
    )
    parts = [i.columns for i in infos]
    if any(p is None for p in parts):
        return ref, None
    columns = torch.cat(parts, dim=0) if parts else TensorDict({}, batch_size=[0])
    return ref, columns
