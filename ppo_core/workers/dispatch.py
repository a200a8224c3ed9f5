"""Dispatch modes: pure functions deciding which rank gets which arguments and how outputs are collected.

A dispatch function maps ``(layout, args, kwargs)`` to a :class:`DispatchPlan` (one :class:`RankCall` per rank
that runs the method); a collect function maps ``(layout, plan, outputs)`` (outputs aligned with
``plan.calls``) to the value the controller sees. No backend is involved, so every mode is tested on its own.

Modes (``Dispatch.<NAME>``):

- ``ONE_TO_ALL``: every rank gets the same arguments; the result is the list of per-rank outputs in rank order.
- ``ALL_TO_ALL``: every argument is a sequence of length ``world_size``; rank ``i`` gets element ``i``; the
  result is the list of outputs.
- ``DP_COMPUTE`` with a :class:`~ppo_core.workers.resident.BatchRef` argument: every rank gets the handle and reads
  its own rows from its resident store; ``TensorDict`` arguments are cut by the handle's row ranges (no padding).
- ``DP_COMPUTE``: every ``TensorDict`` argument is split by data-parallel rank with
  :func:`ppo_core.batch.split_for_dp` (non-divisible batches are padded by repeating rows); TP/PP replicas of a
  dp rank get the same shard object: a compact clone, or a row-slice view when the backend asks for
  ``dispatch(..., copy=False)`` because it copies payloads itself; outputs of the collect ranks are merged in dp order with
  :func:`ppo_core.batch.merge_from_dp`, which removes the padding.
- ``DP_COMPUTE_METRIC``: same split (but a non-divisible batch is an error: padding would duplicate training
  samples); the result is one metric dict per dp rank, all of them, reduced with
  :func:`ppo_core.metrics.reduce_metrics`. Padding never drops a rank's entry (verl drops whole ranks' entries).
- ``RANK_ZERO``: only rank 0 runs; the result is its output.
- ``Dispatch.custom(dispatch_fn, collect_fn)``: your own pair with the signatures above.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tensordict import TensorDictBase

__all__ = [
    "DPLayout",
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "Execute",
    "RankCall",
    "WorkerLayout",
    "resolve_dispatch",
]


class Execute(str, enum.Enum):
    """Which ranks of a dispatch plan actually run: all of them, or only rank 0."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """One rank's data-parallel layout, as reported by ``Worker.worker_layout()``."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    is_collect_rank: bool


@dataclasses.dataclass(frozen=True)
class DPLayout:
    """Data-parallel layout of a whole group: the dp rank of each global rank and which ranks are collected.

    Example:
        >>> layout = DPLayout(dp_ranks=(0, 0, 1, 1), collect=(True, False, True, False))  # DP=2 x TP=2
        >>> layout.dp_size, layout.ranks_of(1), layout.collect_ranks()
        (2, (2, 3), (0, 2))
    """

    dp_ranks: tuple[int, ...]
    collect: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.dp_ranks) != len(self.collect):
            raise ValueError(
                f"dp_ranks has {len(self.dp_ranks)} entries but collect has {len(self.collect)}; they must match"
            )
        if not self.dp_ranks:
            raise ValueError("dp_ranks must describe at least one rank")
        dp_size = max(self.dp_ranks) + 1
        if min(self.dp_ranks) < 0 or set(self.dp_ranks) != set(range(dp_size)):
            raise ValueError(f"dp_ranks must cover 0..dp_size-1 without gaps, got {self.dp_ranks}")
        for d in range(dp_size):
            n = sum(c for r, c in zip(self.dp_ranks, self.collect, strict=True) if r == d)
            if n != 1:
                raise ValueError(f"dp rank {d} must have exactly one collect rank, has {n}")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.dp_ranks)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards."""
        return max(self.dp_ranks) + 1

    def ranks_of(self, dp_rank: int) -> tuple[int, ...]:
        """Global ranks that receive shard ``dp_rank`` (its TP/PP replicas), ascending."""
        return tuple(r for r, d in enumerate(self.dp_ranks) if d == dp_rank)

    def collect_ranks(self) -> tuple[int, ...]:
        """The collected global rank of each dp rank, in dp order."""
        return tuple(next(r for r in self.ranks_of(d) if self.collect[r]) for d in range(self.dp_size))

    @classmethod
    def trivial(cls, world_size: int) -> DPLayout:
        """Pure data parallelism: rank ``i`` is dp rank ``i`` and every rank is collected."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return cls(dp_ranks=tuple(range(world_size)), collect=(True,) * world_size)

    @classmethod
    def from_workers(cls, layouts: Sequence[WorkerLayout]) -> DPLayout:
        """Build from the layouts the workers report (one per rank, any order); checks they agree."""
        by_rank = sorted(layouts, key=lambda w: w.rank)
        if [w.rank for w in by_rank] != list(range(len(by_rank))):
            raise ValueError(
                f"workers reported ranks {[w.rank for w in by_rank]}; expected 0..{len(by_rank) - 1}"
            )
        sizes = {(w.world_size, w.dp_size) for w in by_rank}
        if len(sizes) != 1 or next(iter(sizes))[0] != len(by_rank):
            raise ValueError(
                f"workers disagree on (world_size, dp_size): {sorted(sizes)} for {len(by_rank)} ranks"
            )
        layout = cls(
            dp_ranks=tuple(w.dp_rank for w in by_rank), collect=tuple(w.is_collect_rank for w in by_rank)
        )
        if layout.dp_size != by_rank[0].dp_size:
            raise ValueError(
                f"workers report dp_size {by_rank[0].dp_size} but use dp ranks {layout.dp_ranks}"
            )
        return layout


class RankCall(NamedTuple):
    """The arguments one rank receives."""

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclasses.dataclass
class DispatchPlan:
    """Per-rank calls plus whatever the collect function needs (e.g. padding info).

    ``uniform`` is True when every call carries the very same arguments, so a backend may send one broadcast.
    """

    calls: list[RankCall]
    context: Any = None
    uniform: bool = False


DispatchFn = Callable[[DPLayout, tuple, dict], DispatchPlan]
CollectFn = Callable[[DPLayout, DispatchPlan, list], Any]


@dataclasses.dataclass(frozen=True)
class DispatchMode:
    """A named ``(dispatch_fn, collect_fn)`` pair.

    Example:
        >>> from tensordict import TensorDict
        >>> import torch
        >>> batch = TensorDict({"x": torch.arange(4)}, batch_size=[4])
        >>> plan = Dispatch.DP_COMPUTE.dispatch(DPLayout.trivial(2), (batch,), {}, copy=False)
        >>> shard = plan.calls[1].args[0]["x"]  # rows 2:4 of the batch's own storage, not a clone
        >>> shard.tolist(), shard.storage_offset(), shard.untyped_storage().data_ptr() == batch["x"].data_ptr()
        ([2, 3], 2, True)
    """

    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    accepts_copy: bool = False
    """Whether ``dispatch_fn`` takes a ``copy`` keyword (the DP modes: ``split_for_dp(..., copy=copy)``)."""

    def dispatch(self, layout: DPLayout, args: tuple, kwargs: dict, *, copy: bool = True) -> DispatchPlan:
        """Plan the per-rank calls for ``args``/``kwargs``.

        ``copy=False`` lets a mode that splits batches hand out row-slice views instead of compact clones
        (see :func:`ppo_core.batch.split_for_dp`): only for backends that compact or copy every payload
        before it leaves the process (``WorkerGroup.compacts_payloads``). Modes without ``accepts_copy``
        ignore it.
        """
        if self.accepts_copy:
            return self.dispatch_fn(layout, tuple(args), dict(kwargs), copy=copy)
        return self.dispatch_fn(layout, tuple(args), dict(kwargs))

    def collect(self, layout: DPLayout, plan: DispatchPlan, outputs: list) -> Any:
        """Combine the outputs (aligned with ``plan.calls``) into the controller-side result."""
        if len(outputs) != len(plan.calls):
            raise ValueError(f"got {len(outputs)} outputs for {len(plan.calls)} calls")
        return self.collect_fn(layout, plan, list(outputs))


def _one_to_all(layout: DPLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    return DispatchPlan([RankCall(r, args, kwargs) for r in range(layout.world_size)], uniform=True)


def _all_to_all(layout: DPLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    n = layout.world_size
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()
    ]
    for name, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise ValueError(
                f"ALL_TO_ALL needs every argument to be a list of length world_size={n}; {name} is not"
            )
    calls = [RankCall(r, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]
    return DispatchPlan(calls)


def _outputs_list(layout: DPLayout, plan: DispatchPlan, outputs: list) -> list:
    return outputs


def _rank_zero(layout: DPLayout, args: tuple, kwargs: dict) -> DispatchPlan:
    return DispatchPlan([RankCall(0, args, kwargs)], uniform=True)


def _first_output(layout: DPLayout, plan: DispatchPlan, outputs: list) -> Any:
    return outputs[0]


def _split_dp(layout: DPLayout, args: tuple, kwargs: dict, pad: str, copy: bool = True) -> DispatchPlan:
    from ppo_core.batch import split_for_dp

    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [
        (f"argument {k!r}", v) for k, v in kwargs.items()
    ]
    tds = [(name, v) for name, v in named if isinstance(v, TensorDictBase)]
    from ppo_core.workers.resident import BatchRef

    refs = [(name, v) for name, v in named if isinstance(v, BatchRef)]
    if refs:
        return _split_by_ref(layout, args, kwargs, refs, tds, copy)
    if not tds:
        raise ValueError("DP_COMPUTE modes need at least one TensorDict or BatchRef argument to split")
    sizes = {name: int(v.batch_size[0]) if v.batch_dims else -1 for name, v in tds}
    if len(set(sizes.values())) != 1 or -1 in sizes.values():
        raise ValueError(f"TensorDict arguments must share one 1-D batch size; got {sizes}")
    shards_of: dict[int, list] = {}
    pad_info = None
    for _name, td in tds:
        shards, info = split_for_dp(td, layout.dp_size, pad=pad, copy=copy)
        shards_of[id(td)] = shards
        pad_info = info if pad_info is None else pad_info

    def pick(value: Any, d: int) -> Any:
        return shards_of[id(value)][d] if isinstance(value, TensorDictBase) else value

    calls = []
    for r, d in enumerate(layout.dp_ranks):
        calls.append(RankCall(r, tuple(pick(a, d) for a in args), {k: pick(v, d) for k, v in kwargs.items()}))
    return DispatchPlan(calls, context=pad_info)


@dataclasses.dataclass(frozen=True)
class _RefSplit:
    """Plan context of a dispatch over resident batches: the global row range of each dp rank (no padding)."""

    row_ranges: tuple[tuple[int, int], ...]


def _split_by_ref(
    layout: DPLayout, args: tuple, kwargs: dict, refs: list, tds: list, copy: bool
) -> DispatchPlan:
    """Every rank gets the :class:`~ppo_core.workers.resident.BatchRef` itself (it reads its rows from its store);
    TensorDict arguments are cut by the reference's row ranges, so a controller-side ``[B]`` column lands on the
    ranks holding its rows."""
    placement = refs[0][1].placement
    for name, ref in refs:
        if ref.placement.layout != layout:
            raise ValueError(
                f"{name}: resident batch {ref.id} is laid out for dp ranks {ref.placement.layout.dp_ranks}, this "
                f"group uses {layout.dp_ranks}; reshard it first (WorkerGroup.reshard)"
            )
        if ref.placement.row_ranges != placement.row_ranges:
            raise ValueError(
                f"{name}: resident batch {ref.id} has row ranges {ref.placement.row_ranges}, "
                f"{refs[0][0]} has {placement.row_ranges}; they must match"
            )
    for name, td in tds:
        if not td.batch_dims or int(td.batch_size[0]) != placement.rows:
            raise ValueError(
                f"{name} has batch size {tuple(td.batch_size)}; the resident batch {refs[0][1].id} has "
                f"{placement.rows} rows"
            )
    cut: dict[int, list] = {}
    for _name, td in tds:
        cut[id(td)] = [td[lo:hi].clone() if copy else td[lo:hi] for lo, hi in placement.row_ranges]

    def pick(value: Any, d: int) -> Any:
        return cut[id(value)][d] if isinstance(value, TensorDictBase) else value

    calls = [
        RankCall(r, tuple(pick(a, d) for a in args), {k: pick(v, d) for k, v in kwargs.items()})
        for r, d in enumerate(layout.dp_ranks)
    ]
    return DispatchPlan(calls, context=_RefSplit(placement.row_ranges), uniform=not tds)


def _collected_in_dp_order(layout: DPLayout, plan: DispatchPlan, outputs: list) -> list:
    by_rank = {call.rank: out for call, out in zip(plan.calls, outputs, strict=True)}
    missing = [r for r in layout.collect_ranks() if r not in by_rank]
    if missing:
        raise ValueError(f"collect ranks {missing} did not run; DP modes need Execute.ALL")
    return [by_rank[r] for r in layout.collect_ranks()]


def _merge_dp(layout: DPLayout, plan: DispatchPlan, outputs: list) -> Any:
    parts = _collected_in_dp_order(layout, plan, outputs)
    if all(p is None for p in parts):
        return None
    if all(isinstance(p, TensorDictBase) for p in parts):
        if isinstance(plan.context, _RefSplit):
            import torch

            return torch.cat(parts, dim=0)
        from ppo_core.batch import merge_from_dp

        return merge_from_dp(parts, plan.context)
    return parts


def _reduce_dp_metrics(
    reduce: Callable[[list[dict]], dict] | None, layout: DPLayout, plan: DispatchPlan, outputs: list
) -> dict:
    parts = _collected_in_dp_order(layout, plan, outputs)
    for d, p in enumerate(parts):
        if not isinstance(p, dict):
            raise TypeError(
                f"DP_COMPUTE_METRIC expects a metric dict from every dp rank; dp rank {d} returned {type(p).__name__}"
            )
    if reduce is not None:
        return reduce(parts)
    from ppo_core.metrics import reduce_metrics

    return reduce_metrics(parts)


_PADS = ("error", "repeat")


class Dispatch:
    """The built-in dispatch modes and factories for configured or custom ones."""

    ONE_TO_ALL = DispatchMode("one_to_all", _one_to_all, _outputs_list)
    ALL_TO_ALL = DispatchMode("all_to_all", _all_to_all, _outputs_list)
    RANK_ZERO = DispatchMode("rank_zero", _rank_zero, _first_output)

    @staticmethod
    def dp_compute(pad: str = "repeat") -> DispatchMode:
        """``DP_COMPUTE`` with a padding policy (``"repeat"`` rows to a multiple of dp_size, or ``"error"``)."""
        if pad not in _PADS:
            raise ValueError(f"unknown pad {pad!r}; valid values: {', '.join(_PADS)}")
        return DispatchMode("dp_compute", functools.partial(_split_dp, pad=pad), _merge_dp, accepts_copy=True)

    @staticmethod
    def dp_compute_metric(
        pad: str = "error", reduce: Callable[[list[dict]], dict] | None = None
    ) -> DispatchMode:
        """``DP_COMPUTE_METRIC`` with a padding policy and an optional reducer (default ``reduce_metrics``)."""
        if pad not in _PADS:
            raise ValueError(f"unknown pad {pad!r}; valid values: {', '.join(_PADS)}")
        return DispatchMode(
            "dp_compute_metric",
            functools.partial(_split_dp, pad=pad),
            functools.partial(_reduce_dp_metrics, reduce),
            accepts_copy=True,
        )

    @staticmethod
    def custom(dispatch_fn: DispatchFn, collect_fn: CollectFn, name: str = "custom") -> DispatchMode:
        """Wrap your own ``(dispatch_fn, collect_fn)`` pair."""
        if not callable(dispatch_fn) or not callable(collect_fn):
            raise TypeError("dispatch_fn and collect_fn must both be callable")
        return DispatchMode(name, dispatch_fn, collect_fn)

    DP_COMPUTE: DispatchMode
    DP_COMPUTE_METRIC: DispatchMode


Dispatch.DP_COMPUTE = Dispatch.dp_compute()
Dispatch.DP_COMPUTE_METRIC = Dispatch.dp_compute_metric()

_BY_NAME = {
    m.name: m
    for m in (
        Dispatch.ONE_TO_ALL,
        Dispatch.ALL_TO_ALL,
        Dispatch.DP_COMPUTE,
        Dispatch.DP_COMPUTE_METRIC,
        Dispatch.RANK_ZERO,
    )
}


def resolve_dispatch(
    value: DispatchMode | str | tuple[Callable[..., Any], Callable[..., Any]],
) -> DispatchMode:
    """A :class:`DispatchMode` from a mode, a mode name (case-insensitive) or a ``(dispatch_fn, collect_fn)`` pair.

    Example:
        >>> resolve_dispatch("DP_COMPUTE").name
        'dp_compute'
    """
    if isinstance(value, DispatchMode):
        return value
    if isinstance(value, str):
        key = value.lower()
        if key not in _BY_NAME:
            raise ValueError(f"unknown dispatch mode {value!r}; valid values: {', '.join(sorted(_BY_NAME))}")
        return _BY_NAME[key]
    if isinstance(value, tuple) and len(value) == 2:
        return Dispatch.custom(*value)
    raise TypeError(
        f"dispatch must be a DispatchMode, a name or a (dispatch_fn, collect_fn) pair, got {value!r}"
    )
