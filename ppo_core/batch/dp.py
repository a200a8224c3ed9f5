"""Data-parallel split and merge: one compact shard per DP rank, and the inverse.

``split_for_dp`` cuts a batch of ``B`` rows into ``dp_size`` contiguous shards of equal size in rank order (rank
``r`` gets rows ``r*S : (r+1)*S``). By default each shard is a clone with its own compact storage, so sending it to
a worker serializes ``~1/dp_size`` of the batch rather than the parent's whole storage. ``copy=False`` returns
row-slice views instead, for a transport that copies every shard anyway (shared memory, or a compacting pickle):
the views share storage with the (padded) batch, and pickling one as is ships the whole parent storage, so
whoever serializes them must compact them first. When ``B`` is not a multiple of
``dp_size``, ``pad="repeat"`` appends copies of rows (cyclically from row 0, see
:func:`ppo_core.batch.pad_to_multiple`) and :class:`PadInfo` records where they are; ``merge_from_dp``
concatenates the per-rank outputs in rank order and drops them again.

Padding rows always sit at the end of the padded batch, so they are a suffix of the last shard(s): rank ``r``
holds ``pad_info.valid_rows(r)`` real rows followed by padding. Per-rank *metrics* must never be trimmed by
dropping list entries (verl's DP_COMPUTE_METRIC collection drops whole ranks' entries): keep one entry per
rank and weight it by ``pad_info.valid_counts`` (``reduce_metrics(per_rank, weights=pad_info.valid_counts)``),
or mask rows with ``pad_info.row_mask()``.

An empty batch (``B = 0``) splits into ``dp_size`` empty shards without padding, and merges back to an empty
batch; callers that cannot run a step on zero rows should check ``pad_info.batch_size`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from ppo_core._checks import check_choice
from ppo_core.batch._td import _check_batch, _slice
from ppo_core.batch.ops import concat, pad_to_multiple

__all__ = ["PAD_MODES", "PadInfo", "merge_from_dp", "split_for_dp"]

PAD_MODES = ("error", "repeat")
"""Valid ``pad`` arguments of :func:`split_for_dp`."""


@dataclass(frozen=True, kw_only=True)
class PadInfo:
    """Where the padding of a data-parallel split is: everything :func:`merge_from_dp` needs to undo it."""

    batch_size: int
    """Number of real rows ``B`` before padding."""
    dp_size: int
    """Number of shards (data-parallel ranks)."""
    shard_size: int
    """Rows per shard ``S = (B + pad_size) / dp_size``."""
    pad_size: int
    """Padding rows appended after the real rows (0 when ``B`` is a multiple of ``dp_size``)."""

    def valid_rows(self, rank: int) -> int:
        """Number of real rows at the start of shard ``rank`` (the rest, if any, is padding)."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}")
        return max(0, min(self.shard_size, self.batch_size - rank * self.shard_size))

    @property
    def valid_counts(self) -> list[int]:
        """``[dp_size]`` real-row counts per rank: the weights for per-rank metrics."""
        return [self.valid_rows(r) for r in range(self.dp_size)]

    def row_mask(self) -> torch.Tensor:
        """``[dp_size, shard_size]`` bool, True on real rows and False on padding rows."""
        return (
            torch.arange(self.dp_size * self.shard_size).reshape(self.dp_size, self.shard_size)
            < self.batch_size
        )


def split_for_dp(
    batch: TensorDictBase, dp_size: int, pad: str = "error", *, copy: bool = True
) -> tuple[list[TensorDictBase], PadInfo]:
    """Split ``batch`` into ``dp_size`` contiguous, equal shards in rank order (compact clones by default).

    Args:
        batch: TensorDict with ``batch_size=[B]`` (tensors ``[B, ...]`` and non-tensor fields).
        dp_size: number of data-parallel ranks, ``>= 1``.
        pad: ``"error"`` raises when ``B % dp_size != 0``; ``"repeat"`` pads with copies of rows first.
        copy: True: every shard is a clone with its own compact storage, safe to pickle, send or modify.
            False: every shard is a row slice (a view) of the batch (of the padded copy when padding was
            needed): no bytes are copied, writes to a shard write to the batch, and pickling a shard as is
            serializes the parent's whole storage. Only for callers that compact the shards themselves
            before they leave the process (a shared-memory transport that copies them, or a compacting
            pickle); a worker group opts in with ``WorkerGroup.compacts_payloads``.

    Returns:
        ``(shards, pad_info)``: ``dp_size`` TensorDicts of ``S = ceil(B / dp_size)`` rows each (clones or views,
        see ``copy``), and the :class:`PadInfo` to pass to :func:`merge_from_dp`.

    Raises:
        ValueError: ``dp_size < 1``, an unknown ``pad`` (valid names are listed), or ``pad="error"`` with a batch
            size that ``dp_size`` does not divide (the message names both).

    Example:
        >>> from tensordict import TensorDict
        >>> shards, info = split_for_dp(TensorDict({"x": torch.arange(5)}, batch_size=[5]), 2, pad="repeat")
        >>> [s["x"].tolist() for s in shards], info.valid_counts
        ([[0, 1, 2], [3, 4, 0]], [3, 2])
        >>> merge_from_dp(shards, info)["x"].tolist()
        [0, 1, 2, 3, 4]
        >>> batch = TensorDict({"x": torch.arange(4)}, batch_size=[4])
        >>> views, _ = split_for_dp(batch, 2, copy=False)
        >>> views[1]["x"].untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()
        True
    """
    size = _check_batch("batch", batch)
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    check_choice("pad", pad, PAD_MODES)
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
    if size % dp_size != 0:
        if pad == "error":
            raise ValueError(
                f"batch size {size} is not divisible by dp_size={dp_size}; pass pad='repeat' to pad it to "
                f"{size + (-size) % dp_size} rows, or resize the batch"
            )
        batch, pad_size = pad_to_multiple(batch, dp_size)
    else:
        pad_size = 0
    shard_size = (size + pad_size) // dp_size
    cut = _slice if copy else _view
    shards = [cut(batch, r * shard_size, (r + 1) * shard_size) for r in range(dp_size)]
    info = PadInfo(batch_size=size, dp_size=dp_size, shard_size=shard_size, pad_size=pad_size)
    return shards, info


def merge_from_dp(parts: Sequence[TensorDictBase], pad_info: PadInfo) -> TensorDictBase:
    """Concatenate per-rank batches in rank order and remove the padding added by :func:`split_for_dp`.

    Args:
        parts: ``dp_size`` TensorDicts in rank order (not completion order), each with ``shard_size`` rows; the
            workers may have added or replaced fields, but every part must have the same keys and dtypes.
        pad_info: the :class:`PadInfo` returned by the split.

    Returns:
        A TensorDict of ``pad_info.batch_size`` rows: row ``i`` comes from row ``i`` of the split batch.

    Raises:
        ValueError: wrong number of parts, or a part whose size is not ``shard_size`` (names the rank).

    Example:
        >>> from tensordict import TensorDict
        >>> shards, info = split_for_dp(TensorDict({"x": torch.arange(4)}, batch_size=[4]), 2)
        >>> merge_from_dp(shards, info)["x"].tolist()
        [0, 1, 2, 3]
    """
    if not isinstance(pad_info, PadInfo):
        raise TypeError(f"pad_info must be a PadInfo, got {type(pad_info).__name__}")
    if isinstance(parts, TensorDictBase) or len(parts) != pad_info.dp_size:
        got = "a TensorDict" if isinstance(parts, TensorDictBase) else f"{len(parts)} parts"
        raise ValueError(f"parts must be a sequence of dp_size={pad_info.dp_size} TensorDicts, got {got}")
    for rank, part in enumerate(parts):
        rows = _check_batch(f"parts[{rank}]", part)
        if rows != pad_info.shard_size:
            raise ValueError(
                f"parts[{rank}] has {rows} rows but every shard had shard_size={pad_info.shard_size} rows"
            )
    # views suffice: concat copies every row into new storage anyway
    trimmed = [_view(part, 0, pad_info.valid_rows(rank)) for rank, part in enumerate(parts)]
    return concat(trimmed)


def _view(batch: TensorDictBase, start: int, stop: int) -> TensorDictBase:
    """Rows ``start:stop`` as a view sharing ``batch``'s storage (see ``copy`` of :func:`split_for_dp`)."""
    return batch[start:stop]
